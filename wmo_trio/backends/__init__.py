"""Where an episode's program runs, chosen per episode by name.

- `local`: `wmo_trio.episode.EpisodeRuntime`; the program runs in this process (a
  `code:runtime` program with this process's rights: trusted code only);
- `e2b`: `wmo_trio.backends.e2b.E2BRuntime`; the program runs in an E2B sandbox, the host
  answering its model and tool calls;
- `sandbox`: `SandboxRuntime` (`_sandbox`, its runner `_sandbox_runner`); the program
  runs in a bubblewrap sandbox of its own on this machine, the host answering as for
  `e2b`. Its settings (`SandboxSettings`), profile (`RUNNER_PROFILE`) and availability
  check (`sandbox_problem`) are exported here, imported on first use.

Each is declared once, in `BACKENDS` (a `Backend`): its name, its runtime and its settings
model (imported on first use, as a provider's class is: the e2b SDK only when an `e2b`
runtime is built), whether aborting it is quick, whether it keeps a program from this host,
and what it needs from this machine. The harbor agent, the research API and `wmo-trio run`
name a backend and ask here; none of them knows one from another.

No backend named (None): `sandbox` for a document with a `code:runtime` program where this
machine can run it, `local` otherwise (`resolve_backend`).

The program (built-in loop or document code) and the rules it runs under are the same on
all three: `wmo_trio.episode.portable` and `wmo_trio.episode.services`; `e2b` and `sandbox`
share the host's half of the frames (`wmo_trio.backends._frames`). Every runtime has the
`Runtime` surface (`wmo_trio.episode.runtime.Runtime`), so the caller does not care which
it got.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Self, get_args

from pydantic import Field, model_validator

from wmo_trio._lazy import lazy_exports
from wmo_trio.control import CallControl
from wmo_trio.episode.log import EpisodeLog
from wmo_trio.episode.runtime import Runtime, RuntimeBase
from wmo_trio.harness import HarnessDoc
from wmo_trio.providers.base import Provider
from wmo_trio.settings import EpisodeSettings, Settings, TemplateName, refused

if TYPE_CHECKING:
    from wmo_trio.backends._sandbox import (
        RUNNER_PROFILE,
        SandboxRuntime,
        SandboxSettings,
        sandbox_problem,
    )

__all__ = ["BACKENDS", "RUNNER_PROFILE", "Backend", "BackendChoice", "Runtime", "SandboxRuntime",
           "SandboxSettings", "backend_named", "build_runtime", "check_backend",
           "choice_may_block", "choose_backend", "resolve_backend", "sandbox_problem",
           "unisolated_code_warning"]

# The sandbox backend's modules load only in a process that uses it, as e2b's do: most
# trials never name it.
__getattr__ = lazy_exports(__name__, dict.fromkeys(
    ("RUNNER_PROFILE", "SandboxRuntime", "SandboxSettings", "sandbox_problem"),
    "wmo_trio.backends._sandbox"))

BackendName = Literal["local", "e2b", "sandbox"]
E2B_API_KEY_VARIABLE = "E2B_API_KEY"


@dataclass(frozen=True)
class Backend:
    """One place an episode's program can run, as the rest of wmo_trio knows it.

    - `runtime`: its runtime class (`module:Class`, a `RuntimeBase` that takes the
      backend's settings as `settings`), imported when a runtime is built;
    - `settings`: its settings model (`module:Class`), None when it has none;
    - `abort_is_quick`: aborting its runtime only sets flags and sends signals, so the
      engine stops its episode on the trio thread (E2B's kills a sandbox over the network:
      a thread of its own);
    - `isolated`: a document's `code:runtime` cannot reach this host;
    - `check_may_block`: its check may start a process (the sandbox's first starts a
      sandbox): keep it off an event loop's thread;
    - `unavailable(settings)`: why it cannot run here with these settings, and what to do,
      or None.
    """

    name: BackendName
    runtime: str
    settings: str | None
    abort_is_quick: bool
    isolated: bool
    check_may_block: bool
    unavailable: Callable[[Any], str | None]

    def settings_for(self, given: Settings | Mapping[str, Any] | None) -> Settings | None:
        """`given` checked by this backend's settings model (its defaults for None); a
        `ValueError` saying what to change otherwise."""
        if self.settings is None:
            if given:
                raise ValueError(f"harness_backend={self.name!r} takes no settings")
            return None
        model: type[Settings] = _imported(self.settings)
        if isinstance(given, model):
            return given
        data = given.model_dump() if isinstance(given, Settings) else given or {}
        checked: Settings = model.parse(data, where=f"harness_backend={self.name!r}: ")
        return checked

    def check(self, settings: Settings | None = None) -> None:
        """A `ValueError` saying what to do when this backend cannot run here."""
        problem = self.unavailable(settings)
        if problem is not None:
            raise ValueError(problem)

    def runtime_class(self) -> type[RuntimeBase]:
        runtime: type[RuntimeBase] = _imported(self.runtime)
        return runtime


def _imported(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _local_unavailable(settings: object) -> str | None:
    return None


def _sandbox_unavailable(settings: object) -> str | None:
    from wmo_trio.backends._sandbox import sandbox_problem  # the first look starts a sandbox

    problem = sandbox_problem()
    if problem is None:
        return None
    return (f"harness_backend='sandbox' cannot run on this machine: {problem}. Use "
            "harness_backend='e2b' for untrusted code, or 'local' for code you trust")


def _e2b_unavailable(settings: Any) -> str | None:
    if (settings is not None and settings.api_key) or os.environ.get(E2B_API_KEY_VARIABLE):
        return None
    return (f"harness_backend='e2b' needs an E2B API key: set the {E2B_API_KEY_VARIABLE} "
            "environment variable (E2B_DOMAIN, E2B_API_URL and E2B_SANDBOX_URL choose the "
            "endpoints, as in the e2b SDK)")


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    Backend("local", "wmo_trio.episode.runtime:EpisodeRuntime", None,
            abort_is_quick=True, isolated=False, check_may_block=False,
            unavailable=_local_unavailable),
    Backend("e2b", "wmo_trio.backends.e2b:E2BRuntime", "wmo_trio.backends.e2b:E2BSettings",
            abort_is_quick=False, isolated=True, check_may_block=False,
            unavailable=_e2b_unavailable),
    Backend("sandbox", "wmo_trio.backends._sandbox:SandboxRuntime",
            "wmo_trio.backends._sandbox:SandboxSettings",
            abort_is_quick=True, isolated=True, check_may_block=True,
            unavailable=_sandbox_unavailable),
)}
assert tuple(BACKENDS) == get_args(BackendName)


class BackendChoice(Settings):
    """Where an episode's program runs, as the harbor agent's arguments say it:
    `harness_backend` (None: chosen per document, see `resolve_backend`), and for `e2b`
    its template."""

    harness_backend: BackendName | None = Field(
        default=None, description=f"one of {', '.join(map(repr, BACKENDS))}")
    e2b_template: TemplateName | None = None

    @model_validator(mode="after")
    def _template_only_for_e2b(self) -> Self:
        if self.harness_backend != "e2b" and self.e2b_template is not None:
            raise refused("e2b_template is only valid with harness_backend='e2b'")
        return self

    @property
    def backend_settings(self) -> dict[str, Any]:
        """The named backend's own settings among these arguments (e2b's template)."""
        return {} if self.e2b_template is None else {"template": self.e2b_template}


def backend_named(name: object) -> Backend:
    """The backend called `name`; a `ValueError` naming the known ones otherwise."""
    named = BACKENDS.get(name) if isinstance(name, str) else None
    if named is None:
        BackendChoice.parse({"harness_backend": name})  # raises, naming the known ones
        raise AssertionError(f"{name!r} is a backend without a declaration")
    return named


def check_backend(backend: object, e2b_template: object = None, *,
                  settings: Settings | Mapping[str, Any] | None = None) -> BackendChoice:
    """The harbor agent's backend arguments checked: a `ValueError` naming what to change
    when they are wrong or the backend named cannot run here (`settings`: its own, such as
    an E2B API key); the choice otherwise."""
    choice: BackendChoice = BackendChoice.parse({"harness_backend": backend, "e2b_template": e2b_template})
    if choice.harness_backend is not None:
        named = BACKENDS[choice.harness_backend]
        given = settings.model_dump() if isinstance(settings, Settings) else dict(settings or {})
        named.check(named.settings_for({**choice.backend_settings, **given}))
    return choice


def resolve_backend(doc: HarnessDoc, backend: str | None) -> str:
    """`backend`, or when None the default for `doc`: `sandbox` for a `code:runtime`
    program where this machine can run it, else `local` (the built-in loop is this
    package's own code)."""
    if backend is not None:
        return backend
    if doc.runtime_code is None:
        return "local"
    return "sandbox" if BACKENDS["sandbox"].unavailable(None) is None else "local"


def choose_backend(doc: HarnessDoc, backend: str | None,
                   settings: Settings | Mapping[str, Any] | None = None) -> Backend:
    """The backend for `doc`: `backend` checked (a `ValueError` saying what to change when
    it is unknown or cannot run here with `settings`), or the default (`resolve_backend`)."""
    chosen = backend_named(resolve_backend(doc, backend))
    chosen.check(chosen.settings_for(settings))
    return chosen


def choice_may_block(doc: HarnessDoc, backend: str | None) -> bool:
    """Whether `choose_backend(doc, backend)` may block (start a process): off an event
    loop's thread then."""
    if backend is None:
        return doc.runtime_code is not None  # the default looks for the sandbox
    named = BACKENDS.get(backend) if isinstance(backend, str) else None
    return named is not None and named.check_may_block


def unisolated_code_warning(doc: HarnessDoc, backend: Backend) -> str | None:
    """What to tell whoever runs `doc` on `backend` when its code would reach this host."""
    if doc.runtime_code is None or backend.isolated:
        return None
    return ("code:runtime runs in this process with the host's rights (trusted code only); "
            "use harness_backend='sandbox' (Linux with bubblewrap) or 'e2b' for mutated "
            "candidates")


def build_runtime(
    doc: HarnessDoc,
    provider: Provider,
    episode_settings: EpisodeSettings | Mapping[str, Any] | None = None,
    *,
    backend: str | None = None,
    backend_settings: Settings | Mapping[str, Any] | None = None,
    control: CallControl | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[EpisodeLog], None] | None = None,
) -> Runtime:
    """The runtime for one episode of `doc` on `backend` (see the module's table; None
    chooses by the document), with the episode's settings (`EpisodeSettings`, or a mapping
    checked by its rules) and the backend's own (`backend_settings`, checked by its
    settings model: `SandboxSettings`, `E2BSettings`; an E2B episode is never replayed
    on a fresh sandbox unless `transport_retries` says so, since a task environment is
    mutable). A `ValueError` saying what to change when the backend cannot run.
    """
    chosen = backend_named(resolve_backend(doc, backend))
    settings = chosen.settings_for(backend_settings)
    chosen.check(settings)
    own = {} if settings is None else {"settings": settings}
    return chosen.runtime_class()(doc, provider, episode_settings=episode_settings,
                                  control=control, should_cancel=should_cancel,
                                  on_progress=on_progress, **own)
