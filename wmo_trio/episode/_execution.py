"""Running one episode in this process: `LocalExecution`, and the frame every execution shares.

An execution runs one episode of one harness document, in the calling (worker) thread, and
returns a `RunResult` for every ending. Everything that can stop it from outside (its
control's interrupt, which `abort()`, `close()` and a true `should_cancel` send; the
wall-clock budget) ends it at its next boundary and interrupts the call in flight, so the
worker returns promptly.

`LocalExecution` runs the episode's program (`wmo_trio.episode.portable`: the built-in
loop, or a `code:runtime` document's code) in this process; it talks to the host through a
`ProgramChannel` (`wmo_trio.episode._channel`), the host's end every backend decodes its
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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, Self

import outcome

from wmo_trio.control import CallControl
from wmo_trio.episode._channel import ProgramChannel, ProtocolViolation, refuse
from wmo_trio.episode._deadlines import DEADLINES
from wmo_trio.episode._environment import Environment, Interruptible
from wmo_trio.episode._log import EpisodeLog
from wmo_trio.episode._services import EpisodeEnded, EpisodeServices, episode_spec
from wmo_trio.episode.portable import run_episode
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import RunResult, StopReason, count_tool_steps
from wmo_trio.providers._base import Provider
from wmo_trio.settings import DEFAULT_EPISODE_TIMEOUT_SEC, EpisodeSettings

__all__ = ["DEFAULT_EPISODE_TIMEOUT_SEC", "BackendEpisode", "Execution", "ExecutionBase", "LocalExecution"]


class Execution(Protocol):
    """One episode's execution. `run` once, in a worker thread; `abort` and `close` from any
    thread (`close` idempotent); `log` is readable while `run` goes. `with execution:` closes
    it when the block ends."""

    log: EpisodeLog

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc_info: object) -> None: ...


class ExecutionBase(ABC):
    """What every execution shares: one episode of one document, stoppable from any thread.

    Its control's interrupt (`wmo_trio.control.CallControl`) is the one signal that the
    episode stops: `abort()` and `close()` send it, and so does the engine when the
    episode's caller is cancelled; the episode then ends as cancelled at its next boundary,
    and the call in flight is cancelled at once. The wall-clock budget ends the calls the
    same way (`CallControl.expire`) and the episode with `budget`.

    `episode_settings`: the episode's limits (`EpisodeSettings`, taken as they are, or a
    mapping checked by their rules). Subclasses implement `run` inside
    `self._episode(environment)`; one whose program runs elsewhere (a sandbox) implements
    `kill_program` and `wake`.
    """

    def __init__(
        self,
        doc: HarnessDoc,
        provider: Provider,
        episode_settings: EpisodeSettings | Mapping[str, Any] | None = None,
        *,
        control: CallControl | None = None,
        should_cancel: Callable[[], bool] | None = None,
        on_progress: Callable[[EpisodeLog], None] | None = None,
    ) -> None:
        self.doc = doc
        self.provider = provider
        self.control = control if control is not None else CallControl()
        settings = (episode_settings if isinstance(episode_settings, EpisodeSettings)
                    else EpisodeSettings.parse(episode_settings or {}))
        self.episode_timeout_sec = settings.episode_timeout_sec
        self.context_window = settings.context_window
        self.log = EpisodeLog(on_progress)
        self._should_cancel = should_cancel
        self._closed = False
        self._started = False
        self._environment: Environment | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult:
        """Run the episode to its end, in this (worker) thread: a `RunResult` for every
        ending. Once per execution."""

    # -- control from other threads -------------------------------------------------------

    def abort(self) -> None:
        """Stop at the next boundary: interrupt the control (the call in flight returns as
        soon as it can) and kill the program where it runs elsewhere."""
        self.control.interrupt()
        self.kill_program()

    def close(self) -> None:
        """Stop whatever is left of the episode (as `abort`) and free what the execution
        holds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what an execution whose program runs elsewhere adds ----------------------------------

    def kill_program(self) -> None:
        """End the program where it runs, at once (abort and close); nothing to kill when
        it runs in this thread. Called from any thread, more than once."""

    def wake(self) -> None:
        """Make the thread that serves the program look at its boundaries (abort and the
        wall-clock budget); called from any thread."""

    # -- stopping -------------------------------------------------------------------------

    def _calls_ended(self) -> None:
        # Registered with the control for the episode: an interrupt or the deadline also
        # stops the environment's command in flight and wakes the serving thread.
        environment = self._environment
        try:
            if isinstance(environment, Interruptible):
                environment.interrupt()
        finally:
            self.wake()

    def stopping(self) -> bool:
        """Whether the episode ends at its next boundary as cancelled: its control was
        interrupted. A caller's `should_cancel`, polled here, interrupts it when true."""
        if not self.control.interrupted and self._should_cancel is not None and self._should_cancel():
            self.control.interrupt()
        return self.control.interrupted

    # -- the episode's frame ---------------------------------------------------------------

    @contextmanager
    def _episode(self, environment: Environment) -> Iterator[None]:
        """Run once; the wall-clock deadline is armed for the block."""
        with self._lock:
            if self._started:
                raise RuntimeError(f"a {type(self).__name__} runs a single episode; build another")
            self._started = True
            self._environment = environment
        # None: the calls have ended already (an abort before the run); the first boundary
        # ends the episode.
        hook = self.control.on_interrupt(self._calls_ended)
        self.control.deadline = time.monotonic() + self.episode_timeout_sec
        watch = DEADLINES.schedule(self.control.deadline, self.control.expire)
        try:
            yield
        finally:
            DEADLINES.cancel(watch)
            self.control.forget(hook)

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


class LocalExecution(ExecutionBase):
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


class BackendEpisode(ABC):
    """One episode as the engine drives it (`wmo_trio.engine.Episode`), over an execution that
    `start` builds in the worker thread with the engine's control. What the harbor agent's
    episode and the research API's share: the engine's interrupt of that control stops it
    (before the execution exists too: its first boundary ends it), `stop()` aborts the
    execution for what the interrupt does not do (kill a program that runs elsewhere),
    `close()` closes it; `record` is each caller's.
    """

    # Aborting a LocalExecution only sets flags and wakes threads; a subclass whose
    # execution aborts over the network says otherwise (its backend's `abort_is_quick`).
    stop_is_quick: bool = True

    def __init__(self, task_id: str, instruction: str) -> None:
        self.task_id = task_id
        self.instruction = instruction
        self._lock = threading.Lock()
        self._execution: Execution | None = None

    @abstractmethod
    def start(self, control: CallControl) -> tuple[Execution, Environment]:
        """The episode's execution, built with `control`, and its environment, in the worker
        thread."""

    @abstractmethod
    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        """Persist the trace (see `wmo_trio.engine.Episode.record`)."""

    @property
    def log(self) -> EpisodeLog | None:
        """The execution's log; None if the episode never started."""
        with self._lock:
            return self._execution.log if self._execution is not None else None

    def run(self, control: CallControl) -> RunResult:
        execution, environment = self.start(control)
        with self._lock:
            self._execution = execution
        return execution.run(self.task_id, self.instruction, environment)

    def stop(self) -> None:
        with self._lock:
            execution = self._execution
        if execution is not None:
            execution.abort()

    def close(self) -> None:
        with self._lock:
            execution = self._execution
        if execution is not None:
            execution.close()

