"""The ATIF trajectory of an episode (`trajectory.json`), which harbor's viewer shows.

Built with harbor's own trajectory models, as harbor's agents build theirs, so that what
is written is what harbor reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from harbor.models.trajectories import (
    Agent,
    FinalMetrics,
    Metrics,
    Observation,
    ObservationResult,
    Step,
    ToolCall,
    Trajectory,
)

from wmo_trio.episode._log import EpisodeLog, Reply
from wmo_trio.models import ActionKind
from wmo_trio.models import Step as EpisodeStep
from wmo_trio.trace import PartialTrace, Trace, json_text, write_atomically

TRAJECTORY_FILENAME = "trajectory.json"


@dataclass(frozen=True)
class TrajectoryInfo:
    """What the trajectory needs beyond the trace itself."""

    agent_name: str
    agent_version: str
    model_name: str | None = None
    session_id: str | None = None
    system_prompt: str = ""
    instruction: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def trajectory(trace: Trace, info: TrajectoryInfo, log: EpisodeLog | None) -> Trajectory:
    """The episode as ATIF: the system prompt and the instruction, then one agent step per
    model reply, carrying its tool calls, their observations and the reply's token usage
    (so harbor's usage sums come out right). Steps recorded without a reply of their own
    (a provider error, the budget ending) become system steps. Each step is stamped with
    when it happened: the episode's start, a reply's arrival, a lone step's start."""
    began = _iso(trace.started_at)
    steps = [Step(step_id=1, source="system", message=info.system_prompt, timestamp=began),
             Step(step_id=2, source="user", message=info.instruction, timestamp=began)]
    replies = log.replies() if log is not None else []
    for reply, taken in _turns(trace.steps, {reply.first_step: reply for reply in replies}):
        step_id = len(steps) + 1
        if reply is None:
            alone = taken[0][1]
            steps.append(Step(step_id=step_id, source="system", message=alone.observation.content,
                              timestamp=_iso(alone.started_at)))
        else:
            steps.append(_agent_step(step_id, reply, taken, info.model_name))
    usage = trace.worker_usage
    extra = {"stop_reason": str(trace.stop_reason), "answer": trace.answer, **info.extra}
    if isinstance(trace, PartialTrace):
        extra["partial"] = True
    return Trajectory(
        session_id=info.session_id,
        agent=Agent(name=info.agent_name, version=info.agent_version, model_name=info.model_name,
                    tool_definitions=info.tools or None),
        steps=steps,
        final_metrics=FinalMetrics(
            total_prompt_tokens=usage.input_tokens if usage else None,
            total_completion_tokens=usage.output_tokens if usage else None,
            total_cached_tokens=usage.cached_input_tokens if usage else None,
            total_steps=len(steps),
        ),
        extra=extra,
    )


_Taken = list[tuple[int, EpisodeStep]]


def _turns(steps: list[EpisodeStep], starts: dict[int, Reply]) -> list[tuple[Reply | None, _Taken]]:
    """The trace's steps (with their indices) grouped by the reply that produced them: a
    reply's tool calls, and at most one other step that ends its turn. A step no reply
    claims stands alone (reply None)."""
    turns: list[tuple[Reply | None, _Taken]] = []
    taking: _Taken | None = None  # the steps of the reply whose turn is open
    for index, step in enumerate(steps):
        reply = starts.get(index)
        is_call = step.action.kind is ActionKind.TOOL_CALL
        if reply is not None:
            taking = []
            turns.append((reply, taking))
        elif taking is None or not is_call:
            turns.append((None, [(index, step)]))
            taking = None
            continue
        taking.append((index, step))
        if not is_call:
            taking = None
    return turns


def _agent_step(step_id: int, reply: Reply, taken: _Taken, model_name: str | None) -> Step:
    calls: list[ToolCall] = []
    results: list[ObservationResult] = []
    for index, step in taken:
        call_id = None
        if step.action.kind is ActionKind.TOOL_CALL:
            call_id = f"call_{index}"
            calls.append(ToolCall(tool_call_id=call_id, function_name=step.action.name or "",
                                  arguments=step.action.arguments or {}))
        results.append(ObservationResult(source_call_id=call_id, content=step.observation.content))
    return Step(
        step_id=step_id, source="agent", model_name=model_name, message=reply.text,
        timestamp=_iso(reply.at),
        metrics=Metrics(prompt_tokens=reply.usage.input_tokens,
                        completion_tokens=reply.usage.output_tokens,
                        cached_tokens=reply.usage.cached_input_tokens),
        tool_calls=calls or None,
        observation=Observation(results=results) if results else None,
    )


def _iso(moment: datetime | None) -> str | None:
    """ATIF's timestamps are ISO 8601 text."""
    return None if moment is None else moment.isoformat()


def write_trajectory(directory: Path, trace: Trace, info: TrajectoryInfo,
                     log: EpisodeLog | None) -> None:
    write_atomically(directory / TRAJECTORY_FILENAME,
                     json_text(trajectory(trace, info, log).to_json_dict()))
