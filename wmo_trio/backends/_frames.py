"""The host's half of the frame protocol (`wmo_trio.episode.portable`), for every backend
whose runner is a process speaking JSON frames: `e2b` and `sandbox`.

A backend gives `serve_frames` a `RunnerStream` (its runner's lines in, frames out); each
frame is decoded into a call on the episode's `ProgramChannel` (`wmo_trio.episode._channel`),
which decides what a program may ask for on every backend, the in-process one included,
and the reply is encoded as a frame. What is decided here is the frames' own: a line is
parsed within bounds, a frame is a JSON object, the hello comes first, a reply echoes its
request's `id`. Everything a runner sends is hostile: a frame that breaks a rule ends the
episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from wmo_trio.control import CallControl
from wmo_trio.episode._channel import ProgramChannel, ProtocolViolation, typed_field
from wmo_trio.episode._services import EpisodeServices
from wmo_trio.episode.portable import PROTOCOL
from wmo_trio.models import StopReason

__all__ = ["MAX_FRAME_BYTES", "WAKE", "Exited", "ProtocolViolation", "RunnerStream",
           "TransportFailure", "ended_early", "serve_frames"]

# A frame is a model request or reply: large, but never this large.
MAX_FRAME_BYTES = 16 * 1024 * 1024


class TransportFailure(Exception):
    """The runner's side failed: its start, its process, or its byte stream."""


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


def serve_frames(runner: RunnerStream, services: EpisodeServices,
                 control: CallControl) -> tuple[StopReason, str]:
    """Answer `runner`'s frames until its done frame; the episode's ending.

    Cancellation and the wall-clock budget are checked at every frame (`services.boundary`,
    which raises the ending); every wait goes through `control`. Raises `TransportFailure`
    or `ProtocolViolation` when the runner breaks its side.
    """
    channel = ProgramChannel(services)
    greeted = False
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
            frame_id = typed_field("'complete' frame", "id", frame.get("id"), int)
            response = channel.complete(frame.get("request"))
            with control.blocking():
                runner.send({"type": "completion", "id": frame_id, "response": response})
        elif kind == "execute":
            frame_id = typed_field("'execute' frame", "id", frame.get("id"), int)
            observation = channel.execute(frame.get("tool"), frame.get("arguments"),
                                          frame.get("content"), frame.get("parse_error"))
            with control.blocking():
                runner.send({"type": "observation", "id": frame_id, "observation": observation})
        elif kind == "step":
            step = frame.get("step")
            if not isinstance(step, dict):
                raise ProtocolViolation(f"a step frame must carry an object, got {step!r:.200}")
            channel.step(step.get("action"), step.get("observation"))
        elif kind == "done":
            return channel.done(frame.get("stop_reason"), frame.get("answer"))
        else:
            raise ProtocolViolation(f"unknown frame type {kind!r}")
