"""Episode traces: `wmo-run.json`, the record an optimizer learns from.

A trace is written for every episode, however it ended: a `FinishedTrace` (the episode's
`RunResult`) when it finished on its own, otherwise a `PartialTrace` holding the steps
recorded so far, why it stopped and the usage known. Both say which episode they are
(`TraceIdentity`): the document, the model, harbor's task and trial, when it ran.
Timed-out trials are the most informative failures an optimizer sees, so losing their
transcripts is not an option. The partial stop reasons:

- `cancelled-by-harbor-timeout`: harbor's agent timeout cancelled the episode;
- `cancelled-by-harbor`: harbor cancelled it for another reason (`harbor run`
  interrupted, its job cancelled);
- `cancelled-by-caller`: a trio caller's scope was cancelled (the research API);
- `agent-exception:<Type>`: the episode raised.

(harbor's ATIF `trajectory.json` is written by the harbor agent, `wmo_trio.harbor`.)

Files are written to a temporary name and renamed, so a reader never sees half a trace.
"""

from __future__ import annotations

import itertools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import outcome
import pydantic_core
from pydantic import BaseModel, ConfigDict, NonNegativeInt

from wmo_trio.models import JsonObject, RunResult, Step, StopReason, TokenUsage, count_tool_steps
from wmo_trio.text import valid_text

if TYPE_CHECKING:
    from wmo_trio.episode.log import EpisodeLog

TRACE_FILENAME = "wmo-run.json"
CANCELLED_BY_HARBOR_TIMEOUT = "cancelled-by-harbor-timeout"
CANCELLED_BY_HARBOR = "cancelled-by-harbor"
CANCELLED_BY_CALLER = "cancelled-by-caller"


class TraceIdentity(BaseModel):
    """Which episode a trace is. `task_id` means what it means in harbor's `result.json`
    (the task's id there, as harbor writes it; a caller's own id in the research API);
    `trial_id` is harbor's trial UUID, `trial_name` and `task_name` harbor's names, `model`
    the provider's `<kind>/<model>`, and the times are UTC. Outside harbor the trial's
    fields are null."""

    model_config = ConfigDict(extra="forbid")

    task_id: str | JsonObject
    trial_id: str | None = None
    trial_name: str | None = None
    task_name: str | None = None
    doc_hash: str | None = None
    model: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None


class _Transcript(TraceIdentity):
    steps: list[Step]
    answer: str = ""
    worker_usage: TokenUsage | None = None


class FinishedTrace(_Transcript):
    """An episode that returned its own result (`RunResult`)."""

    stop_reason: StopReason
    turns: NonNegativeInt


class PartialTrace(_Transcript):
    """What is known of an episode that did not return its own result."""

    stop_reason: str
    turns: int
    partial: Literal[True] = True
    error: str | None = None


Trace = FinishedTrace | PartialTrace


def parse_trace(text: str | bytes) -> Trace:
    """Parse a `wmo-run.json` (full or partial) against the contract's schema."""
    data = json.loads(text)
    if isinstance(data, dict) and data.get("partial") is True:
        return PartialTrace.model_validate(data)
    return FinishedTrace.model_validate(data)


def trace_for(
    identity: TraceIdentity,
    result: outcome.Outcome[RunResult] | None,
    *,
    cancelled: str | None,
    log: EpisodeLog | None,
) -> Trace:
    """The trace of an episode, named by `identity`: its own result, or the partial record
    of one that raised or whose caller was cancelled; `cancelled` is then the stop reason
    that says by whom."""
    named = identity.model_dump()
    if isinstance(result, outcome.Value) and cancelled is None:
        finished: RunResult = result.value
        return FinishedTrace(**named, steps=finished.steps, stop_reason=finished.stop_reason,
                             answer=finished.answer, turns=finished.turns,
                             worker_usage=finished.worker_usage)
    error = result.error if isinstance(result, outcome.Error) else None
    if isinstance(result, outcome.Value):
        steps, usage = result.value.steps, result.value.worker_usage
    else:
        steps = log.steps() if log is not None else []
        usage = log.usage() if log is not None else getattr(error, "usage", None)
    return PartialTrace(
        **named,
        steps=steps,
        stop_reason=cancelled or (CANCELLED_BY_CALLER if error is None
                                  else f"agent-exception:{type(error).__name__}"),
        turns=count_tool_steps(steps),
        error=None if error is None else f"{type(error).__name__}: {error}",
        worker_usage=usage,
    )


_temporary_names = itertools.count()


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`.

    The temporary name is unique to this process and call, so no random name is drawn and
    the directory is created only when the first open finds it missing: a trace write is
    three system calls when it can be, since 256 of them follow 256 timeouts at once.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{next(_temporary_names)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(temporary, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(temporary, flags, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(text.encode("utf-8"))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_trace(directory: str | Path, trace: Trace) -> Path:
    """Write `trace` as `wmo-run.json` in `directory` (created if missing); its path."""
    path = Path(directory) / TRACE_FILENAME
    write_atomically(path, trace_text(trace))
    return path


def trace_text(trace: Trace) -> str:
    """The text of a `wmo-run.json`."""
    return json_text(trace.model_dump(mode="json"))


def json_text(data: Any) -> str:
    """`data` as indented UTF-8 JSON text.

    Written by pydantic-core's serializer, because `json.dumps(indent=2)` falls back to
    the pure-Python encoder whenever it indents; after a burst of timeouts every trace is
    written at once, so this is on the cancellation's critical path (`make bench`, the
    "cancel" scenarios with a command or a model call in flight, which write a trace per
    episode). Text with an unpaired surrogate cannot be UTF-8: that rare trace takes the
    slow path, which replaces each such surrogate with U+FFFD.
    """
    try:
        return pydantic_core.to_json(data, indent=2).decode("utf-8")
    except pydantic_core.PydanticSerializationError:
        return valid_text(json.dumps(data, indent=2, ensure_ascii=False))
