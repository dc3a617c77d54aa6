"""Episode traces: `wmo-run.json` for the optimizer, `trajectory.json` (ATIF) for harbor.

A trace is written for every episode, however it ended: the full `RunResult` when the
episode finished on its own, otherwise a `PartialTrace` holding the steps recorded so far,
why it stopped (`cancelled-by-harbor-timeout` or `agent-exception:<Type>`) and the usage
known. Timed-out trials are the most informative failures an optimizer sees, so losing
their transcripts is not an option.

Files are written to a temporary name and renamed, so a reader never sees half a trace.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Literal

import outcome
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from wmo_trio.episode.runtime import EpisodeLog
from wmo_trio.episode.tools import valid_text
from wmo_trio.models import ActionKind, RunResult, Step, TokenUsage, count_tool_steps

TRACE_FILENAME = "wmo-run.json"
TRAJECTORY_FILENAME = "trajectory.json"
CANCELLED_STOP_REASON = "cancelled-by-harbor-timeout"


class PartialTrace(BaseModel):
    """What is known of an episode that did not return its own result."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    steps: list[Step]
    stop_reason: str
    answer: str = ""
    turns: int
    partial: Literal[True] = True
    error: str | None = None
    worker_usage: TokenUsage | None = None


Trace = RunResult | PartialTrace


def parse_trace(text: str | bytes) -> Trace:
    """Parse a `wmo-run.json` (full or partial) against the contract's schema."""
    data = json.loads(text)
    if isinstance(data, dict) and data.get("partial") is True:
        return PartialTrace.model_validate(data)
    return RunResult.model_validate(data)


def trace_for(
    task_id: str,
    result: outcome.Outcome[RunResult] | None,
    *,
    cancelled: bool,
    log: EpisodeLog | None,
) -> Trace:
    """The trace of an episode: its own result, or the partial record of one that was
    cancelled by harbor or raised."""
    if isinstance(result, outcome.Value) and not cancelled:
        finished: RunResult = result.value
        return finished
    error = result.error if isinstance(result, outcome.Error) else None
    if isinstance(result, outcome.Value):
        steps, usage = result.value.steps, result.value.worker_usage
    else:
        steps = log.steps() if log is not None else []
        usage = log.usage() if log is not None else getattr(error, "usage", None)
    return PartialTrace(
        task_id=task_id,
        steps=steps,
        stop_reason=CANCELLED_STOP_REASON if cancelled or error is None
        else f"agent-exception:{type(error).__name__}",
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


class TrajectoryInfo(BaseModel):
    """What the ATIF trajectory needs beyond the trace itself."""

    agent_name: str
    agent_version: str
    model_name: str | None = None
    session_id: str | None = None
    system_prompt: str = ""
    instruction: str = ""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)


def trajectory_json(trace: Trace, info: TrajectoryInfo, log: EpisodeLog | None) -> dict[str, Any]:
    """An ATIF trajectory of the episode (valid for harbor's `Trajectory` model).

    One agent step per model reply, carrying its tool calls, their observations and the
    reply's token usage, so harbor's viewer shows the episode and its usage sums come out
    right. Steps recorded without a reply of their own (a provider error, the budget
    ending) become system steps.
    """
    steps: list[dict[str, Any]] = [
        {"step_id": 1, "source": "system", "message": info.system_prompt},
        {"step_id": 2, "source": "user", "message": info.instruction},
    ]
    replies = log.replies() if log is not None else []
    starts = {reply.first_step: reply for reply in replies}
    current: dict[str, Any] | None = None
    for index, step in enumerate(trace.steps):
        reply = starts.get(index)
        if reply is not None:
            current = {
                "source": "agent",
                "model_name": info.model_name,
                "message": reply.text,
                "metrics": {
                    "prompt_tokens": reply.usage.input_tokens,
                    "completion_tokens": reply.usage.output_tokens,
                    "cached_tokens": reply.usage.cached_input_tokens,
                },
            }
            steps.append(current)
        elif current is None or step.action.kind is not ActionKind.TOOL_CALL:
            current = None
            steps.append({"source": "system", "message": step.observation.content})
            continue
        if step.action.kind is ActionKind.TOOL_CALL:
            call_id = f"call_{index}"
            current.setdefault("tool_calls", []).append({
                "tool_call_id": call_id,
                "function_name": step.action.name or "",
                "arguments": step.action.arguments or {},
            })
            current.setdefault("observation", {"results": []})["results"].append(
                {"source_call_id": call_id, "content": step.observation.content}
            )
        else:
            current["observation"] = {"results": [{"content": step.observation.content}]}
            current = None
    for number, step_json in enumerate(steps, start=1):
        step_json["step_id"] = number
    usage = trace.worker_usage
    extra = {"stop_reason": str(trace.stop_reason), "answer": trace.answer, **info.extra}
    if isinstance(trace, PartialTrace):
        extra["partial"] = True
    trajectory: dict[str, Any] = {
        "schema_version": "ATIF-v1.8",
        "session_id": info.session_id,
        "agent": {"name": info.agent_name, "version": info.agent_version,
                  "model_name": info.model_name, "tool_definitions": info.tools or None},
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": usage.input_tokens if usage else None,
            "total_completion_tokens": usage.output_tokens if usage else None,
            "total_cached_tokens": usage.cached_input_tokens if usage else None,
            "total_steps": len(steps),
        },
        "extra": extra,
    }
    cleaned: dict[str, Any] = _drop_none(trajectory)
    return cleaned


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


class TraceWriter:
    """Writes an episode's trace files into one directory (harbor's `logs_dir`)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @property
    def trace_path(self) -> Path:
        return self.directory / TRACE_FILENAME

    def write(self, trace: Trace, *, trajectory: TrajectoryInfo | None = None,
              log: EpisodeLog | None = None) -> None:
        """Write `wmo-run.json` first (the optimizer's record), then `trajectory.json`."""
        write_atomically(self.trace_path, trace_text(trace))
        if trajectory is not None:
            write_atomically(self.directory / TRAJECTORY_FILENAME,
                             _json_text(trajectory_json(trace, trajectory, log)))


def trace_text(trace: Trace) -> str:
    """The text of a `wmo-run.json`."""
    return _json_text(trace.model_dump(mode="json"))


def _json_text(data: Any) -> str:
    """`data` as indented UTF-8 JSON text.

    pydantic-core's serializer does it about 10x faster than `json.dumps(indent=2)`, which
    falls back to the pure-Python encoder whenever it indents; after 256 simultaneous
    timeouts every trace is written at once, so this is on the cancellation's critical
    path. Text with an unpaired surrogate cannot be UTF-8: that rare trace takes the slow
    path, which replaces each such surrogate with U+FFFD.
    """
    try:
        return pydantic_core.to_json(data, indent=2).decode("utf-8")
    except pydantic_core.PydanticSerializationError:
        return valid_text(json.dumps(data, indent=2, ensure_ascii=False))
