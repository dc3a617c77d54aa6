"""Running one episode in this process: `EpisodeRuntime`, and the frame every runtime shares.

A runtime runs one episode of one harness document, in the calling (worker) thread, and
returns a `RunResult` for every ending. Everything that can stop it from outside
(`abort()`, `should_cancel`, the wall-clock budget) ends it at its next boundary and
interrupts the call in flight, so the worker returns promptly.

`EpisodeRuntime` runs the episode's program (`wmo_trio.episode.portable`: the built-in loop,
or a `code:runtime` document's code) in this process, over a channel straight to the
host's `EpisodeServices`. **A `code:runtime` program then runs with the full rights of this
process** (it can read and write any file, open connections, and ignore the kit): use it
only for code you wrote or reviewed; an optimizer's mutated code belongs on the `e2b`
backend, which runs the same program in a sandbox. In-process, cancellation cannot stop a
program that computes without calling the kit.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import outcome

from wmo_trio.control import CallControl
from wmo_trio.episode.deadlines import DEADLINES
from wmo_trio.episode.environment import Environment, Interruptible
from wmo_trio.episode.log import EpisodeLog
from wmo_trio.episode.portable import run_episode
from wmo_trio.episode.services import EpisodeEnded, EpisodeServices, PrefixMemo, episode_spec
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import Action, ActionKind, Observation, RunResult, Step, StopReason, count_tool_steps
from wmo_trio.providers.base import Message, Provider, ProviderRequest, ToolSpec
from wmo_trio.settings import DEFAULT_EPISODE_TIMEOUT_SEC, EpisodeSettings

__all__ = ["DEFAULT_EPISODE_TIMEOUT_SEC", "EpisodeRuntime", "Runtime", "RuntimeBase", "RuntimeEpisode"]


class Runtime(Protocol):
    """One episode's runtime. `run` once, in a worker thread; `abort` and `close` from any
    thread (`close` idempotent); `log` is readable while `run` goes."""

    log: EpisodeLog

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class RuntimeBase:
    """What every runtime shares: one episode of one document, stoppable from any thread.

    `abort()` stops it at its next boundary and interrupts the call in flight; `close()`
    is idempotent; the wall-clock budget interrupts like an abort but ends the episode
    with `budget`. Every wait goes through `control` (see `wmo_trio.control`). Subclasses
    implement `run` inside `self._episode(environment)`.
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

    # -- control from other threads -------------------------------------------------------

    def abort(self) -> None:
        """Stop at the next boundary and make the call in flight return as soon as it can."""
        self._aborted = True
        self._interrupt()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.control.interrupt()
        self._release()

    def _release(self) -> None:
        """What a subclass frees on close."""

    def _interrupt(self) -> None:
        self.control.interrupt()
        environment = self._environment
        if isinstance(environment, Interruptible):
            environment.interrupt()

    def _stopping(self) -> bool:
        return self._aborted or self._should_cancel()

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
            stopping=self._stopping, episode_timeout_sec=self.episode_timeout_sec,
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
            try:
                services.boundary()  # aborted before the worker even started
                ended = run_episode(spec, _LocalChannel(services))
                if ended["step"] is not None:
                    step = Step.model_validate(ended["step"])
                    services.record_step(step.action, step.observation)
                reason, answer = services.finish(ended["stop_reason"], ended["answer"])
            except EpisodeEnded as ending:
                reason, answer = ending.reason, ending.answer
        return self._result(task_id, reason, answer)


class _LocalChannel:
    """The program's channel when it runs in this process: straight to the services.

    A program re-sends the whole conversation every turn; the messages it sent before
    (`PrefixMemo`) and its tool list are turned into models once, so a turn costs what is
    new in it."""

    def __init__(self, services: EpisodeServices) -> None:
        self._services = services
        self._messages = PrefixMemo[dict[str, Any], Message](Message.model_validate)
        self._tools: tuple[object, list[ToolSpec]] | None = None

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        tools = request["tools"]
        if self._tools is None or self._tools[0] is not tools:
            self._tools = (tools, [ToolSpec.model_validate(t) for t in tools])
        return self._services.completion(ProviderRequest(
            system=request["system"],
            messages=self._messages(request["messages"]),
            tools=self._tools[1],
            max_output_tokens=request["max_output_tokens"],
            temperature=request["temperature"],
        ))

    def execute(self, tool: str, arguments: dict[str, Any] | None, content: str | None,
                parse_error: str | None) -> dict[str, Any]:
        action = Action(kind=ActionKind.TOOL_CALL, name=tool, arguments=arguments, content=content)
        return self._services.execute(action, parse_error).model_dump(mode="json")

    def step(self, action: dict[str, Any], observation: dict[str, Any]) -> None:
        self._services.record_step(Action.model_validate(action),
                                   Observation.model_validate(observation))


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
