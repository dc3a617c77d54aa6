"""The episode loop: plain synchronous Python, run in a worker thread.

One `EpisodeRuntime` runs one episode of one harness document: the model proposes tool
calls, the environment answers, until the model submits or a limit ends it. Everything
that can stop it from outside (`abort()`, `should_cancel`, the wall-clock budget) is
checked before every model call and every tool call, and also interrupts the call in
flight, so the worker returns promptly.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

from wmo_trio.episode.deadlines import DEADLINES
from wmo_trio.episode.environment import Environment, Interruptible
from wmo_trio.episode.tools import (
    argument_problem,
    invalid_arguments,
    tool_spec,
    unavailable,
)
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import (
    Action,
    ActionKind,
    Observation,
    RunResult,
    Step,
    StopReason,
    TokenUsage,
    count_tool_steps,
)
from wmo_trio.providers.base import (
    CallControl,
    FinishReason,
    Message,
    Provider,
    ProviderError,
    ProviderRequest,
    ProviderResponse,
    ToolCall,
)

DEFAULT_EPISODE_TIMEOUT_S = 300.0
MAX_CONSECUTIVE_UNUSABLE = 3

NUDGES = {
    "no_tool_call": (
        "Your reply did not call a tool. Continue by calling one of your tools; when the "
        "task is done, call submit with your final answer."
    ),
    "unparsed_tool_call": (
        "Your tool call could not be parsed. Call the tool again with a JSON object whose "
        "values are strings."
    ),
    "output_truncated": (
        "Your reply hit the output limit before it made a usable tool call. Keep replies "
        "short and call one tool at a time."
    ),
}
ELIDED = "[output elided to fit the context window]"


def check_episode_timeout(value: object, *, name: str = "episode_timeout_sec") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{name} must be a finite positive number of seconds, got {value!r}")
    return float(value)


class _Unusable(Enum):
    NO_TOOL_CALL = "no_tool_call"
    UNPARSED = "unparsed_tool_call"
    TRUNCATED = "output_truncated"


@dataclass(frozen=True)
class Reply:
    """One model reply: the index of the first step it produced, its text and usage."""

    first_step: int
    text: str
    usage: TokenUsage


class EpisodeLog:
    """The steps and usage of an episode, recorded as they happen. Thread-safe: the host
    reads it while the worker writes, so a cancelled episode keeps its partial transcript."""

    def __init__(self, on_change: Callable[[EpisodeLog], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._steps: list[Step] = []
        self._usage = TokenUsage()
        self._replies: list[Reply] = []
        self._on_change = on_change

    def record(self, action: Action, observation: Observation) -> None:
        with self._lock:
            self._steps.append(Step(action=action, observation=observation))
        self._changed()

    def add_usage(self, usage: TokenUsage | None) -> None:
        if usage is None:
            return
        with self._lock:
            self._usage = self._usage + usage
        self._changed()

    def begin_reply(self, text: str, usage: TokenUsage) -> None:
        """A model reply arrived; the steps recorded next are its actions."""
        with self._lock:
            self._replies.append(Reply(len(self._steps), text, usage))
            self._usage = self._usage + usage
        self._changed()

    def steps(self) -> list[Step]:
        with self._lock:
            return list(self._steps)

    def replies(self) -> list[Reply]:
        with self._lock:
            return list(self._replies)

    def usage(self) -> TokenUsage:
        with self._lock:
            return self._usage

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


class _Stop(Exception):
    def __init__(self, reason: StopReason, answer: str = "") -> None:
        self.reason = reason
        self.answer = answer


class RuntimeBase:
    """What every episode runtime shares: one episode of one document, stoppable from any
    thread. `abort()` stops it at its next boundary and interrupts the call in flight;
    `close()` is idempotent; the wall-clock budget interrupts like an abort but ends the
    episode with `budget`. Subclasses implement `run` inside `self._episode(environment)`."""

    def __init__(
        self,
        doc: HarnessDoc,
        provider: Provider,
        *,
        episode_timeout_s: float = DEFAULT_EPISODE_TIMEOUT_S,
        should_cancel: Callable[[], bool] | None = None,
        context_window: int | None = None,
        on_progress: Callable[[EpisodeLog], None] | None = None,
        owns_provider: bool = False,
    ) -> None:
        self.doc = doc
        self.provider = provider
        self.episode_timeout_s = check_episode_timeout(episode_timeout_s, name="episode_timeout_s")
        self.context_window = context_window
        self.log = EpisodeLog(on_progress)
        self._should_cancel = should_cancel or (lambda: False)
        self._owns_provider = owns_provider
        self._control = CallControl()
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
        self._control.interrupt()
        self._release()
        if self._owns_provider:
            self.provider.close()

    def _release(self) -> None:
        """What a subclass frees on close, besides an owned provider."""

    def _interrupt(self) -> None:
        self._control.interrupt()
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
        self._control.deadline = time.monotonic() + self.episode_timeout_s
        watch = DEADLINES.schedule(self._control.deadline, self._interrupt)
        try:
            yield
        finally:
            DEADLINES.cancel(watch)

    def _result(self, task_id: str, reason: StopReason, answer: str) -> RunResult:
        steps = self.log.steps()
        return RunResult(task_id=task_id, steps=steps, stop_reason=reason, answer=answer,
                         turns=count_tool_steps(steps), worker_usage=self.log.usage())


class EpisodeRuntime(RuntimeBase):
    """Runs one episode of `doc` with `provider`: the built-in tool-calling loop. See the
    module docstring.

    `run()` returns a `RunResult` for every ending, `cancelled` and `budget` included; it
    raises only on a defect (an exception nobody turned into an observation). `abort()` and
    `close()` may be called from any thread; `close()` is idempotent.
    """

    _env_actions = 0  # environment actions taken; the episode runs once

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult:
        with self._episode(environment):
            try:
                if self._aborted:  # aborted before the worker even started
                    raise _Stop(StopReason.CANCELLED)
                reason, answer = self._loop(instruction, environment), ""
            except _Stop as stop:
                reason, answer = stop.reason, stop.answer
        return self._result(task_id, reason, answer)

    def _check_boundary(self) -> None:
        if self._stopping():
            raise _Stop(StopReason.CANCELLED)
        if self._control.remaining() == 0.0:
            self.log.record(
                Action(kind=ActionKind.MESSAGE, content=""),
                Observation(
                    content=f"episode stopped: its wall-clock budget of "
                    f"{self.episode_timeout_s:g} s ran out",
                    is_error=True,
                ),
            )
            raise _Stop(StopReason.BUDGET)

    def system_prompt(self) -> str:
        prompt = self.doc.system_prompt
        if self.doc.skills:
            lines = [f"- {s.name}: {s.description}" if s.description else f"- {s.name}"
                     for s in self.doc.skills]
            prompt += "\n\n## Skills\nCall read_skill with a skill's name to read it.\n" + "\n".join(lines)
        return prompt

    def _loop(self, instruction: str, environment: Environment) -> StopReason:
        params = self.doc.params
        tools = [tool_spec(name) for name in self.doc.tools]
        system = self.system_prompt()
        messages = [Message(role="user", content=instruction)]
        streak = 0
        last_unusable: _Unusable | None = None

        max_output = params.max_output_tokens
        if self.context_window is not None:
            # The window holds prompt and reply: never let the reply claim more than half.
            max_output = min(max_output, self.context_window // 2)
        for turn in range(1, params.max_turns + 1):
            self._check_boundary()
            response = self._complete(ProviderRequest(
                system=system,
                messages=self._fit(system, messages, max_output),
                tools=tools,
                max_output_tokens=max_output,
                temperature=params.temperature,
            ))
            messages.append(Message(role="assistant", content=response.text,
                                    tool_calls=response.tool_calls))
            if not any(call.arguments is not None for call in response.tool_calls):
                streak += 1
                last_unusable = _unusable_kind(response)
                for call in response.tool_calls:  # every tool call needs its answer
                    messages.append(_tool_result(call, _unparsed_observation(call)))
                last = streak >= MAX_CONSECUTIVE_UNUSABLE or turn == params.max_turns
                action = Action(kind=ActionKind.MESSAGE, content=response.text)
                if last:
                    self.log.record(action, Observation(
                        content=f"episode ended: {streak} consecutive replies without a "
                        "usable tool call" if streak >= MAX_CONSECUTIVE_UNUSABLE else
                        "episode ended: no turns left", is_error=True))
                    if streak >= MAX_CONSECUTIVE_UNUSABLE:
                        return StopReason(last_unusable.value)
                    break
                nudge = NUDGES[last_unusable.value]
                self.log.record(action, Observation(content=nudge, is_error=True))
                messages.append(Message(role="user", content=nudge))
                continue

            streak, last_unusable = 0, None
            for position, call in enumerate(response.tool_calls):
                self._check_boundary()
                # The reply's text goes with its first action, so the transcript keeps it.
                action = Action(kind=ActionKind.TOOL_CALL, name=call.name, arguments=call.arguments,
                                content=response.text if position == 0 and response.text else None)
                observation = self._tool(call, action, environment)
                if isinstance(observation, _Stop):
                    raise observation
                self.log.record(action, observation)
                messages.append(_tool_result(call, observation))

        # Out of turns. A call interrupted on the last turn still ends as what stopped it.
        self._check_boundary()
        # Otherwise classify by the order the contract fixes.
        if last_unusable is _Unusable.UNPARSED:
            return StopReason.UNPARSED_TOOL_CALL
        if last_unusable is _Unusable.TRUNCATED:
            return StopReason.OUTPUT_TRUNCATED
        return StopReason.MAX_TURNS

    def _complete(self, request: ProviderRequest) -> ProviderResponse:
        try:
            response = self.provider.complete(request, self._control)
        except Exception as error:
            usage = error.usage if isinstance(error, ProviderError) else None
            self.log.add_usage(usage)
            self._check_boundary()  # an interrupted call is a cancellation or the budget
            kind = "provider error" if isinstance(error, ProviderError) else "provider failed"
            self.log.record(
                Action(kind=ActionKind.MESSAGE, content=""),
                Observation(content=f"{kind}: {type(error).__name__}: {error}", is_error=True,
                            metadata={"status": getattr(error, "status", None)}),
            )
            raise _Stop(StopReason.PROVIDER_ERROR) from error
        self.log.begin_reply(response.text, response.usage)
        return response

    def _tool(self, call: ToolCall, action: Action,
              environment: Environment) -> Observation | _Stop:
        if call.arguments is None:
            return _unparsed_observation(call)
        if call.name not in self.doc.tools:
            return unavailable(call.name)
        if call.name == "submit":
            problem = argument_problem("submit", call.arguments)
            if problem is not None:
                return invalid_arguments("submit", problem)
            answer = call.arguments["answer"]
            self.log.record(action, Observation(content="submitted"))
            return _Stop(StopReason.SUBMITTED, answer)
        if call.name == "read_skill":
            problem = argument_problem("read_skill", call.arguments)
            if problem is not None:
                return invalid_arguments("read_skill", problem)
            for skill in self.doc.skills:
                if skill.name == call.arguments["name"]:
                    return Observation(content=skill.content)
            names = ", ".join(s.name for s in self.doc.skills)
            return Observation(content=f"unknown skill {call.arguments['name']!r}; skills: {names}",
                               is_error=True)
        limit = self.doc.params.max_env_actions
        if self._env_actions >= limit:
            return Observation(
                content=f"environment action budget exhausted: all {limit} environment "
                "actions are used and no more will run. Call submit with your answer.",
                is_error=True,
            )
        self._env_actions += 1
        try:
            return environment.execute(action)
        except Exception as error:
            # An environment that raises instead of answering is a defect of the run, not
            # feedback for the agent: end the episode, keeping the transcript.
            self.log.record(action, Observation(
                content=f"environment raised {type(error).__name__}: {error}", is_error=True))
            return _Stop(StopReason.ERROR)

    def _fit(self, system: str, messages: list[Message], max_output: int) -> list[Message]:
        """Elide the oldest tool outputs while the request would overflow the context window
        (estimated at four characters a token)."""
        if self.context_window is None:
            return list(messages)

        def estimate() -> int:
            chars = len(system) + sum(len(m.content) + sum(
                len(str(c.arguments or c.raw_arguments)) for c in m.tool_calls) for m in messages)
            return chars // 4 + max_output

        for index, message in enumerate(messages):
            if estimate() <= self.context_window:
                break
            if message.role == "tool" and message.content != ELIDED:
                messages[index] = message.model_copy(update={"content": ELIDED})
        return list(messages)


def _unusable_kind(response: ProviderResponse) -> _Unusable:
    if response.tool_calls:
        return _Unusable.UNPARSED
    if response.finish_reason is FinishReason.LENGTH:
        return _Unusable.TRUNCATED
    return _Unusable.NO_TOOL_CALL


def _unparsed_observation(call: ToolCall) -> Observation:
    return invalid_arguments(call.name, f"could not parse them ({call.parse_error or 'unknown'})")


def _tool_result(call: ToolCall, observation: Observation) -> Message:
    return Message(role="tool", content=observation.content, tool_call_id=call.id,
                   is_error=observation.is_error)
