"""The ATIF trajectory of an episode (`trajectory.json`), which harbor's viewer shows.

Built with harbor's own trajectory models, as harbor's agents build theirs, so that what
is written is what harbor reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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

from wmo_trio.episode.log import EpisodeLog
from wmo_trio.models import ActionKind
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
    (a provider error, the budget ending) become system steps."""
    steps: list[dict[str, Any]] = [
        {"source": "system", "message": info.system_prompt},
        {"source": "user", "message": info.instruction},
    ]
    starts = {reply.first_step: reply for reply in (log.replies() if log is not None else [])}
    current: dict[str, Any] | None = None
    for index, step in enumerate(trace.steps):
        reply = starts.get(index)
        if reply is not None:
            current = {
                "source": "agent",
                "model_name": info.model_name,
                "message": reply.text,
                "metrics": Metrics(prompt_tokens=reply.usage.input_tokens,
                                   completion_tokens=reply.usage.output_tokens,
                                   cached_tokens=reply.usage.cached_input_tokens),
                "tool_calls": [],
                "results": [],
            }
            steps.append(current)
        elif current is None or step.action.kind is not ActionKind.TOOL_CALL:
            current = None
            steps.append({"source": "system", "message": step.observation.content})
            continue
        if step.action.kind is ActionKind.TOOL_CALL:
            call_id = f"call_{index}"
            current["tool_calls"].append(ToolCall(tool_call_id=call_id,
                                                  function_name=step.action.name or "",
                                                  arguments=step.action.arguments or {}))
            current["results"].append(ObservationResult(source_call_id=call_id,
                                                        content=step.observation.content))
        else:
            current["results"].append(ObservationResult(content=step.observation.content))
            current = None
    usage = trace.worker_usage
    extra = {"stop_reason": str(trace.stop_reason), "answer": trace.answer, **info.extra}
    if isinstance(trace, PartialTrace):
        extra["partial"] = True
    return Trajectory(
        session_id=info.session_id,
        agent=Agent(name=info.agent_name, version=info.agent_version, model_name=info.model_name,
                    tool_definitions=info.tools or None),
        steps=[_step(number, step) for number, step in enumerate(steps, start=1)],
        final_metrics=FinalMetrics(
            total_prompt_tokens=usage.input_tokens if usage else None,
            total_completion_tokens=usage.output_tokens if usage else None,
            total_cached_tokens=usage.cached_input_tokens if usage else None,
            total_steps=len(steps),
        ),
        extra=extra,
    )


def _step(number: int, fields: dict[str, Any]) -> Step:
    tool_calls = fields.pop("tool_calls", None)
    results = fields.pop("results", None)
    return Step(step_id=number, tool_calls=tool_calls or None,
                observation=Observation(results=results) if results else None, **fields)


def write_trajectory(directory: Path, trace: Trace, info: TrajectoryInfo,
                     log: EpisodeLog | None) -> None:
    write_atomically(directory / TRAJECTORY_FILENAME,
                     json_text(trajectory(trace, info, log).to_json_dict()))
