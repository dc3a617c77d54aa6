"""The ATIF trajectory of an episode, without a harbor trial: what `trajectory.json` holds,
read back the way harbor's viewer reads it (`Trajectory.model_validate`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import outcome
from doubles import Spy, make_doc
from harbor.models.trajectories import Trajectory

from wmo_trio.episode._environment import DirectoryShell
from wmo_trio.episode._execution import LocalExecution
from wmo_trio.harbor._trajectory import TRAJECTORY_FILENAME, TrajectoryInfo, write_trajectory
from wmo_trio.trace import TraceIdentity, trace_for

INFO = TrajectoryInfo(agent_name="wmo-harness", agent_version="0", model_name="scripted/s",
                      session_id="trial__agent", system_prompt="work", instruction="do it",
                      tools=[{"name": "bash"}], extra={"harness": "t"})


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def written(script: list[dict[str, Any]], tmp_path: Path) -> Trajectory:
    runtime = LocalExecution(make_doc(max_turns=3), Spy(script))
    result = outcome.capture(runtime.run, "task", "do it", DirectoryShell(tmp_path))
    trace = trace_for(TraceIdentity(task_id="task"), result, cancelled=None, log=runtime.log)
    write_trajectory(tmp_path, trace, INFO, runtime.log)
    return Trajectory.model_validate(json.loads((tmp_path / TRAJECTORY_FILENAME).read_text()))


def test_each_reply_is_one_agent_step_with_its_calls_observations_and_usage(tmp_path: Path) -> None:
    usage = {"input_tokens": 7, "output_tokens": 3, "cached_input_tokens": 2}
    trajectory = written([
        {"text": "two at once", "usage": usage,
         "tool_calls": [call("bash", command="echo a"), call("bash", command="echo b")]},
        {"tool_calls": [call("submit", answer="done")]},
    ], tmp_path)
    system, user, first, second = trajectory.steps
    assert (system.source, system.message, user.source, user.message) == ("system", "work", "user", "do it")
    assert [s.step_id for s in trajectory.steps] == [1, 2, 3, 4]
    assert first.source == "agent" and first.message == "two at once" and first.model_name == "scripted/s"
    assert first.tool_calls is not None and first.observation is not None
    assert [(c.function_name, c.arguments) for c in first.tool_calls] == [
        ("bash", {"command": "echo a"}), ("bash", {"command": "echo b"})]
    assert [r.source_call_id for r in first.observation.results] == [c.tool_call_id for c in first.tool_calls]
    assert [r.content for r in first.observation.results] == ["a\n", "b\n"]
    metrics = first.metrics
    assert metrics is not None
    assert (metrics.prompt_tokens, metrics.completion_tokens, metrics.cached_tokens) == (7, 3, 2)
    assert second.tool_calls is not None and second.tool_calls[0].function_name == "submit"
    assert trajectory.final_metrics is not None and trajectory.final_metrics.total_steps == 4
    assert trajectory.extra == {"stop_reason": "submitted", "answer": "done", "harness": "t"}
    assert trajectory.agent.name == "wmo-harness" and trajectory.session_id == "trial__agent"


def test_a_reply_without_tool_calls_ends_its_turn_with_an_uncalled_observation(tmp_path: Path) -> None:
    trajectory = written([{"text": "only words"}, {"tool_calls": [call("submit", answer="x")]}], tmp_path)
    words = trajectory.steps[2]
    assert words.source == "agent" and words.tool_calls is None and words.observation is not None
    assert [r.source_call_id for r in words.observation.results] == [None]


def test_a_step_no_reply_produced_is_a_system_step(tmp_path: Path) -> None:
    trajectory = written([{"tool_calls": [call("bash", command="true")]},
                          {"error": {"kind": "bad_request", "message": "refused by the model"}}], tmp_path)
    failure = trajectory.steps[-1]
    assert failure.source == "system" and "refused by the model" in str(failure.message)
    assert failure.tool_calls is None and failure.metrics is None
