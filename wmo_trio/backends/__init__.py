"""Where an episode's program runs, chosen per episode.

- `local`: `wmo_trio.episode.EpisodeRuntime`; the program runs in this process (a
  `code:runtime` program with this process's rights: trusted code only);
- `e2b`: `wmo_trio.backends.e2b.E2BRuntime`; the program runs in an E2B sandbox, the host
  answering its model and tool calls;
- `sandbox`: `wmo_trio.backends.sandbox.SandboxRuntime`; the program runs in a bubblewrap
  sandbox of its own on this machine, the host answering as for `e2b`.

No backend named (None): `sandbox` for a document with a `code:runtime` program where this
machine can run it, `local` otherwise (`resolve_backend`).

The program (built-in loop or document code) and the rules it runs under are the same on
all three: `wmo_trio.episode.portable` and `wmo_trio.episode.services`; `e2b` and `sandbox`
share the host's half of the frames (`wmo_trio.backends._frames`). Every runtime has the
`Runtime` surface (`wmo_trio.episode.runtime.Runtime`), so the caller does not care which
it got. The e2b SDK is imported only when an `e2b` runtime is built.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Self, get_args

from pydantic import Field, model_validator

from wmo_trio.control import CallControl
from wmo_trio.episode.log import EpisodeLog
from wmo_trio.episode.runtime import DEFAULT_EPISODE_TIMEOUT_SEC, EpisodeRuntime, Runtime
from wmo_trio.harness import HarnessDoc
from wmo_trio.providers.base import Provider
from wmo_trio.settings import Settings, TemplateName, refused

if TYPE_CHECKING:
    from wmo_trio.backends.e2b import E2BSettings
    from wmo_trio.backends.sandbox import SandboxSettings

__all__ = ["BACKENDS", "BackendChoice", "Runtime", "build_runtime", "check_backend", "check_e2b_key",
           "resolve_backend"]

Backend = Literal["local", "e2b", "sandbox"]
BACKENDS: tuple[str, ...] = get_args(Backend)
E2B_API_KEY_VARIABLE = "E2B_API_KEY"


class BackendChoice(Settings):
    """Where an episode's program runs: `harness_backend` (None: chosen per document, see
    `resolve_backend`), and for `e2b` its template."""

    harness_backend: Backend | None = Field(
        default=None, description=f"one of {', '.join(map(repr, BACKENDS))}")
    e2b_template: TemplateName | None = None

    @model_validator(mode="after")
    def _template_only_for_e2b(self) -> Self:
        if self.harness_backend != "e2b" and self.e2b_template is not None:
            raise refused("e2b_template is only valid with harness_backend='e2b'")
        return self


def check_backend(backend: object, e2b_template: object = None, *,
                  api_key: str | None = None) -> BackendChoice:
    """Fail early, with a `ValueError` naming what to change, when `backend` cannot run;
    the choice, checked, otherwise. `e2b` needs an API key (see `check_e2b_key`),
    `sandbox` a machine that can run it (see `check_sandbox`)."""
    choice: BackendChoice = BackendChoice.parse({"harness_backend": backend, "e2b_template": e2b_template})
    if choice.harness_backend == "e2b":
        check_e2b_key(api_key)
    elif choice.harness_backend == "sandbox":
        check_sandbox()
    return choice


def check_sandbox() -> None:
    """The `sandbox` backend needs Linux, bubblewrap and namespaces: a `ValueError` naming
    what is missing otherwise (the first check starts one sandbox; later ones are free)."""
    from wmo_trio.backends.sandbox import sandbox_problem

    problem = sandbox_problem()
    if problem is not None:
        raise ValueError(f"harness_backend='sandbox' cannot run on this machine: {problem}. "
                         "Use harness_backend='e2b' for untrusted code, or 'local' for code "
                         "you trust")


def resolve_backend(doc: HarnessDoc, backend: str | None) -> str:
    """`backend`, or when None the default for `doc`: `sandbox` for a `code:runtime`
    program where this machine can run it, else `local` (the built-in loop is this
    package's own code)."""
    if backend is not None:
        return backend
    if doc.runtime_code is None:
        return "local"
    from wmo_trio.backends.sandbox import sandbox_problem

    return "sandbox" if sandbox_problem() is None else "local"


def check_e2b_key(api_key: str | None = None) -> None:
    """The `e2b` backend needs an API key: `api_key`, or the `E2B_API_KEY` environment
    variable; a `ValueError` saying how to give one otherwise."""
    if not (api_key or os.environ.get(E2B_API_KEY_VARIABLE)):
        raise ValueError(
            f"harness_backend='e2b' needs an E2B API key: set the {E2B_API_KEY_VARIABLE} "
            "environment variable (E2B_DOMAIN, E2B_API_URL and E2B_SANDBOX_URL choose the "
            "endpoints, as in the e2b SDK)"
        )


def build_runtime(
    doc: HarnessDoc,
    provider: Provider,
    *,
    control: CallControl | None = None,
    backend: str | None = None,
    e2b_template: str | None = None,
    episode_timeout_sec: float = DEFAULT_EPISODE_TIMEOUT_SEC,
    context_window: int | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[EpisodeLog], None] | None = None,
    transport_retries: int | None = None,
    e2b_settings: E2BSettings | None = None,
    sandbox_settings: SandboxSettings | None = None,
) -> Runtime:
    """The runtime for one episode of `doc` on `backend` (see the module's table; None
    chooses by the document).

    For `e2b`: `e2b_template` and `transport_retries`, when given, override the fields of
    `e2b_settings` (defaults: template "base", 0 retries, so an episode is never replayed
    against a task environment it may have changed). The others ignore them.
    `sandbox_settings`: the `sandbox` backend's ceilings and pool.
    """
    api_key = e2b_settings.api_key if e2b_settings is not None else None
    check_backend(backend, e2b_template, api_key=api_key)
    backend = resolve_backend(doc, backend)
    if backend == "local":
        return EpisodeRuntime(
            doc, provider, control=control, episode_timeout_sec=episode_timeout_sec,
            should_cancel=should_cancel, context_window=context_window, on_progress=on_progress,
        )
    if backend == "sandbox":
        from wmo_trio.backends.sandbox import SandboxRuntime

        return SandboxRuntime(
            doc, provider, control=control, episode_timeout_sec=episode_timeout_sec,
            should_cancel=should_cancel, context_window=context_window, on_progress=on_progress,
            settings=sandbox_settings,
        )
    from wmo_trio.backends.e2b import E2BRuntime, E2BSettings

    overrides = {name: value for name, value in (("template", e2b_template),
                                                  ("transport_retries", transport_retries))
                 if value is not None}
    settings = E2BSettings.parse({**(e2b_settings or E2BSettings()).model_dump(), **overrides})
    return E2BRuntime(
        doc, provider, control=control, episode_timeout_sec=episode_timeout_sec,
        should_cancel=should_cancel, context_window=context_window, on_progress=on_progress,
        settings=settings,
    )
