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
No input stops a trace from being written: one whose values cannot be serialised whole
(nested past the serializer's depth, say) is written reduced, its `reduced` field saying
what was cut.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import outcome
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from wmo_trio._text import valid_text
from wmo_trio.models import JsonObject, RunResult, Step, StopReason, TokenUsage, count_tool_steps

if TYPE_CHECKING:
    from wmo_trio.episode._log import EpisodeLog

TRACE_FILENAME = "wmo-run.json"
CANCELLED_BY_HARBOR_TIMEOUT = "cancelled-by-harbor-timeout"
CANCELLED_BY_HARBOR = "cancelled-by-harbor"
CANCELLED_BY_CALLER = "cancelled-by-caller"
# How deep a reduced trace keeps the values of its steps (and its task id), in levels of
# objects and arrays: pydantic-core's serializer stops at 255, the trace's own among them.
REDUCED_NESTING = 32
CUT = "<cut: nested deeper than the trace keeps>"


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
    # Only in a trace that could not be written whole: what was cut, and why.
    reduced: str | None = Field(default=None, exclude_if=lambda value: value is None)


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
    """The text of a `wmo-run.json`: the whole trace, or where that cannot be serialised,
    the trace reduced (:func:`reduced`)."""
    try:
        data = trace.model_dump(mode="json")
    except ValueError as error:  # pydantic-core's serialization errors are ValueErrors
        try:
            data = reduced(trace, error, REDUCED_NESTING).model_dump(mode="json")
        except ValueError:  # not for want of depth: the steps' values go altogether
            data = reduced(trace, error, 0).model_dump(mode="json")
    return json_text(data)


def reduced(trace: Trace, error: Exception, depth: int) -> Trace:
    """``trace`` with each object or array in its steps' arguments and metadata (and
    its task id) nested deeper than ``depth`` levels replaced by `CUT` (``depth`` 0:
    the arguments and metadata left out), and its `reduced` field saying so and why the
    whole could not be written."""
    steps = [step.model_copy(update={
        "action": step.action.model_copy(
            update={"arguments": _cut(step.action.arguments, depth) if depth else None}),
        "observation": step.observation.model_copy(
            update={"metadata": _cut(step.observation.metadata, depth) if depth else {}}),
    }) for step in trace.steps]
    what = (f"values nested deeper than {depth} levels were cut" if depth else
            "the tool calls' arguments and the observations' metadata were left out")
    return trace.model_copy(update={
        "steps": steps, "task_id": _cut(trace.task_id, max(depth, 1)),
        "reduced": f"{what}: the whole trace could not be serialised ({error})"})


def nesting(value: object, limit: int) -> int:
    """How many levels of dicts, lists and tuples ``value`` holds (a scalar none, ``{}``
    one), counted without recursion and at most to ``limit + 1``."""
    deepest = 0
    pending: list[tuple[object, int]] = [(value, 0)]
    while pending:
        current, level = pending.pop()
        if isinstance(current, dict):
            children: Iterable[object] = current.values()
        elif isinstance(current, list | tuple):
            children = current
        else:
            continue
        deepest = max(deepest, level + 1)
        if deepest > limit:
            return deepest
        pending.extend((child, level + 1) for child in children)
    return deepest


def _cut(value: Any, depth: int) -> Any:
    """``value`` copied (without recursion) with each dict, list or tuple nested deeper
    than ``depth`` (>= 1) levels replaced by `CUT`."""
    if nesting(value, depth) <= depth:
        return value
    holder: list[Any] = [None]
    pending: list[tuple[Any, Any, Any, int]] = [(holder, 0, value, 1)]
    while pending:
        parent, key, current, level = pending.pop()
        if not isinstance(current, dict | list | tuple):
            parent[key] = current
        elif level > depth:
            parent[key] = CUT
        elif isinstance(current, dict):
            parent[key] = copied = dict.fromkeys(current)
            pending.extend((copied, name, item, level + 1) for name, item in current.items())
        else:
            parent[key] = listed = [None] * len(current)
            pending.extend((listed, index, item, level + 1) for index, item in enumerate(current))
    return holder[0]


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
