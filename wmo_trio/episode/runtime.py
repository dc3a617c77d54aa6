"""Running one episode in this process: `EpisodeRuntime`, and the frame every runtime shares.

A runtime runs one episode of one harness document, in the calling (worker) thread, and
returns a `RunResult` for every ending. Everything that can stop it from outside
(`abort()`, `should_cancel`, the wall-clock budget) ends it at its next boundary and
interrupts the call in flight, so the worker returns promptly.

`EpisodeRuntime` runs the episode's program (`wmo_trio.episode.portable`: the built-in
loop, or a `code:runtime` document's code) in this process; it talks to the host through a
`ProgramChannel` (`wmo_trio.episode.channel`), the host's end every backend decodes its
frames into, so a request gets the same answer here as in a sandbox. **A `code:runtime`
program then runs with the full rights of this process** (it can read and write any file,
open connections, and ignore the kit): use it only for code you wrote or reviewed; an
optimizer's mutated code belongs on the `e2b` backend, which runs the same program in a
sandbox. In-process, cancellation cannot stop a program that computes without calling the
kit.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar, Protocol, Self

import outcome

from wmo_trio.control import CallControl
from wmo_trio.episode.channel import ProgramChannel, ProtocolViolation, refuse
from wmo_trio.episode.deadlines import DEADLINES
from wmo_trio.episode.environment import Environment, Interruptible
from wmo_trio.episode.log import EpisodeLog
from wmo_trio.episode.portable import run_episode
from wmo_trio.episode.services import EpisodeEnded, EpisodeServices, episode_spec
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import RunResult, StopReason, count_tool_steps
from wmo_trio.providers.base import Provider
from wmo_trio.settings import DEFAULT_EPISODE_TIMEOUT_SEC, EpisodeSettings

__all__ = ["DEFAULT_EPISODE_TIMEOUT_SEC", "EpisodeRuntime", "Runtime", "RuntimeBase", "RuntimeEpisode"]


class Runtime(Protocol):
    """One episode's runtime. `run` once, in a worker thread; `abort` and `close` from any
    thread (`close` idempotent); `log` is readable while `run` goes. `with runtime:` closes
    it when the block ends."""

    log: EpisodeLog

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc_info: object) -> None: ...


class RuntimeBase:
    """What every runtime shares: one episode of one document, stoppable from any thread.

    `abort()` stops it at its next boundary and interrupts the call in flight; `close()`
    is idempotent; the wall-clock budget interrupts like an abort but ends the episode
    with `budget`. Every wait goes through `control` (see `wmo_trio.control`). Subclasses
    implement `run` inside `self._episode(environment)`; one whose program runs elsewhere
    (a sandbox) implements `kill_program` and `wake`, and sets `closing_stops`.
    """

    def __init__(
        self,
        doc: HarnessDoc,
        provider: Provider,
        *,
        control: CallControl | None = None,
        episode_timeout_sec: float = DEFAULT_EPISODE_TIMEOUT_SEC,
        should_cancel: Callable[[], bool] | None = None,
        context_window: int | None = None,
        on_progress: Callable[[EpisodeLog], None] | None = None,
    ) -> None:
        self.doc = doc
        self.provider = provider
        self.control = control if control is not None else CallControl()
        settings: EpisodeSettings = EpisodeSettings.parse(
            {"episode_timeout_sec": episode_timeout_sec, "context_window": context_window})
        self.episode_timeout_sec = settings.episode_timeout_sec
        self.context_window = settings.context_window
        self.log = EpisodeLog(on_progress)
        self._should_cancel = should_cancel or (lambda: False)
        self._aborted = False
        self._closed = False
        self._started = False
        self._environment: Environment | None = None
        self._lock = threading.Lock()

    # Whether `close()` during a run ends the episode as cancelled at its next boundary
    # (a runtime whose program runs elsewhere: closing it kills the program).
    closing_stops: ClassVar[bool] = False

    # -- control from other threads -------------------------------------------------------

    def abort(self) -> None:
        """Stop at the next boundary and make the call in flight return as soon as it can."""
        self._aborted = True
        self._interrupt()
        self.kill_program()

    def close(self) -> None:
        """Stop whatever is left of the episode (its program, the call in flight) and free
        what the runtime holds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.control.interrupt()
        self.kill_program()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what a runtime whose program runs elsewhere adds ------------------------------------

    def kill_program(self) -> None:
        """End the program where it runs, at once (abort and close); nothing to kill when
        it runs in this thread. Called from any thread, more than once."""

    def wake(self) -> None:
        """Make the thread that serves the program look at its boundaries (abort and the
        wall-clock budget); called from any thread."""

    # -- stopping -------------------------------------------------------------------------

    def _interrupt(self) -> None:
        self.control.interrupt()
        environment = self._environment
        if isinstance(environment, Interruptible):
            environment.interrupt()
        self.wake()

    def stopping(self) -> bool:
        """Whether the episode ends at its next boundary: aborted, cancelled, or closed
        (where `closing_stops`)."""
        return self._aborted or self._should_cancel() or (self.closing_stops and self._closed)

    # -- the episode's frame ---------------------------------------------------------------

    @contextmanager
    def _episode(self, environment: Environment) -> Iterator[None]:
        """Run once; the wall-clock deadline is armed for the block."""
        with self._lock:
            if self._started:
                raise RuntimeError(f"a {type(self).__name__} runs a single episode; build another")
            self._started = True
            self._environment = environment
        self.control.deadline = time.monotonic() + self.episode_timeout_sec
        watch = DEADLINES.schedule(self.control.deadline, self._interrupt)
        try:
            yield
        finally:
            DEADLINES.cancel(watch)

    def _services(self, environment: Environment) -> EpisodeServices:
        return EpisodeServices(
            self.doc, self.provider, self.log, self.control, environment,
            stopping=self.stopping, episode_timeout_sec=self.episode_timeout_sec,
            context_window=self.context_window,
        )

    def _result(self, task_id: str, reason: StopReason, answer: str) -> RunResult:
        steps = self.log.steps()
        return RunResult(task_id=task_id, steps=steps, stop_reason=reason, answer=answer,
                         turns=count_tool_steps(steps), worker_usage=self.log.usage())


class EpisodeRuntime(RuntimeBase):
    """Runs one episode of `doc` with `provider` in this process; see the module docstring.

    `run()` returns a `RunResult` for every ending, `cancelled` and `budget` included; it
    raises only on a defect (an exception nobody turned into an observation). `abort()` and
    `close()` may be called from any thread; `close()` is idempotent.
    """

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult:
        with self._episode(environment):
            services = self._services(environment)
            spec = episode_spec(self.doc, task_id=task_id, instruction=instruction,
                                context_window=self.context_window)
            channel = ProgramChannel(services)
            try:
                services.boundary()  # aborted before the worker even started
                ended = run_episode(spec, channel)
                if ended["step"] is not None:
                    channel.step(ended["step"]["action"], ended["step"]["observation"])
                reason, answer = channel.done(ended["stop_reason"], ended["answer"])
            except EpisodeEnded as ending:
                reason, answer = ending.reason, ending.answer
            except ProtocolViolation as violation:
                reason, answer = refuse(services, violation)
        return self._result(task_id, reason, answer)


class RuntimeEpisode(ABC):
    """One episode as the engine drives it (`wmo_trio.engine.Episode`), over a runtime that
    `start` builds in the worker thread. What the harbor agent's episode and the research
    API's share: `stop()` makes `should_cancel` true and aborts the runtime (the engine
    then interrupts the call in flight), `close()` closes it; `record` is each caller's.
    """

    # Aborting an EpisodeRuntime only sets flags and wakes threads; a subclass whose
    # runtime aborts over the network says otherwise.
    stop_is_quick: bool = True

    def __init__(self, task_id: str, instruction: str) -> None:
        self.task_id = task_id
        self.instruction = instruction
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._runtime: Runtime | None = None

    @abstractmethod
    def start(self, control: CallControl, should_cancel: Callable[[], bool]) -> tuple[Runtime, Environment]:
        """The episode's runtime and environment, built in the worker thread."""

    @abstractmethod
    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        """Persist the trace (see `wmo_trio.engine.Episode.record`)."""

    @property
    def log(self) -> EpisodeLog | None:
        """The runtime's log; None if the episode never started."""
        with self._lock:
            return self._runtime.log if self._runtime is not None else None

    def run(self, control: CallControl) -> RunResult:
        runtime, environment = self.start(control, self._cancel.is_set)
        with self._lock:
            self._runtime = runtime
        return runtime.run(self.task_id, self.instruction, environment)

    def stop(self) -> None:
        self._cancel.set()
        with self._lock:
            runtime = self._runtime
        if runtime is not None:
            runtime.abort()

    def close(self) -> None:
        with self._lock:
            runtime = self._runtime
        if runtime is not None:
            runtime.close()
