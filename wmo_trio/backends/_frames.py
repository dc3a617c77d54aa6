"""The host's half of the frame protocol (`wmo_trio.episode.portable`), for every backend
whose runner is a process speaking JSON frames: `e2b` and `sandbox`.

A backend gives `serve_frames` a `RunnerStream` (its runner's lines in, frames out); the
frames are turned into calls on the episode's `EpisodeServices`, which decide every rule.
What a runner may send is decided here, once, for both: a frame's shape, the order
(hello first), and how much a program may make the host keep. Everything a runner sends is
hostile: a line is parsed within bounds, and a frame that breaks a rule ends the episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from wmo_trio.control import CallControl
from wmo_trio.episode.portable import PROTOCOL
from wmo_trio.episode.services import EpisodeServices
from wmo_trio.models import Action, ActionKind, Step, StopReason
from wmo_trio.providers.base import ProviderRequest
from wmo_trio.settings import validation_problem

__all__ = ["MAX_FRAME_BYTES", "WAKE", "Exited", "ProtocolViolation", "RunnerStream",
           "TransportFailure", "ended_early", "serve_frames"]

# A frame is a model request or reply: large, but never this large.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# Frames that cost neither a model call nor an environment action (refused tools,
# read_skill) are otherwise free: a program could flood the host's transcript with them.
MAX_FREE_FRAMES = 4096
# What a program may make the host record (tool calls' arguments, message steps).
MAX_RECORDED_BYTES = 64 * 1024 * 1024


class TransportFailure(Exception):
    """The runner's side failed: its start, its process, or its byte stream."""


class ProtocolViolation(Exception):
    """The runner sent something the protocol does not allow."""


@dataclass(frozen=True)
class Exited:
    """The runner's output stream ended: its exit code, or why the stream broke."""

    exit_code: int | None
    error: str | None = None


def ended_early(exited: Exited, stderr_tail: str, why: str = "") -> str:
    """What to record about a runner that ended before its done frame: how, `why` when
    the backend knows more, and the end of what it wrote to stderr."""
    if exited.error is not None:
        text = f"the runner's output stream failed before its done frame: {exited.error}"
    else:
        text = f"the runner exited with code {exited.exit_code} before its done frame{why}"
    tail = stderr_tail.strip()
    return text + (f"; its stderr ends with:\n{tail}" if tail else "")


WAKE = object()  # what `RunnerStream.next` returns to make the server look at its boundaries


class RunnerStream(Protocol):
    """One runner as the server sees it."""

    def next(self, timeout: float | None) -> object:
        """The next line (a `str`, without its newline), an `Exited`, or `WAKE` (woken, or
        `timeout` passed)."""

    def send(self, frame: dict[str, Any]) -> None:
        """Send one frame; a `TransportFailure` if it cannot."""

    def describe(self, exited: Exited) -> str:
        """What to record about a runner that ended before its done frame."""


def _frame_field(frame: dict[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    value = frame.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolViolation(f"{frame.get('type')!r} frame: field {name!r} must be "
                                f"{kind.__name__}, got {type(value).__name__}")
    return value


def _validated[M: BaseModel](model: type[M], data: object, what: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = validation_problem(error, whole=what, most=3)
        raise ProtocolViolation(f"invalid {what}: {problems}") from None


def parse_frame(line: str) -> dict[str, Any]:
    """One line as a frame: a JSON object. A line that is not JSON is a broken stream (a
    `TransportFailure`); JSON that is no object, or nested past what the parser takes, is
    a `ProtocolViolation`."""
    try:
        frame = json.loads(line)
    except RecursionError:
        raise ProtocolViolation("a frame nests deeper than the host parses") from None
    except ValueError:
        raise TransportFailure(
            f"the runner sent a line that is not a JSON frame: {line[:200]!r}") from None
    if not isinstance(frame, dict):
        raise ProtocolViolation(f"a frame must be a JSON object, got {line[:200]!r}")
    return frame


class _Allowance:
    """How much more a program may make the host keep; see the module's constants."""

    def __init__(self, services: EpisodeServices) -> None:
        self._services = services
        self._free = 0
        self._recorded = 0
        self._steps = 0

    def recorded(self, line: str) -> None:
        self._recorded += len(line)
        if self._recorded > MAX_RECORDED_BYTES:
            raise ProtocolViolation(f"the program sent over {MAX_RECORDED_BYTES} bytes of tool "
                                    "calls and steps for the host to record")

    def free(self, env_actions_before: int, model_calls_before: int) -> None:
        services = self._services
        if (services.env_actions, services.model_calls) != (env_actions_before, model_calls_before):
            return
        self._free += 1
        if self._free > MAX_FREE_FRAMES:
            raise ProtocolViolation(f"the program sent over {MAX_FREE_FRAMES} frames that call "
                                    "neither the model nor the environment")

    def step(self) -> None:
        # The built-in loop records one message per model reply it cannot use, and a
        # program records at most its own error at the end.
        self._steps += 1
        if self._steps > self._services.model_calls + 1:
            raise ProtocolViolation("the program sent more message steps than it made model "
                                    "calls (one a reply, and one at its end, at most)")


def serve_frames(runner: RunnerStream, services: EpisodeServices,
                 control: CallControl) -> tuple[StopReason, str]:
    """Answer `runner`'s frames until its done frame; the episode's ending.

    Cancellation and the wall-clock budget are checked at every frame (`services.boundary`,
    which raises the ending); every wait goes through `control`. Raises `TransportFailure`
    or `ProtocolViolation` when the runner breaks its side.
    """
    greeted = False
    allowance = _Allowance(services)
    while True:
        with control.blocking():
            item = runner.next(control.remaining())
        services.boundary()
        if item is WAKE:
            continue
        if isinstance(item, Exited):
            raise TransportFailure(runner.describe(item))
        assert isinstance(item, str)
        frame = parse_frame(item)
        kind = frame.get("type")
        if not greeted:
            if kind != "hello" or frame.get("protocol") != PROTOCOL:
                raise ProtocolViolation(
                    f"expected a hello frame for protocol {PROTOCOL}, got {item[:200]!r}")
            greeted = True
        elif kind == "complete":
            frame_id = _frame_field(frame, "id", int)
            request = _validated(ProviderRequest, frame.get("request"), "model request")
            response = services.completion(request)
            with control.blocking():
                runner.send({"type": "completion", "id": frame_id, "response": response})
        elif kind == "execute":
            allowance.recorded(item)
            frame_id = _frame_field(frame, "id", int)
            action = Action(
                kind=ActionKind.TOOL_CALL,
                name=_frame_field(frame, "tool", str),
                arguments=_frame_field(frame, "arguments", dict, optional=True),
                content=_frame_field(frame, "content", str, optional=True),
            )
            before = services.env_actions, services.model_calls
            observation = services.execute(
                action, _frame_field(frame, "parse_error", str, optional=True))
            allowance.free(*before)
            with control.blocking():
                runner.send({"type": "observation", "id": frame_id,
                             "observation": observation.model_dump(mode="json")})
        elif kind == "step":
            allowance.recorded(item)
            allowance.step()
            step = _validated(Step, frame.get("step"), "step")
            if step.action.kind is not ActionKind.MESSAGE:
                raise ProtocolViolation("a step frame may only carry a message step; tool "
                                        "calls are recorded by the host as it answers them")
            services.record_step(step.action, step.observation)
        elif kind == "done":
            reason = frame.get("stop_reason")
            answer = _frame_field(frame, "answer", str, optional=True) or ""
            return services.finish(reason if isinstance(reason, str) else repr(reason), answer)
        else:
            raise ProtocolViolation(f"unknown frame type {kind!r}")
