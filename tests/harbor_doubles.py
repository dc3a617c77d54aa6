"""Test doubles for driving the real `WmoTrioHarborAgent` many times without harbor.

The agent, the engine and the episode runtime are the code under test; harbor's task
environment and the model are not. So:

- `FakeEnvironment` speaks the part of harbor's `BaseEnvironment` the adapter uses (async
  `exec(command, cwd=None, env=None, timeout_sec=None, user=None)` returning harbor's own
  `ExecResult`, async `upload_file(source_path, target_path)`), answers each command with
  a scripted `Do` behaviour (delay, output, exception, hang, a real child process), and
  records every call's start and end on the host loop's clock.
- `BashEnvironment` actually runs each command with `bash -c` in a directory, decoding
  its output the way harbor's docker environment does (`errors="replace"`).
- `FaultyProvider` (provider kind `faulty`) is the scripted provider plus the faults a
  script cannot express: a storm of retryable errors that the retry policy rides out
  (the scripted provider answers a retry with the same reply, so its errors never
  recover), a slow or failing `close()`, and a `BaseException` from the worker.
- `run_trial` awaits `agent.run` the way harbor's trial does (`asyncio.wait_for`) and
  classifies the ending; `trace_files` checks that a logs dir holds exactly one trace.

`benchmarks/soak.py` imports this module too (one double, tested here, used there).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from harbor.environments.base import ExecResult
from harbor.models.agent.context import AgentContext

from wmo_trio.harbor import WmoTrioHarborAgent
from wmo_trio.harbor._trajectory import TRAJECTORY_FILENAME
from wmo_trio.providers import register_provider
from wmo_trio.providers._base import (
    CallControl,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
)
from wmo_trio.providers._scripted import ScriptedProvider, load_script
from wmo_trio.trace import TRACE_FILENAME, Trace, parse_trace

# A small valid harness document: two prompts, the default tools, room for long episodes.
HARNESS: dict[str, Any] = {
    "name": "faults",
    "version": 1,
    "surfaces": [
        {"id": "prompt:core", "kind": "prompt", "content": "You are a careful agent."},
        {"id": "tool_policy:main", "kind": "tool_policy",
         "content": "bash\nread_file\nwrite_file\nsubmit\n"},
        {"id": "param:max-turns", "kind": "param", "content": "30"},
        {"id": "param:max-env-actions", "kind": "param", "content": "60"},
    ],
}

# Fast retries: a storm of a few errors costs milliseconds, not the default seconds.
FAST_RETRY = {"max_attempts": 5, "base_delay_s": 0.005, "max_delay_s": 0.02}


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted tool call."""
    return {"name": name, "arguments": arguments}


def bash(command: str, **reply: Any) -> dict[str, Any]:
    """A scripted reply running one command."""
    return {"tool_calls": [call("bash", command=command)], **reply}


def submit(answer: str = "done", **reply: Any) -> dict[str, Any]:
    return {"tool_calls": [call("submit", answer=answer)], **reply}


# -- the environment ------------------------------------------------------------------------


@dataclass(frozen=True)
class Do:
    """What the environment double does for one command.

    In order: wait `delay_s` (or forever when `hang`), optionally with a real child process
    (`process_s`: a `sleep` running meanwhile, killed on cancellation the way harbor's
    docker environment kills its `docker exec`), then raise `error` or return the output.
    `cancel_cleanup_s` is how long the call takes to handle its own cancellation (harbor's
    environments kill a process there) before re-raising it; a further cancellation cuts
    that short, unless `stubborn_cleanup`.
    """

    stdout: str | None = "ok\n"
    stderr: str | None = None
    return_code: int = 0
    delay_s: float = 0.0
    hang: bool = False
    error: BaseException | None = None
    cancel_cleanup_s: float = 0.0
    stubborn_cleanup: bool = False
    process_s: float | None = None


@dataclass
class CallRecord:
    """One environment call as the double saw it (times: `time.monotonic()` on the loop)."""

    method: str
    command: str
    timeout_sec: int | None
    started: float
    ended: float | None = None
    ending: str = "running"  # returned | raised | cancelled | cleanup-interrupted
    thread: str = ""
    cancel_requests: int = 0  # how many times its task was asked to cancel


class FakeEnvironment:
    """harbor's `BaseEnvironment`, as far as the agent's adapter uses it.

    `behaviours` maps an exact command to a `Do`; `responder(command)` may compute one
    instead; anything else answers with `default`. Every call is recorded in `calls`, so
    a test can see what ran, when, and how it ended; `child_started` is set once a child
    process of a `process_s` behaviour runs.
    """

    def __init__(self, behaviours: Mapping[str, Do] | None = None, *,
                 responder: Callable[[str], Do | None] | None = None,
                 default: Do = Do()) -> None:
        self.behaviours = dict(behaviours or {})
        self.responder = responder
        self.default = default
        self.calls: list[CallRecord] = []
        self.uploads: list[tuple[str, bytes]] = []
        self.children: list[int] = []
        self.child_started = threading.Event()

    def behaviour(self, command: str) -> Do:
        if command in self.behaviours:
            return self.behaviours[command]
        if self.responder is not None:
            found = self.responder(command)
            if found is not None:
                return found
        return self.default

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        record = CallRecord("exec", command, timeout_sec, time.monotonic(),
                            thread=threading.current_thread().name)
        self.calls.append(record)
        behaviour = self.behaviour(command)
        task = asyncio.current_task()
        try:
            result = await self._perform(behaviour)
        except asyncio.CancelledError:
            record.ending = "cancelled"
            if behaviour.cancel_cleanup_s and behaviour.stubborn_cleanup:
                cleanup = asyncio.ensure_future(asyncio.sleep(behaviour.cancel_cleanup_s))
                while not cleanup.done():
                    try:
                        await asyncio.shield(cleanup)
                    except asyncio.CancelledError:
                        continue
            elif behaviour.cancel_cleanup_s:
                try:  # like an environment killing its process: cancellable, as asyncio has it
                    await asyncio.sleep(behaviour.cancel_cleanup_s)
                except asyncio.CancelledError:
                    record.ending = "cleanup-interrupted"
            raise
        except BaseException:
            record.ending = "raised"
            raise
        else:
            record.ending = "returned"
            return result
        finally:
            record.ended = time.monotonic()
            record.cancel_requests = task.cancelling() if task is not None else 0

    async def _perform(self, behaviour: Do) -> ExecResult:
        if behaviour.process_s is not None:
            await self._child(behaviour.process_s)
        if behaviour.hang:
            await asyncio.Event().wait()
        if behaviour.delay_s:
            await asyncio.sleep(behaviour.delay_s)
        if behaviour.error is not None:
            raise behaviour.error
        return ExecResult(stdout=behaviour.stdout, stderr=behaviour.stderr,
                          return_code=behaviour.return_code)

    async def _child(self, seconds: float) -> None:
        process = await asyncio.create_subprocess_exec(
            "sleep", f"{seconds:.3f}", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        self.children.append(process.pid)
        self.child_started.set()
        try:
            await process.wait()
        except asyncio.CancelledError:
            process.kill()
            await asyncio.shield(process.wait())
            raise

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        record = CallRecord("upload_file", target_path, None, time.monotonic(),
                            thread=threading.current_thread().name)
        self.calls.append(record)
        try:
            self.uploads.append((target_path, Path(source_path).read_bytes()))
            record.ending = "returned"
        finally:
            record.ended = time.monotonic()


class BashEnvironment:
    """Runs every command with `bash -c` in `workdir`, decoding output the way harbor's
    docker environment does; `upload_file` copies on this host."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.commands: list[str] = []

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        self.commands.append(command)
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=cwd or self.workdir, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_sec)
        except BaseException:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await asyncio.shield(process.wait())
            raise
        return ExecResult(
            stdout=stdout.decode(errors="replace") if stdout else None,
            stderr=stderr.decode(errors="replace") if stderr else None,
            return_code=process.returncode or 0,
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        shutil.copyfile(source_path, self.workdir / target_path)


# -- the provider ---------------------------------------------------------------------------


class WorkerDefect(BaseException):
    """A BaseException from the worker thread: what no `except Exception` catches."""


class FaultyProvider(ScriptedProvider):
    """The scripted provider (settings `script`, `latency_s`) plus injected faults:

    - `storm`: `{"kind": "rate_limit" | "server" | ..., "per_turn": N, "retry_after": s}`:
      the first N attempts of every turn fail with that retryable error; the retry policy
      then gets the scripted reply.
    - `close_delay_s`, `close_error`: `close()` sleeps, then raises `RuntimeError`.
    - `base_exception_at_turn`: that turn's call raises `WorkerDefect` (a BaseException).

    `turn_started(n)` is an event set when the call of turn `n` (0 first) begins, before its
    latency: a test fires harbor's timeout on it to land during that call.
    """

    STATUS: ClassVar[dict[str, int | None]] = {
        "rate_limit": 429, "overloaded": 529, "server": 500, "connection": None, "timeout": 408,
    }

    def __init__(self, config: ProviderConfig, *, script: Any, latency_s: float,
                 storm: Mapping[str, Any] | None, close_delay_s: float, close_error: bool,
                 base_exception_at_turn: int | None) -> None:
        super().__init__(config, script=script, latency_s=latency_s)
        self.storm = dict(storm or {})
        self.close_delay_s = close_delay_s
        self.close_error = close_error
        self.base_exception_at_turn = base_exception_at_turn
        self._lock = threading.Lock()
        self.attempts: dict[int, int] = {}
        self.closes = 0
        self.close_started = threading.Event()
        self._turns_started: dict[int, threading.Event] = {}

    def turn_started(self, turn: int) -> threading.Event:
        with self._lock:
            return self._turns_started.setdefault(turn, threading.Event())

    @classmethod
    def from_config(cls, config: ProviderConfig) -> Self:
        settings = config.settings
        known = {"script", "latency_s", "storm", "close_delay_s", "close_error",
                 "base_exception_at_turn", "retry"}
        unknown = set(settings) - known
        if unknown:
            raise ProviderConfigError(f"faulty provider: unknown settings {sorted(unknown)}")
        return cls(config, script=load_script(settings["script"]),
                   latency_s=float(settings.get("latency_s", 0.0)),
                   storm=settings.get("storm"), close_delay_s=float(settings.get("close_delay_s", 0.0)),
                   close_error=bool(settings.get("close_error", False)),
                   base_exception_at_turn=settings.get("base_exception_at_turn"))

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        self.turn_started(turn).set()
        with self._lock:
            attempt = self.attempts[turn] = self.attempts.get(turn, 0) + 1
        if turn == self.base_exception_at_turn:
            raise WorkerDefect(f"injected BaseException at turn {turn}")
        if self.storm and attempt <= int(self.storm.get("per_turn", 0)):
            if control.interrupted:
                raise ProviderInterrupted("faulty provider: interrupted")
            kind = str(self.storm["kind"])
            raise ProviderError(f"{kind}: injected storm, attempt {attempt}", retryable=True,
                                status=self.STATUS[kind], retry_after=self.storm.get("retry_after"))
        return super().complete(request, control)

    def close(self) -> None:
        self.close_started.set()
        with self._lock:
            self.closes += 1
        if self.close_delay_s:
            time.sleep(self.close_delay_s)
        if self.close_error:
            raise RuntimeError("injected failure to close the provider")


register_provider("faulty", f"{__name__}:FaultyProvider")


# -- agents and trials ------------------------------------------------------------------------


def make_agent(logs_dir: Path, script: list[dict[str, Any]], *, kind: str = "scripted",
               session_id: str = "trial-1__agent", retry: Mapping[str, Any] | None = None,
               harness: Any = None, settings: Mapping[str, Any] | None = None,
               **agent_kwargs: Any) -> WmoTrioHarborAgent:
    """The real agent, configured the way harbor's `--ak` would, with `session_id` set the
    way harbor sets it after construction. `harness` is a document (a JSON object, or an
    already parsed `HarnessDoc`, which the agent accepts too); default `HARNESS`."""
    provider_config: dict[str, Any] = {"kind": kind, "model": "s", "script": script,
                                       "retry": dict(retry or FAST_RETRY), **(settings or {})}
    agent = WmoTrioHarborAgent(logs_dir=logs_dir, model_name=f"{kind}/s",
                               harness=HARNESS if harness is None else harness,
                               provider_config=provider_config,
                               **agent_kwargs)
    agent.session_id = session_id
    return agent


@dataclass
class TrialOutcome:
    """How `agent.run` ended, as harbor's trial would see it."""

    ending: str  # returned | timeout | cancelled | raised
    error: BaseException | None
    started: float
    returned_at: float
    context: AgentContext

    @property
    def seconds(self) -> float:
        return self.returned_at - self.started

    @property
    def scoreable(self) -> bool:
        """Harbor can score the trial: run returned, timed out (AgentTimeoutError), or raised
        a single exception of its own (never a group, never a stray cancellation)."""
        if self.ending in ("returned", "timeout", "cancelled"):
            return True
        return self.error is not None and not isinstance(self.error, BaseExceptionGroup)


async def run_trial(agent: WmoTrioHarborAgent, instruction: str, environment: Any,
                    timeout_sec: float | None, context: AgentContext | None = None) -> TrialOutcome:
    """`agent.run` under `asyncio.wait_for`, as harbor's trial runs it."""
    context = context or AgentContext()
    started = time.monotonic()
    ending, error = "returned", None
    try:
        await asyncio.wait_for(agent.run(instruction=instruction, environment=environment,
                                         context=context), timeout=timeout_sec)
    except TimeoutError as raised:
        ending, error = "timeout", raised
    except asyncio.CancelledError as raised:
        ending, error = "cancelled", raised
        returned = TrialOutcome(ending, error, started, time.monotonic(), context)
        raise TrialCancelled(returned) from raised
    except BaseException as raised:  # the trial's own exception, whatever it is
        ending, error = "raised", raised
    return TrialOutcome(ending, error, started, time.monotonic(), context)


class TrialCancelled(Exception):
    """`run_trial` was itself cancelled; carries the outcome so far."""

    def __init__(self, outcome: TrialOutcome) -> None:
        super().__init__("the trial was cancelled")
        self.outcome = outcome


_LEFTOVER = re.compile(r"^\.(wmo-run|trajectory)\.json\..*\.tmp$")


def trace_files(logs_dir: Path) -> Trace:
    """The one trace in `logs_dir`, parsed; fails on a missing, extra or half-written one."""
    names = sorted(p.name for p in logs_dir.iterdir())
    assert TRACE_FILENAME in names, f"no {TRACE_FILENAME} in {logs_dir}: {names}"
    assert not [n for n in names if _LEFTOVER.match(n)], f"temporary files left: {names}"
    assert set(names) <= {TRACE_FILENAME, TRAJECTORY_FILENAME}, names
    trace = parse_trace((logs_dir / TRACE_FILENAME).read_bytes())
    json.loads((logs_dir / TRAJECTORY_FILENAME).read_bytes())
    return trace


def child_processes() -> list[int]:
    """Live (non-zombie) child processes of this process."""
    me = os.getpid()
    try:
        # Each thread's children, as the kernel lists them: a few files, where reading
        # every process's stat on a busy machine (a suite's sandboxes) costs CPU per call.
        candidates = {int(pid) for listing in Path(f"/proc/{me}/task").glob("*/children")
                      for pid in listing.read_text().split()}
    except OSError:  # a kernel without those lists
        candidates = {int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()}
    children = []
    for pid in sorted(candidates):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            children.append(pid)
    return children


@dataclass
class Counters:
    """Per-trial counts of what the engine did to each `HarborEpisode`."""

    by_task: dict[str, dict[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, task_id: str, what: str) -> None:
        with self.lock:
            counts = self.by_task.setdefault(task_id, {})
            counts[what] = counts.get(what, 0) + 1

    def of(self, task_id: str) -> dict[str, int]:
        with self.lock:
            return dict(self.by_task.get(task_id, {}))


def instrument_episodes(patch: Callable[[Any, str, Any], None]) -> Counters:
    """Wrap `HarborEpisode.run/stop/close/record` to count their calls per task id.

    `patch(target, name, value)` is `monkeypatch.setattr` (or any setattr-like)."""
    from wmo_trio.harbor._agent import HarborEpisode

    counters = Counters()
    for name in ("run", "stop", "close", "record"):
        original = getattr(HarborEpisode, name)

        def wrapper(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            counters.note(self.task_id, _name)
            return _original(self, *args)

        patch(HarborEpisode, name, wrapper)
    return counters
