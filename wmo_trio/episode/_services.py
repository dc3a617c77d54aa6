"""The host side of an episode: every rule of the episode, each decided in one place.

An episode's program (the built-in loop or a document's code, `wmo_trio.episode.portable`)
asks; `EpisodeServices` answers, wherever the program runs (in-process or in a sandbox):

- `boundary()`: cancellation and the wall-clock budget, checked before every model call
  and every tool call;
- `complete()`: the turn limit (`param:max-turns`, counted by `turns_left()` and nowhere
  else) and the shape of every request (the document's tools, its output cap, its
  temperature); `completion()` is its answer as a program receives it;
- `execute()`: the document's tool policy, the tool arguments, `submit` and `read_skill`,
  the environment-action budget (`param:max-env-actions`), an environment that raises;
- `capped_text()`: the 10,000-character cap, applied to every observation the episode
  records, returns or sends to the model, error texts included;
- `finish()`: the endings a program may give by itself, after a last boundary check.

Every answered call is recorded in the episode's log as it happens. The services end an
episode by raising `EpisodeEnded`; once ended, every later call raises the same ending.
`episode_spec()` is the data the program gets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn

from wmo_trio._text import valid_text
from wmo_trio.control import CallControl
from wmo_trio.episode._environment import Environment
from wmo_trio.episode._log import EpisodeLog
from wmo_trio.episode._tools import (
    MAX_OBSERVATION_CHARS,
    argument_problem,
    bounded_text,
    invalid_arguments,
    is_environment_tool,
    tool_spec,
    unavailable,
)
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import Action, ActionKind, Observation, StopReason
from wmo_trio.providers._base import Message, Provider, ProviderError, ProviderRequest, ProviderResponse

Mode = Literal["loop", "code"]

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

# The endings a program may give by itself; every other ending is the host's. `submitted`
# is never a program's to claim: only the host's answer to the submit tool gives it.
_OWN_ENDINGS: dict[Mode, frozenset[StopReason]] = {
    "loop": frozenset({StopReason.NO_TOOL_CALL, StopReason.UNPARSED_TOOL_CALL,
                       StopReason.OUTPUT_TRUNCATED, StopReason.MAX_TURNS}),
    "code": frozenset({StopReason.NO_ACTION, StopReason.ERROR}),
}


class EpisodeEnded(BaseException):
    """The host ended the episode (submit, a budget, cancellation, a provider error).

    A BaseException on purpose: a program's `except Exception` around a kit call must not
    swallow the end of its episode. The ending is also kept by `EpisodeServices`, so a
    program that catches even this cannot change how its episode ended."""

    def __init__(self, reason: StopReason, answer: str = "") -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.answer = answer


def episode_mode(doc: HarnessDoc) -> Mode:
    return "code" if doc.runtime_code is not None else "loop"


def max_output_tokens(doc: HarnessDoc, context_window: int | None) -> int:
    """The output cap of every model request: `param:max-output-tokens`, and never more
    than half the context window, which holds prompt and reply."""
    limit = doc.params.max_output_tokens
    if context_window is not None:
        limit = min(limit, context_window // 2)
    return limit


def loop_system_prompt(doc: HarnessDoc) -> str:
    """The built-in loop's system prompt: the document's prompt, and its skills' index."""
    prompt = doc.system_prompt
    if doc.skills:
        lines = [f"- {s.name}: {s.description}" if s.description else f"- {s.name}"
                 for s in doc.skills]
        prompt += "\n\n## Skills\nCall read_skill with a skill's name to read it.\n" + "\n".join(lines)
    return prompt


def system_prompt(doc: HarnessDoc) -> str:
    """The system prompt the episode's program starts from."""
    return loop_system_prompt(doc) if episode_mode(doc) == "loop" else doc.system_prompt


def tools_text(doc: HarnessDoc) -> str:
    """The document's tools as text for a system prompt, with the call format that
    `Kit.parse_tool_call` reads."""
    lines = [
        "To call a tool, reply with a JSON object naming it and its arguments, for example "
        "in a ```json block:",
        '{"tool": "<tool name>", "arguments": {"<argument>": "<value>"}}',
        "Every argument is a required string. The tools:",
    ]
    for name in doc.tools:
        spec = tool_spec(name)
        properties: dict[str, Any] = spec.parameters["properties"]
        lines.append(f"- {name}({', '.join(properties)}): {spec.description}")
        lines += [f"    {arg}: {info['description']}" for arg, info in properties.items()]
    return "\n".join(lines)


def episode_spec(doc: HarnessDoc, *, task_id: str, instruction: str,
                 context_window: int | None) -> dict[str, Any]:
    """Everything the episode's program needs (`wmo_trio.episode.portable.run_episode`),
    JSON-compatible: the kit's data for a `code:runtime` document, the built-in loop's
    otherwise."""
    return {**_document_spec(doc, context_window), "task_id": task_id, "instruction": instruction}


@functools.lru_cache(maxsize=64)
def _document_spec(doc: HarnessDoc, context_window: int | None) -> dict[str, Any]:
    """The part of an episode's spec that comes from its document: the same for all its
    episodes, so built once (callers copy it, never change it)."""
    mode = episode_mode(doc)
    spec: dict[str, Any] = {
        "mode": mode,
        "params": doc.params.model_dump(mode="json"),
        "tools": list(doc.tools),
        "context_window": context_window,
        "max_output_tokens": max_output_tokens(doc, context_window),
        "system_prompt": system_prompt(doc),
    }
    if mode == "code":
        spec.update(
            tools_text=tools_text(doc),
            skills=[s.model_dump(mode="json") for s in doc.skills],
            code=doc.runtime_code,
        )
    else:
        spec.update(
            tool_specs=[tool_spec(name).model_dump(mode="json") for name in doc.tools],
            nudges=dict(NUDGES),
            max_unusable=MAX_CONSECUTIVE_UNUSABLE,
            elided=ELIDED,
            unparsed=invalid_arguments("{tool}", "could not parse them ({reason})").content,
        )
    return spec


def capped_text(text: str) -> str:
    """The observation cap: `text` within `MAX_OBSERVATION_CHARS` (markers included), as
    valid text. Every observation the episode records or sends goes through it."""
    return valid_text(bounded_text(text))


def capped(observation: Observation) -> Observation:
    """`observation` with its content through `capped_text`."""
    content = capped_text(observation.content)
    if content == observation.content:
        return observation
    return observation.model_copy(update={"content": content})


class PrefixMemo[S, T]:
    """`function` mapped over a list that a program re-sends whole every turn, each new
    item once: the items sent before (the same objects, in the same places) keep their
    results, so a turn costs what is new in it."""

    def __init__(self, function: Callable[[S], T]) -> None:
        self._function = function
        self._sent: tuple[S, ...] = ()
        self._results: list[T] = []

    def __call__(self, items: Sequence[S]) -> list[T]:
        kept = 0
        for new, old in zip(items, self._sent, strict=False):
            if new is not old:
                break
            kept += 1
        # A copy of what was sent: a caller that changes its list in place is still seen.
        self._sent = tuple(items)
        self._results = self._results[:kept] + [self._function(item) for item in items[kept:]]
        return list(self._results)


class EpisodeServices:
    """The host side of one episode of `doc`; see the module docstring.

    `stopping` says whether the episode was cancelled (checked at every boundary);
    `control` carries the wall-clock deadline and is what provider calls wait through.
    """

    def __init__(self, doc: HarnessDoc, provider: Provider, log: EpisodeLog,
                 control: CallControl, environment: Environment, *,
                 stopping: Callable[[], bool], episode_timeout_sec: float,
                 context_window: int | None) -> None:
        self.doc = doc
        self.provider = provider
        self.log = log
        self.control = control
        self.environment = environment
        self.mode = episode_mode(doc)
        self.model_calls = 0
        self.env_actions = 0
        self.ended: EpisodeEnded | None = None
        self._stopping = stopping
        self._episode_timeout_sec = episode_timeout_sec
        self._max_output = max_output_tokens(doc, context_window)
        self._tool_specs = [tool_spec(name) for name in doc.tools] if self.mode == "loop" else []
        self._long = PrefixMemo[Message, bool](
            lambda m: m.role == "tool" and len(m.content) > MAX_OBSERVATION_CHARS)

    # -- ending ---------------------------------------------------------------------------

    def end(self, reason: StopReason, answer: str = "") -> NoReturn:
        if self.ended is None:
            self.ended = EpisodeEnded(reason, answer)
        raise EpisodeEnded(self.ended.reason, self.ended.answer)

    def record_error(self, text: str, **metadata: Any) -> None:
        """Record a step that says why the episode is ending (or what went wrong)."""
        self.log.record(Action(kind=ActionKind.MESSAGE, content=""),
                        capped(Observation(content=text, is_error=True, metadata=metadata)))

    def boundary(self) -> None:
        """End the episode if it has ended, was cancelled, or its wall-clock budget ran out."""
        if self.ended is not None:
            self.end(self.ended.reason)
        if self._stopping():
            self.end(StopReason.CANCELLED)
        if self.control.remaining() == 0.0:
            self.record_error(f"episode stopped: its wall-clock budget of "
                              f"{self._episode_timeout_sec:g} s ran out")
            self.end(StopReason.BUDGET)

    def finish(self, reason: str, answer: str = "") -> tuple[StopReason, str]:
        """The program ended by itself with `reason`: the episode's ending, once a stop that
        raced the end has had its say. A reason the program may not give ends it as
        `unknown_done_reason`, and so does `max_turns` while turns are left: the turn limit
        is the host's to decide."""
        self.boundary()
        allowed = _OWN_ENDINGS[self.mode]
        if reason not in {ending.value for ending in allowed}:
            self.record_error(f"the episode's program ended with the reason {reason!r}, "
                              "which it may not give")
            return StopReason.UNKNOWN_DONE_REASON, ""
        ending = StopReason(reason)
        if ending is StopReason.MAX_TURNS and self.turns_left() > 0:
            self.record_error(f"the episode's program ended with the reason 'max_turns' with "
                              f"{self.turns_left()} of its turns left")
            return StopReason.UNKNOWN_DONE_REASON, ""
        return ending, ""  # a program's own ending never submits (see _OWN_ENDINGS)

    def begin_attempt(self) -> None:
        """The program starts over (the e2b backend replays it on a fresh sandbox): its turns
        count from the first again. What was recorded stays, and so does the environment
        count: a replay happens only before the first environment action."""
        self.model_calls = 0

    # -- model calls ----------------------------------------------------------------------

    def turns_left(self) -> int:
        """The model calls the episode may still make: the turn limit, `param:max-turns`."""
        return max(self.doc.params.max_turns - self.model_calls, 0)

    def completion(self, request: ProviderRequest) -> dict[str, Any]:
        """`complete`, as the JSON a program receives: the response, and `turns_left` after
        it (the built-in loop ends when none are left; a program that asks past the limit
        is ended by `complete`)."""
        response = self.complete(request).model_dump(mode="json")
        response["turns_left"] = self.turns_left()
        return response

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        self.boundary()
        if self.turns_left() == 0:
            self.record_error(f"episode stopped: all {self.doc.params.max_turns} model calls "
                              "of param:max-turns are used")
            # The built-in loop ends on its last turn by itself: asking past it is the turn
            # limit all the same. A document's program spent a budget it was given.
            self.end(StopReason.MAX_TURNS if self.mode == "loop" else StopReason.BUDGET)
        self.model_calls += 1
        try:
            response = self.provider.complete(self._shaped(request), self.control)
        except Exception as error:
            self.log.add_usage(error.usage if isinstance(error, ProviderError) else None)
            self.boundary()  # an interrupted call is a cancellation or the budget
            kind = "provider error" if isinstance(error, ProviderError) else "provider failed"
            self.record_error(f"{kind}: {type(error).__name__}: {error}",
                              status=getattr(error, "status", None))
            self.end(StopReason.PROVIDER_ERROR)
        self.log.begin_reply(response.text, response.usage)
        return response

    def _shaped(self, request: ProviderRequest) -> ProviderRequest:
        """What the model is sent: the document's tools (none for a program, whose calls
        are plain text), the document's output cap, its temperature unless the program
        chose one, and every tool result within the observation cap (the loop answers the
        calls of a reply without a usable one itself)."""
        update: dict[str, Any] = {}
        if request.tools is not self._tool_specs:
            update["tools"] = self._tool_specs
        if request.max_output_tokens > self._max_output:
            update["max_output_tokens"] = self._max_output
        if request.temperature is None:
            update["temperature"] = self.doc.params.temperature
        if any(self._long(request.messages)):
            update["messages"] = [
                m.model_copy(update={"content": capped_text(m.content)}) if m.role == "tool" else m
                for m in request.messages]
        return request.model_copy(update=update) if update else request

    # -- tool calls -----------------------------------------------------------------------

    def execute(self, action: Action, parse_error: str | None = None) -> Observation:
        """Answer one tool call and record it. `action.arguments` None is a call whose
        arguments could not be parsed (`parse_error` says why)."""
        self.boundary()
        observation = capped(self._answer(action, parse_error))
        self.log.record(action, observation)
        return observation

    def record_step(self, action: Action, observation: Observation) -> None:
        """Record a message step of the program's own (a nudge, an ending, its error)."""
        if action.kind is not ActionKind.MESSAGE:
            raise ValueError("a program may only record message steps; tool calls are "
                             "recorded by the host as it answers them")
        self.log.record(action, capped(observation))

    def _answer(self, action: Action, parse_error: str | None) -> Observation:
        name, arguments = action.name, action.arguments
        if arguments is None:
            return invalid_arguments(str(name), f"could not parse them ({parse_error or 'unknown'})")
        if name not in self.doc.tools:
            return unavailable(name)
        if name == "submit":
            problem = argument_problem("submit", arguments)
            if problem is not None:
                return invalid_arguments("submit", problem)
            self.log.record(action, Observation(content="submitted"))
            self.end(StopReason.SUBMITTED, arguments["answer"])
        if name == "read_skill":
            problem = argument_problem("read_skill", arguments)
            if problem is not None:
                return invalid_arguments("read_skill", problem)
            for skill in self.doc.skills:
                if skill.name == arguments["name"]:
                    return Observation(content=skill.content)
            names = ", ".join(s.name for s in self.doc.skills)
            return Observation(content=f"unknown skill {arguments['name']!r}; skills: {names}",
                               is_error=True)
        assert is_environment_tool(name)
        limit = self.doc.params.max_env_actions
        if self.env_actions >= limit:
            if self.mode == "code":
                self.log.record(action, Observation(
                    content=f"episode stopped: all {limit} environment actions of "
                    "param:max-env-actions are used", is_error=True))
                self.end(StopReason.BUDGET)
            return Observation(
                content=f"environment action budget exhausted: all {limit} environment "
                "actions are used and no more will run. Call submit with your answer.",
                is_error=True,
            )
        self.env_actions += 1
        try:
            return self.environment.execute(action)
        except Exception as error:
            # An environment that raises instead of answering is a defect of the run, not
            # feedback for the agent: end the episode, keeping the transcript.
            self.log.record(action, capped(Observation(
                content=f"environment raised {type(error).__name__}: {error}", is_error=True)))
            self.end(StopReason.ERROR)
