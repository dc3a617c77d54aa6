"""The e2b backend: the episode's loop runs in an E2B sandbox, its model and tools on the host.

An optimizer mutates agent code, and mutated code must not run on the host. `E2BRuntime`
(the same surface as `EpisodeRuntime`: `run`, `abort`, `close`, `log`)
runs the episode's loop, the document's `code:runtime` program or else the built-in loop,
as a *runner* process in a fresh sandbox, and answers what it asks for on the host: model
calls with the host's provider, tool calls with the episode's environment (harbor's task
environment in production). The host stays the authority: it counts every budget, checks
every boundary, records every step, and ends the episode by killing the sandbox.

Deployment. The sandbox needs nothing but `python3` (3.8 or newer, standard library only),
so E2B's default `base` template works. Per attempt the runtime creates a sandbox from the
template (timeout: the episode's remaining budget plus `sandbox_grace_s`, so it outlives
the episode but never by much), uploads `portable.py` (`wmo_trio/episode/portable.py`, read
from the installed package: the same program an in-process episode runs) and
`episode.json` (the episode spec: instruction, derived document data, the code) to
`/tmp/wmo-trio-<sandbox id>/`, and starts `python3 -I portable.py episode.json` with its
stdin open: the *runner*.

Frame protocol (version 2; the host's half is `wmo_trio.backends._frames`, shared with the
sandbox backend, which decodes each request into the `ProgramChannel` every backend
shares). Each frame is one JSON object on one line: the runner writes requests to its
stdout, the host answers on its stdin (through envd's SendInput). One request is
outstanding at a time and every reply echoes its request's `id`.

    runner -> host                                        host -> runner
    {"type": "hello", "protocol": 2, "python": "3.11.7"}  (none; must come first)
                                          {"type": "episode", "spec": object} (the spec, to a
                                           runner started as `portable.py -`: the sandbox
                                           backend's, `wmo_trio.backends._sandbox`)
    {"type": "complete", "id": n, "request": ProviderRequest}
                                          {"type": "completion", "id": n, "response": ProviderResponse
                                           and "turns_left": int}
    {"type": "execute", "id": n, "tool": str, "arguments": object | null,
     "content": str | null, "parse_error": str | null}
                                          {"type": "observation", "id": n, "observation": Observation}
    {"type": "step", "step": Step}        (none; message steps only, such as nudges and a
                                           program's error: tool steps are recorded by the host)
    {"type": "done", "stop_reason": str, "answer": str}   (none; the last frame)

`ProviderRequest`, `ProviderResponse`, `Observation` and `Step` are the JSON of the models
of the same names. For a `code:runtime` program the host makes every request plain text
(tools dropped, output capped by the document). There is no stop frame: when the host ends
the episode (submit, a budget, cancellation, a provider error) it kills the sandbox.

Stop reasons of the failures (each with a final error step saying what happened; the
partial transcript is kept; the sandbox is killed):

- sandbox creation failed, rate limiting (429) included: `error` (a transport failure);
- the runner died, or its stream broke, before its `done` frame: `error` (transport);
- a line on the runner's stdout that is not JSON: `error` (transport);
- a well-formed frame that breaks the protocol (unknown type, bad fields, no hello, a tool
  step): `error`, never replayed, as the same request ends an in-process episode;
- a `done` frame whose reason is not one the runner may give: `unknown_done_reason`
  (`EpisodeServices.finish` decides which it may give).

Every request is answered by the episode's `ProgramChannel` and `EpisodeServices`, under
exactly the rules of an in-process episode. Cancellation and the wall-clock budget are checked at every frame
(so before every model call and tool call) and interrupt the host-side call in flight;
`abort()` also kills the sandbox at once, which stops even a program that is busy
computing.

Transport failures may be replayed on a fresh sandbox, at most `transport_retries` times and
only while the episode has not run a single environment action: a task environment is
mutable, and a replay after a change would score a different episode. The failed attempt's
steps stay in the transcript, followed by a step that says a replay starts.

Credentials: `E2B_API_KEY` (`wmo_trio.backends.check_backend` fails early without it).
The SDK's own variables choose the endpoints (`E2B_DOMAIN`, and `E2B_API_URL` /
`E2B_SANDBOX_URL`, which the tests point at a loopback fake).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import shlex
import threading
from importlib import resources
from typing import Annotated, Any

from e2b import CommandExitException, Sandbox
from pydantic import Field

from wmo_trio.backends._frames import (
    MAX_FRAME_BYTES,
    WAKE,
    Exited,
    TransportFailure,
    ended_early,
    serve_frames,
)
from wmo_trio.episode.channel import ProtocolViolation, refuse
from wmo_trio.episode.environment import Environment
from wmo_trio.episode.runtime import RuntimeBase
from wmo_trio.episode.services import EpisodeEnded, EpisodeServices, episode_mode, episode_spec
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import RunResult, StopReason
from wmo_trio.providers.base import Provider
from wmo_trio.settings import NonEmptyText, PositiveSeconds, Settings, TemplateName

__all__ = ["DEFAULT_TEMPLATE", "E2BRuntime", "E2BSettings"]

log = logging.getLogger("wmo_trio.backends.e2b")

DEFAULT_TEMPLATE = "base"
RUNNER_SOURCE = resources.files("wmo_trio.episode").joinpath("portable.py").read_text(encoding="utf-8")
MAX_FRAME_CHARS = MAX_FRAME_BYTES
_STDERR_TAIL_CHARS = 2000


class E2BSettings(Settings):
    """How episodes use E2B.

    - `template`: the sandbox template (name or id); it needs `python3` >= 3.8.
    - `api_key`: None reads `E2B_API_KEY`, as the SDK does.
    - `python`: the interpreter that runs the runner in the sandbox.
    - `transport_retries`: replays on a fresh sandbox after a transport failure, only
      before the episode's first environment action. 0 for harbor (mutable tasks).
    - `sandbox_grace_s`: how long a sandbox may outlive its episode's budget if every kill
      fails; E2B then ends it itself.
    - `request_timeout_s`: bound of each E2B API and envd request.
    """

    template: TemplateName = DEFAULT_TEMPLATE
    api_key: str | None = None
    python: NonEmptyText = "python3"
    transport_retries: Annotated[int, Field(ge=0, description="an integer >= 0")] = 0
    sandbox_grace_s: PositiveSeconds = 60.0
    request_timeout_s: PositiveSeconds = 60.0


class _RunnerProcess:
    """The runner in one sandbox: its frames arrive through a reader thread, replies go
    out through envd's SendInput.

    The reader thread lives as long as the command's output stream, which ends when the
    process exits or the sandbox is killed (and at the latest at the command timeout).
    """

    def __init__(self, sandbox: Sandbox, handle: Any, request_timeout_s: float) -> None:
        self.sandbox = sandbox
        self._handle = handle
        self._request_timeout_s = request_timeout_s
        self._frames: queue.Queue[object] = queue.Queue()
        self._buffer = ""
        self._overflowed = False
        self._stderr = ""
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name=f"wmo-trio-runner-{sandbox.sandbox_id}")
        self._thread.start()

    def _on_stdout(self, chunk: str) -> None:
        if self._overflowed:
            return
        self._buffer += chunk
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            self._frames.put(line)
        if len(self._buffer) > MAX_FRAME_CHARS:
            self._overflowed = True
            self._frames.put(Exited(None, f"the runner wrote over {MAX_FRAME_CHARS} characters "
                                           "without ending a frame"))

    def _on_stderr(self, chunk: str) -> None:
        self._stderr = (self._stderr + chunk)[-_STDERR_TAIL_CHARS:]

    def _read(self) -> None:
        try:
            result = self._handle.wait(on_stdout=self._on_stdout, on_stderr=self._on_stderr)
            exited = Exited(result.exit_code)
        except CommandExitException as error:
            exited = Exited(error.exit_code)
        except Exception as error:
            exited = Exited(None, f"{type(error).__name__}: {error}")
        self._frames.put(exited)

    def next(self, timeout: float | None) -> object:
        """The next line, an `Exited`, or `WAKE` (woken, or `timeout` passed)."""
        try:
            return self._frames.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return WAKE

    def wake(self) -> None:
        self._frames.put(WAKE)

    def send(self, frame: dict[str, Any]) -> None:
        try:
            self.sandbox.commands.send_stdin(self._handle.pid, json.dumps(frame) + "\n",
                                             request_timeout=self._request_timeout_s)
        except Exception as error:
            raise TransportFailure(
                f"could not send a frame to the runner: {type(error).__name__}: {error}"
            ) from error

    def describe(self, exited: Exited) -> str:
        return ended_early(exited, self._stderr)


class E2BRuntime(RuntimeBase):
    """Runs one episode of `doc` with its loop in an E2B sandbox. See the module docstring.

    `run()` returns a `RunResult` for every ending, failures of the sandbox included, and
    raises only on a defect of wmo_trio. `abort()` kills the sandbox at once; `close()`
    (idempotent) kills whatever sandbox is left. Both may be called from any thread.
    """

    def __init__(self, doc: HarnessDoc, provider: Provider, *,
                 settings: E2BSettings | None = None, **kwargs: Any) -> None:
        super().__init__(doc, provider, **kwargs)
        self.settings = settings or E2BSettings()
        self.mode = episode_mode(doc)
        self.sandbox_ids: list[str] = []
        self._sandbox: Sandbox | None = None
        self._runner: _RunnerProcess | None = None

    # -- control from other threads -------------------------------------------------------

    def kill_program(self) -> None:
        """Kill the sandbox (which wakes the serving thread too)."""
        self._kill_sandbox()

    def wake(self) -> None:
        runner = self._runner
        if runner is not None:
            runner.wake()

    def _kill_sandbox(self) -> None:
        with self._lock:
            sandbox, self._sandbox = self._sandbox, None
            runner = self._runner
        if runner is not None:
            runner.wake()
        if sandbox is None:
            return
        try:
            sandbox.kill(request_timeout=self.settings.request_timeout_s)
        except Exception:
            log.warning("killing sandbox %s failed; E2B ends it at its timeout",
                        sandbox.sandbox_id, exc_info=True)

    # -- the episode ----------------------------------------------------------------------

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult:
        with self._episode(environment):
            services = self._services(environment)
            spec = episode_spec(self.doc, task_id=task_id, instruction=instruction,
                                context_window=self.context_window)
            payload = json.dumps(spec).encode("utf-8")
            try:
                reason, answer = self._attempts(services, payload, task_id)
            except EpisodeEnded as ended:
                reason, answer = ended.reason, ended.answer
            finally:
                self._kill_sandbox()
        return self._result(task_id, reason, answer)

    def _attempts(self, services: EpisodeServices, payload: bytes,
                  task_id: str) -> tuple[StopReason, str]:
        retries = self.settings.transport_retries
        attempt = 0
        while True:
            services.boundary()
            attempt += 1
            services.begin_attempt()
            known = len(self.sandbox_ids)
            try:
                return self._attempt(services, payload, task_id)
            except TransportFailure as failure:
                services.boundary()  # a sandbox killed by abort() or the budget ends as that
                where = {"attempt": attempt, "sandbox_id": self._new_sandbox_id(known)}
                if attempt <= retries and services.env_actions == 0:
                    services.record_error(
                        f"sandbox transport failed: {failure}; replaying the episode on a fresh "
                        f"sandbox (attempt {attempt + 1} of {retries + 1})", **where)
                    continue
                why = ("; not replayed: the episode already ran an environment action"
                       if attempt <= retries else "")
                services.record_error(f"sandbox transport failed: {failure}{why}", **where)
                return StopReason.ERROR, ""
            except ProtocolViolation as violation:
                return refuse(services, violation, attempt=attempt,
                              sandbox_id=self._new_sandbox_id(known))
            finally:
                self._kill_sandbox()

    def _new_sandbox_id(self, known: int) -> str | None:
        return self.sandbox_ids[-1] if len(self.sandbox_ids) > known else None

    def _create_sandbox(self, services: EpisodeServices, task_id: str) -> Sandbox:
        remaining = self.control.remaining() or 0.0
        lifetime = math.ceil(remaining + self.settings.sandbox_grace_s)
        try:
            with self.control.blocking():
                sandbox = Sandbox.create(
                    template=self.settings.template,
                    timeout=lifetime,
                    metadata={"created_by": "wmo_trio", "task_id": task_id[:200]},
                    api_key=self.settings.api_key,
                    request_timeout=self.settings.request_timeout_s,
                )
        except Exception as error:
            raise TransportFailure(f"creating a sandbox from template {self.settings.template!r} "
                                    f"failed: {type(error).__name__}: {error}") from error
        with self._lock:
            self._sandbox = sandbox
            self.sandbox_ids.append(sandbox.sandbox_id)
        if self.stopping():  # aborted while the creation was in flight
            self._kill_sandbox()
            services.boundary()
        return sandbox

    def _attempt(self, services: EpisodeServices, payload: bytes,
                 task_id: str) -> tuple[StopReason, str]:
        sandbox = self._create_sandbox(services, task_id)
        workdir = f"/tmp/wmo-trio-{sandbox.sandbox_id}"
        command = " ".join(shlex.quote(part) for part in (
            self.settings.python, "-I", f"{workdir}/portable.py", f"{workdir}/episode.json"))
        lifetime = math.ceil((self.control.remaining() or 0.0) + self.settings.sandbox_grace_s)
        try:
            with self.control.blocking():
                sandbox.files.write_files(
                    [{"path": f"{workdir}/portable.py", "data": RUNNER_SOURCE},
                     {"path": f"{workdir}/episode.json", "data": payload}],
                    request_timeout=self.settings.request_timeout_s,
                )
                handle = sandbox.commands.run(command, background=True, stdin=True, cwd=workdir,
                                              timeout=lifetime)
        except Exception as error:
            raise TransportFailure(
                f"starting the runner failed: {type(error).__name__}: {error}") from error
        runner = _RunnerProcess(sandbox, handle, self.settings.request_timeout_s)
        with self._lock:
            self._runner = runner
        return serve_frames(runner, services, self.control)
