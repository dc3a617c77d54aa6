"""The host's end of the channel an episode's program talks through: `ProgramChannel`.

A program (`wmo_trio.episode.portable`) asks for model calls, tool calls and message steps,
and ends with a reason. Wherever it runs, its requests reach the host as JSON-shaped data:
in-process the program calls a `ProgramChannel` directly; in a sandbox a backend decodes
its frames (`wmo_trio.backends._frames`) into the same calls. So what a program may send
is decided here, once for every backend: the shape of each request, and how much a program
may make the host keep. `EpisodeServices` then decides every rule of the episode.

A request that breaks the protocol raises `ProtocolViolation`; the runtime records it
with `refuse` and the episode ends with `error`, on every backend alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ValidationError

from wmo_trio.episode._services import EpisodeServices, PrefixMemo
from wmo_trio.models import Action, ActionKind, Step, StopReason
from wmo_trio.providers._base import Message, ProviderRequest, ToolSpec
from wmo_trio.settings import validation_problem
from wmo_trio.trace import nesting

__all__ = ["MAX_FREE_CALLS", "MAX_NESTING", "MAX_RECORDED_BYTES", "ProgramChannel",
           "ProtocolViolation", "refuse", "typed_field"]

# Calls that cost neither a model call nor an environment action (refused tools,
# read_skill) are otherwise free: a program could flood the host's transcript with them.
MAX_FREE_CALLS = 4096
# What a program may make the host record (tool calls' arguments, message steps).
MAX_RECORDED_BYTES = 64 * 1024 * 1024
# How deep the values of a recorded request may nest (an object or array is one level).
# The tools take strings; the trace's serializer stops at 255 levels, the steps' own
# among them, and a value past them would leave the episode without its trace.
MAX_NESTING = 64


class ProtocolViolation(BaseException):
    """The program (or its runner) sent something the protocol does not allow.

    A BaseException, like `EpisodeEnded`: in-process it is raised inside the program's
    own call, and the program's `except Exception` must not turn the host's refusal into
    an error of its own."""


def refuse(services: EpisodeServices, violation: ProtocolViolation,
           **metadata: Any) -> tuple[StopReason, str]:
    """Record why the episode ends, and its ending: `error`, never replayed."""
    services.record_error(f"the episode's program broke the channel protocol: {violation}",
                          **metadata)
    return StopReason.ERROR, ""


def _validated[M: BaseModel](model: type[M], data: object, what: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = validation_problem(error, whole=what, most=3)
        raise ProtocolViolation(f"invalid {what}: {problems}") from None


def typed_field(what: str, name: str, value: object, kind: type, *, optional: bool = False) -> Any:
    """`value` if it is a `kind` (or None, when `optional`); a `ProtocolViolation` naming
    `what` and the field otherwise."""
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolViolation(f"{what}: field {name!r} must be {kind.__name__}, "
                                f"got {type(value).__name__}")
    return value


class ProgramChannel:
    """The host's end of one program's channel, over the episode's `services`.

    Its calls are the channel a program is given (`wmo_trio.episode.portable.run_episode`):
    `complete`, `execute` and `step`, JSON-shaped in and out; `done` is how the program
    ended by itself. Each call validates what it got and raises `ProtocolViolation` when it
    breaks the protocol; once violated, every later call raises the same violation, so a
    program that catches it cannot go on. The services may end the episode at any call
    (`EpisodeEnded`). One channel serves one attempt of the program.

    A program re-sends the whole conversation every turn; the messages it sent before (the
    same objects, in the same places) and its tool list are turned into models once, so a
    turn costs what is new in it (in-process; decoded frames are new objects every time).
    """

    def __init__(self, services: EpisodeServices) -> None:
        self._services = services
        self._violation: ProtocolViolation | None = None
        self._messages = PrefixMemo[object, object](_message_or_sent)
        self._tools: tuple[object, list[ToolSpec]] | None = None
        self._free = 0
        self._recorded = 0
        self._steps = 0

    # -- the program's calls --------------------------------------------------------------

    def complete(self, request: object) -> dict[str, Any]:
        """One model call; the response as the program receives it."""
        with self._guard():
            model = _validated(ProviderRequest, self._known(request), "model request")
            self._remember(request, model)
        return self._services.completion(model)

    def execute(self, tool: object, arguments: object, content: object,
                parse_error: object) -> dict[str, Any]:
        """One tool call; its observation as the program receives it."""
        with self._guard():
            what = "execute request"
            action = Action(kind=ActionKind.TOOL_CALL, name=typed_field(what, "tool", tool, str),
                            arguments=typed_field(what, "arguments", arguments, dict, optional=True),
                            content=typed_field(what, "content", content, str, optional=True))
            reason = typed_field(what, "parse_error", parse_error, str, optional=True)
            self._record([tool, arguments, content, parse_error])
        services = self._services
        before = services.env_actions, services.model_calls
        observation = services.execute(action, reason)
        with self._guard():
            self._count_free(before)
        return observation.model_dump(mode="json")

    def step(self, action: object, observation: object) -> None:
        """Record one message step of the program's own (a nudge, its error, its end)."""
        with self._guard():
            self._record([action, observation])
            # The built-in loop records one message per model reply it cannot use, and a
            # program records at most its own error at the end.
            self._steps += 1
            if self._steps > self._services.model_calls + 1:
                raise ProtocolViolation("the program sent more message steps than it made "
                                        "model calls (one a reply, and one at its end, at most)")
            step = _validated(Step, {"action": action, "observation": observation}, "step")
            if step.action.kind is not ActionKind.MESSAGE:
                raise ProtocolViolation("a step may only carry a message step; tool calls are "
                                        "recorded by the host as it answers them")
        self._services.record_step(step.action, step.observation)

    def done(self, stop_reason: object, answer: object) -> tuple[StopReason, str]:
        """The program ended by itself: the episode's ending (`EpisodeServices.finish`)."""
        with self._guard():
            text = typed_field("done", "answer", answer, str, optional=True) or ""
        reason = stop_reason if isinstance(stop_reason, str) else repr(stop_reason)
        return self._services.finish(reason, text)

    # -- rules ----------------------------------------------------------------------------

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Keep the first violation, and raise it again at every later call."""
        if self._violation is not None:
            raise self._violation
        try:
            yield
        except ProtocolViolation as violation:
            self._violation = violation
            raise

    def _record(self, data: list[object]) -> None:
        if any(nesting(value, MAX_NESTING) > MAX_NESTING for value in data):
            raise ProtocolViolation(f"a request's values nest deeper than {MAX_NESTING} levels "
                                    "of objects and arrays")
        try:
            size = len(json.dumps(data))
        except (TypeError, ValueError, RecursionError):
            raise ProtocolViolation("a request's values must be JSON (objects, arrays, "
                                    "strings, numbers, booleans and null)") from None
        self._recorded += size
        if self._recorded > MAX_RECORDED_BYTES:
            raise ProtocolViolation(f"the program sent over {MAX_RECORDED_BYTES} bytes of tool "
                                    "calls and steps for the host to record")

    def _count_free(self, before: tuple[int, int]) -> None:
        services = self._services
        if (services.env_actions, services.model_calls) != before:
            return
        self._free += 1
        if self._free > MAX_FREE_CALLS:
            raise ProtocolViolation(f"the program sent over {MAX_FREE_CALLS} requests that call "
                                    "neither the model nor the environment")

    def _known(self, request: object) -> object:
        """`request` with the messages and tools sent before replaced by their models."""
        if not isinstance(request, dict):
            return request
        known = dict(request)
        messages, tools = request.get("messages"), request.get("tools")
        if isinstance(messages, list):
            known["messages"] = self._messages(messages)
        if self._tools is not None and tools is self._tools[0]:
            known["tools"] = self._tools[1]
        return known

    def _remember(self, request: object, model: ProviderRequest) -> None:
        assert isinstance(request, dict)
        self._tools = (request["tools"], model.tools)


def _message_or_sent(message: object) -> object:
    """A message as its model, or as sent when it is not one: the whole request is then
    validated again, and its error names where in the request the message stands."""
    try:
        return Message.model_validate(message)
    except ValidationError:
        return message
