"""`WmoTrioHarborAgent` in real harbor trials (CONTRACT sections 4 and 5).

Every `harbor`-marked test runs harbor itself: its CLI where the command line is part of
what is checked (the README's job, a Ctrl-C), a script that runs a `Job` under `trio.run`
or with a plugin agent, and otherwise harbor's `Job` in the pytest process under
`asyncio.run`, as the CLI runs it; always on real task directories, in the docker-free
`wmo_trio.harbor:LocalEnvironment`, with the scripted provider playing the model. The
tests read what harbor wrote: each trial's `result.json` and the agent's `wmo-run.json` and
`trajectory.json`. Nothing of harbor or wmo_trio is mocked; the few defects the episode
cannot produce on its own are injected by a plugin module that harbor imports as the agent
(see `DEFECTS_PLUGIN`).

Trio-asyncio changes asyncio's global loop policy when imported, so it is only ever
imported in subprocesses, never in the pytest process.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from harbor_jobs import JOB_TIMEOUT_S, run_job_here
from support.harbor_runs import (
    AGENT,
    EXAMPLE_TASKS,
    HARNESS,
    LOCAL_ENVIRONMENT,
    OFFLINE,
    REPO,
    HarborJob,
    TrialRecord,
    harbor_env,
    harbor_run,
    make_task,
    trial_records,
)

from wmo_trio.harbor import AGENT_NAME, WmoTrioHarborAgent
from wmo_trio.harness import load_harness
from wmo_trio.models import ActionKind
from wmo_trio.trace import (
    CANCELLED_BY_HARBOR,
    CANCELLED_BY_HARBOR_TIMEOUT,
    FinishedTrace,
    PartialTrace,
    Trace,
    parse_trace,
)

# -- running harbor ---------------------------------------------------------------------


















def harbor_job_here(
    jobs_dir: Path,
    task: Path,
    *,
    provider_config: Mapping[str, Any] = OFFLINE,
    agent_kwargs: Mapping[str, Any] | None = None,
    attempts: int = 1,
    concurrent: int = 4,
) -> list[TrialRecord]:
    """The job `harbor_run` starts, run by harbor's `Job` in this process (see
    tests/harbor_jobs.py); its trials."""
    from harbor.models.job.config import JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    agent = AgentConfig(
        import_path=AGENT, model_name=f"{provider_config['kind']}/{provider_config['model']}",
        skip_model_parsing=True,  # what SKIP_MODEL_LOOKUP says on harbor's command line
        kwargs={"harness": str(HARNESS), "provider_config": dict(provider_config),
                **(agent_kwargs or {})})
    run_job_here(JobConfig(
        job_name="job", jobs_dir=jobs_dir, n_attempts=attempts, n_concurrent_trials=concurrent,
        quiet=True, agents=[agent], environment=EnvironmentConfig(import_path=LOCAL_ENVIRONMENT),
        tasks=[TaskConfig(path=task)]))
    return trial_records(jobs_dir / "job")


# -- tasks and scripts ------------------------------------------------------------------




def call(name: str, **arguments: str) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def scripted(path: Path, replies: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    """A scripted provider config whose script is a file (never a command-line argument, so
    no process's command line carries what the script runs)."""
    path.write_text(json.dumps(replies))
    return {"kind": "scripted", "model": "s", "script": str(path), **settings}


def tool_steps(trace: Trace) -> list[Any]:
    return [step for step in trace.steps if step.action.kind is ActionKind.TOOL_CALL]


# =======================================================================================
# 1. `harbor run` on the example tasks
# =======================================================================================

EXPECTED_EXAMPLE_OUTCOMES = {
    "hello-file": (1.0, None),
    "calc-package": (1.0, None),
    "proof-of-work": (0.0, "AgentTimeoutError"),
}


def outcomes(trials: list[TrialRecord]) -> dict[str, tuple[float | None, str | None]]:
    return {trial.task: (trial.reward, trial.exception_type) for trial in trials}


@pytest.fixture(scope="module")
def example_job(tmp_path_factory: pytest.TempPathFactory) -> list[TrialRecord]:
    jobs = tmp_path_factory.mktemp("example-jobs")
    return harbor_run(jobs, EXAMPLE_TASKS, concurrent=3).trials()


@pytest.mark.harbor
def test_harbor_cli_gives_the_example_tasks_their_expected_rewards(
    example_job: list[TrialRecord],
) -> None:
    assert outcomes(example_job) == EXPECTED_EXAMPLE_OUTCOMES, [t.describe() for t in example_job]


@pytest.mark.harbor
def test_harbor_cli_trials_each_leave_a_valid_trace_and_atif_trajectory(
    example_job: list[TrialRecord],
) -> None:
    for trial in example_job:
        trace = trial.trace  # parse_trace validates it against the contract's schema
        trajectory = trial.trajectory()
        assert trajectory.agent.name == AGENT_NAME
        if trial.task == "proof-of-work":
            assert isinstance(trace, PartialTrace)
            assert trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
        else:
            assert isinstance(trace, FinishedTrace)
            assert trace.stop_reason == "submitted"


def assert_trace_names_its_trial(trial: TrialRecord) -> None:
    """The trace says which trial it is, in harbor's own terms: each name means what it
    means in harbor's `result.json`; the times are UTC, inside the agent's phase."""
    trace, result = trial.trace, trial.result
    assert trace.task_id == result["task_id"], trial.describe()  # a task, as harbor names it
    assert trace.trial_id == result["id"]
    assert (trace.task_name, trace.trial_name) == (result["task_name"], result["trial_name"])
    assert trace.doc_hash == load_harness(HARNESS).doc_hash
    assert trace.model == result["config"]["agent"]["model_name"]
    assert trace.started_at is not None and trace.ended_at is not None
    assert trace.started_at.utcoffset() == trace.ended_at.utcoffset() == timedelta(0)
    agent_started, agent_ended = trial.phase_seconds("agent_execution")
    assert agent_started <= trace.started_at.timestamp() <= trace.ended_at.timestamp()
    # harbor stamps the phase's end after the agent's cancellation has run its course.
    assert trace.ended_at.timestamp() <= agent_ended + 1
    previous = trace.started_at
    for step in trace.steps:
        assert step.started_at is not None and step.duration_s is not None
        assert previous <= step.started_at <= trace.ended_at
        previous = step.started_at
    stamps = [step.timestamp for step in trial.trajectory().steps]
    assert all(stamps), stamps
    moments = [datetime.fromisoformat(stamp) for stamp in stamps if stamp]
    assert moments == sorted(moments) and moments[0] == trace.started_at


@pytest.mark.harbor
def test_harbor_cli_traces_and_trajectories_name_their_trial_and_time_their_steps(
    example_job: list[TrialRecord],
) -> None:
    # One finished and one timed-out (partial) trace at least: both carry the same fields.
    assert {type(trial.trace) for trial in example_job} == {FinishedTrace, PartialTrace}
    for trial in example_job:
        assert trial.trace.steps, trial.describe()
        assert_trace_names_its_trial(trial)


@pytest.mark.harbor
def test_harbor_cli_trials_report_usage_and_candidate_metadata(
    example_job: list[TrialRecord],
) -> None:
    doc_hash = load_harness(HARNESS).doc_hash
    for trial in example_job:
        agent_result, trace = trial.agent_result, trial.trace
        usage = trace.worker_usage
        assert usage is not None and usage.calls >= 1, trial.describe()
        assert agent_result["n_input_tokens"] > 0
        assert agent_result["n_input_tokens"] == usage.input_tokens
        assert agent_result["n_output_tokens"] == usage.output_tokens
        assert agent_result["n_cache_tokens"] == usage.cached_input_tokens
        assert agent_result["metadata"] == {
            "candidate_doc_hash": doc_hash,
            "stop_reason": str(trace.stop_reason),
            "turns": trace.turns,
        }


# =======================================================================================
# 2. The same job with trio owning the process
# =======================================================================================

TRIO_OWNED_JOB = """
import sys
from pathlib import Path

import trio
from harbor.models.job.config import JobConfig
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

from wmo_trio.harbor import run_job

jobs_dir, harness = map(Path, sys.argv[1:3])
config = JobConfig(
    job_name="trio-owned",
    jobs_dir=jobs_dir,
    n_concurrent_trials=3,
    quiet=True,
    agents=[AgentConfig(
        import_path="wmo_trio.harbor:WmoTrioHarborAgent",
        model_name="scripted/offline",
        skip_model_parsing=True,  # wmo_trio serves the model: no litellm lookup
        kwargs={"harness": str(harness),
                "provider_config": {"kind": "scripted", "model": "offline"}},
    )],
    environment=EnvironmentConfig(import_path="wmo_trio.harbor:LocalEnvironment"),
    tasks=[TaskConfig(path=Path(task)) for task in sys.argv[3:]],
)
trio.run(run_job, config)
"""


@pytest.mark.harbor
def test_trio_owned_job_gives_the_same_rewards_as_the_harbor_cli(
    tmp_path: Path, example_job: list[TrialRecord],
) -> None:
    script = tmp_path / "trio_owned_job.py"
    script.write_text(TRIO_OWNED_JOB)
    # The proof-of-work trial times out all the same with a shorter agent timeout, and
    # spends less of it searching on the CPU.
    tasks = [EXAMPLE_TASKS / name for name in EXPECTED_EXAMPLE_OUTCOMES if name != "proof-of-work"]
    tasks.append(make_task(tmp_path / "tasks", "proof-of-work", base="proof-of-work",
                           agent_timeout_sec=0.5))
    argv = [sys.executable, str(script), str(tmp_path / "jobs"), str(HARNESS), *map(str, tasks)]
    # An invalid WMO_TRIO_HOST makes the asyncio-owned host refuse to start, so these
    # rewards can only come from episodes run by the trio-asyncio host.
    job = HarborJob(argv, tmp_path / "jobs" / "trio-owned", harbor_env(WMO_TRIO_HOST="refuse"))
    trials = job.trials()

    assert outcomes(trials) == outcomes(example_job), [t.describe() for t in trials]
    assert {t.task: str(t.trace.stop_reason) for t in trials} == {
        t.task: str(t.trace.stop_reason) for t in example_job
    }


# =======================================================================================
# 3. Harbor's agent timeout, with a command sleeping past it
# =======================================================================================

# A duration no other process on this machine uses, this run's own: another suite on a
# shared machine runs this test with another, so the machine-wide check below sees only ours.
SLEEP = f"sleep 30.{secrets.randbelow(10**6):06d}"
TIMEOUT_S = 3.0
TIMEOUT_TRIALS = 32
SCRIPTED_USAGE = {"input_tokens": 1500, "output_tokens": 40, "cached_input_tokens": 1200, "calls": 1}

# The verifier runs inside the trial's environment: it passes only if the sleeping command
# (and what it would have done afterwards) is gone by the time harbor verifies.
LEFTOVER_CHECK = f"""
    #!/bin/sh
    mkdir -p /logs/verifier
    if pgrep -f '{SLEEP}' >/dev/null || [ -e /app/late.txt ]; then
        echo "the agent's command outlived its trial's agent phase:"
        ls -l /app/late.txt 2>&1
        ps -eo pid,ppid,pgid,sid,etimes,args 2>&1
        echo 0 > /logs/verifier/reward.txt
    else
        echo 1 > /logs/verifier/reward.txt
    fi
"""


@pytest.fixture(scope="module")
def timeout_job(tmp_path_factory: pytest.TempPathFactory) -> list[TrialRecord]:
    root = tmp_path_factory.mktemp("timeout")
    task = make_task(root / "tasks", "sleepy", agent_timeout_sec=TIMEOUT_S, test_sh=LEFTOVER_CHECK)
    provider = scripted(root / "script.json", [
        {"text": "first", "tool_calls": [call("bash", command="echo first")],
         "usage": SCRIPTED_USAGE},
        {"text": "now wait", "tool_calls": [
            call("bash", command=f"{SLEEP}; echo late > /app/late.txt")], "usage": SCRIPTED_USAGE},
    ])
    # Several trials at once: the cancellation races below are only visible in some runs.
    return harbor_job_here(root / "jobs", task, provider_config=provider, attempts=TIMEOUT_TRIALS,
                           concurrent=TIMEOUT_TRIALS)


@pytest.mark.harbor
def test_agent_timeout_is_recorded_by_harbor_and_the_verifier_still_runs(
    timeout_job: list[TrialRecord],
) -> None:
    assert len(timeout_job) == TIMEOUT_TRIALS
    for trial in timeout_job:
        assert trial.exception_type == "AgentTimeoutError", trial.describe()
        assert trial.result["verifier_result"] is not None, trial.describe()


@pytest.mark.harbor
def test_agent_timeout_kills_the_running_command_before_harbor_verifies(
    timeout_job: list[TrialRecord],
) -> None:
    for trial in timeout_job:
        assert trial.reward == 1.0, (
            f"{trial.describe()}\n{(trial.path / 'verifier' / 'test-stdout.txt').read_text()}"
        )
    assert subprocess.run(["pgrep", "-f", SLEEP], capture_output=True).returncode == 1


@pytest.mark.harbor
def test_agent_timeout_leaves_a_partial_trace_with_the_steps_so_far_and_usage(
    timeout_job: list[TrialRecord],
) -> None:
    for trial in timeout_job:
        trace = trial.trace
        assert isinstance(trace, PartialTrace), trial.describe()
        assert trace.partial is True
        assert trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
        assert trace.answer == ""
        first, second = tool_steps(trace)[:2]
        assert first.action.arguments == {"command": "echo first"}
        assert first.observation.content == "first\n" and not first.observation.is_error
        assert second.action.arguments == {"command": f"{SLEEP}; echo late > /app/late.txt"}
        assert second.observation.is_error
        assert trace.turns == len(tool_steps(trace))
        assert trace.worker_usage is not None
        assert trace.worker_usage.input_tokens >= 2 * SCRIPTED_USAGE["input_tokens"]
        trial.trajectory()  # still a valid ATIF trajectory
        assert_trace_names_its_trial(trial)


@pytest.mark.harbor
def test_agent_timeout_still_reports_usage_and_stop_reason_to_harbor(
    timeout_job: list[TrialRecord],
) -> None:
    for trial in timeout_job:
        agent_result, usage = trial.agent_result, trial.trace.worker_usage
        assert usage is not None
        assert agent_result["n_input_tokens"] == usage.input_tokens > 0
        assert agent_result["n_cache_tokens"] == usage.cached_input_tokens > 0
        assert agent_result["n_output_tokens"] == usage.output_tokens > 0
        assert agent_result["metadata"]["stop_reason"] == CANCELLED_BY_HARBOR_TIMEOUT
        assert agent_result["metadata"]["turns"] == trial.trace.turns


@pytest.mark.harbor
def test_an_interrupted_harbor_run_is_recorded_as_cancelled_by_harbor_not_as_a_timeout(
    tmp_path: Path,
) -> None:
    # issue 15.7: Ctrl-C during a trial gave "cancelled-by-harbor-timeout".
    recording = tmp_path / "calls.jsonl"
    provider = scripted(tmp_path / "script.json", [
        {"tool_calls": [call("bash", command="sleep 60")], "usage": SCRIPTED_USAGE},
        {"tool_calls": [call("submit", answer="never")], "usage": SCRIPTED_USAGE},
    ], record=str(recording))
    task = make_task(tmp_path / "tasks", "slow-one", agent_timeout_sec=600)
    job = harbor_run(tmp_path / "jobs", task, provider_config=provider).start()
    assert job._process is not None
    # The first model call is recorded when it returns: the episode is then in its command.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (recording.is_file() and recording.read_text().count("\n") >= 1):
        assert job._process.poll() is None, "harbor ended before the episode started"
        assert time.monotonic() < deadline, "the episode never made its first model call"
        time.sleep(0.05)
    job._process.send_signal(signal.SIGINT)
    try:
        job._process.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if job._process.poll() is None:
            os.killpg(job._process.pid, signal.SIGKILL)
    [trace_file] = (tmp_path / "jobs").glob("*/*/agent/wmo-run.json")
    trace = parse_trace(trace_file.read_bytes())
    assert isinstance(trace, PartialTrace)
    assert trace.stop_reason == CANCELLED_BY_HARBOR
    assert [step.action.arguments for step in tool_steps(trace)] == [{"command": "sleep 60"}]


@pytest.mark.harbor
def test_agent_timeout_returns_without_waiting_for_the_command(
    timeout_job: list[TrialRecord],
) -> None:
    # harbor stamps the agent phase's end after run() has returned from its cancellation
    # (about TIMEOUT_S + 0.1 s here). The command would sleep 30 s more, and a call that
    # ignored its cancellation would hold the worker for a 10 s grace period: either shows
    # far above this bound.
    for trial in timeout_job:
        started, finished = trial.phase_seconds("agent_execution")
        assert finished - started < TIMEOUT_S + 6.0, trial.describe()


@pytest.mark.harbor
def test_agent_timeout_makes_no_model_call_after_harbor_cancels(
    timeout_job: list[TrialRecord],
) -> None:
    # The script's two replies are both used before the timeout; a third model call could
    # only be made after harbor cancelled the episode (the scripted provider then fails
    # with "the script has 2 replies").
    late = [trial.describe() + f" calls={trial.trace.worker_usage and trial.trace.worker_usage.calls}"
            f" steps={[s.observation.content[:80] for s in trial.trace.steps]}"
            for trial in timeout_job
            if trial.trace.worker_usage is None or trial.trace.worker_usage.calls != 2
            or len(trial.trace.steps) != 2]
    assert not late, "model called after harbor's cancellation:\n" + "\n".join(late)


# =======================================================================================
# Observations of the environment tools (CONTRACT section 4), through harbor
# =======================================================================================

OBSERVED_CALLS: dict[str, dict[str, Any]] = {
    "not-a-string": {"name": "bash", "arguments": {"command": 5}},
    "missing": {"name": "write_file", "arguments": {"path": "/app/x"}},
    "unexpected": {"name": "read_file", "arguments": {"path": "/app/x", "mode": "r"}},
    "unknown-tool": {"name": "launch_rockets", "arguments": {"target": "moon"}},
    "exit-code": call("bash", command="printf err >&2; printf out; exit 3"),
    "long-output": call("bash", command="head -c 30000 /dev/zero | tr '\\0' a; echo TAIL; exit 4"),
    "missing-file": call("read_file", path="/app/no such file"),
    "command-timeout": call("bash", command="sleep 5.77; echo finished"),
}


@pytest.fixture(scope="module")
def observations_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One hello-file trial whose first reply makes every call above (the commands get
    `command_timeout_sec=1`), and which then solves the task."""
    root = tmp_path_factory.mktemp("observations")
    provider = scripted(root / "script.json", [
        {"tool_calls": list(OBSERVED_CALLS.values())},
        {"tool_calls": [call("write_file", path="/app/greeting.txt", content="Hello from wmo_trio\n")]},
        {"tool_calls": [call("submit", answer="done")]},
    ])
    [trial] = harbor_job_here(root / "jobs", EXAMPLE_TASKS / "hello-file", provider_config=provider,
                              agent_kwargs={"command_timeout_sec": 1})
    steps = tool_steps(trial.trace)[:len(OBSERVED_CALLS)]
    assert [s.action.name for s in steps] == [c["name"] for c in OBSERVED_CALLS.values()]
    observations = {name: step.observation
                    for name, step in zip(OBSERVED_CALLS, steps, strict=True)}
    return {"trial": trial, **observations}


@pytest.mark.harbor
def test_wrong_tool_arguments_give_an_invalid_arguments_observation(
    observations_job: dict[str, Any],
) -> None:
    for name, tool in [("not-a-string", "bash"), ("missing", "write_file"),
                       ("unexpected", "read_file")]:
        observation = observations_job[name]
        assert observation.is_error
        assert observation.content.startswith(f"invalid {tool} arguments: "), observation.content
    assert "command" in observations_job["not-a-string"].content
    assert "content" in observations_job["missing"].content
    assert "mode" in observations_job["unexpected"].content


@pytest.mark.harbor
def test_unknown_tool_gives_a_not_available_observation(observations_job: dict[str, Any]) -> None:
    observation = observations_job["unknown-tool"]
    assert observation.is_error
    assert observation.content == "tool 'launch_rockets' not available"


@pytest.mark.harbor
def test_failed_command_gives_stdout_then_stderr_and_its_exit_code(
    observations_job: dict[str, Any],
) -> None:
    observation = observations_job["exit-code"]
    assert observation.is_error
    assert observation.content == "outerr\n[exit 3]"
    assert observation.metadata["return_code"] == 3
    missing = observations_job["missing-file"]
    assert missing.is_error and missing.metadata["return_code"] != 0
    assert "no such file" in missing.content.lower()


@pytest.mark.harbor
def test_long_output_is_cut_in_the_middle_to_10000_characters_with_its_markers(
    observations_job: dict[str, Any],
) -> None:
    observation = observations_job["long-output"]
    content = observation.content
    assert len(content) <= 10_000
    assert content.startswith("aaaa")
    assert content.endswith("TAIL\n\n[exit 4]")
    cut = re.search(r"(\d+) characters cut", content)
    assert cut, content[4900:5200]
    # what was kept plus what was cut is the whole output, markers aside
    marker_start = content.index("\n[...")
    marker_end = content.index("...]\n") + len("...]\n")
    kept = len(content[:marker_start]) + len(content[marker_end:]) - len("\n[exit 4]")
    assert kept + int(cut.group(1)) == 30000 + len("TAIL\n")
    assert observation.metadata["return_code"] == 4


@pytest.mark.harbor
def test_command_past_its_timeout_is_an_error_observation_and_the_episode_goes_on(
    observations_job: dict[str, Any],
) -> None:
    observation = observations_job["command-timeout"]
    assert observation.is_error
    assert observation.content.startswith("environment command failed: "), observation.content
    assert "finished" not in observation.content
    trial = observations_job["trial"]
    assert (trial.reward, trial.exception_type) == (1.0, None), trial.describe()
    assert trial.trace.stop_reason == "submitted"


# =======================================================================================
# 4. Exceptions of the episode, and of its cleanup
# =======================================================================================

DEFECTS_PLUGIN = '''
"""Imported by harbor as the agent's module: the real agent, with one defect injected per
trial, chosen by the trial's provider kind, because a healthy episode turns every failure
into a stop reason or an observation and never raises."""

from wmo_trio.episode._execution import LocalExecution
from wmo_trio.harbor import WmoTrioHarborAgent, _agent
from wmo_trio.providers import register_provider
from wmo_trio.providers._scripted import ScriptedProvider

MARKER = "echo defect"


class EpisodeDefect(Exception):
    pass


class RuntimeBuildDefect(Exception):
    pass


class DefectiveRuntime(LocalExecution):
    """Its progress hook raises once the step running MARKER has been recorded."""

    def __init__(self, *args, on_progress=None, **kwargs):
        def progress(log):
            if on_progress is not None:
                on_progress(log)
            if any((s.action.arguments or {}).get("command") == MARKER for s in log.steps()):
                raise EpisodeDefect("injected defect after the marker step")

        super().__init__(*args, on_progress=progress, **kwargs)


class CloseFailingProvider(ScriptedProvider):
    def close(self):
        raise RuntimeError("injected failure to close the provider")


def build_execution_with_defects(doc, provider, *args, **kwargs):
    # The provider arrives wrapped (retries); its configuration names the kind.
    if provider.config.kind == "builddefect":
        raise RuntimeBuildDefect("injected failure to build the runtime")
    if provider.config.kind == "episodedefect":
        return DefectiveRuntime(doc, provider, *args, control=kwargs["control"],
                                on_progress=kwargs["on_progress"])
    return healthy_build_execution(doc, provider, *args, **kwargs)


# Scripted providers by other names: the kind says which defect a trial gets.
register_provider("episodedefect", "wmo_trio.providers._scripted:ScriptedProvider")
register_provider("builddefect", "wmo_trio.providers._scripted:ScriptedProvider")
register_provider("closefail", f"{__name__}:CloseFailingProvider")
healthy_build_execution = _agent.build_execution
_agent.build_execution = build_execution_with_defects

Agent = WmoTrioHarborAgent
'''

# One job of the plugin's agent under plain asyncio, as harbor's CLI runs a job (the CLI
# itself is tested above): one trial per provider configuration given, at once.
DEFECTS_JOB = """
import asyncio
import json
import sys
from pathlib import Path

from harbor.job import Job
from harbor.models.job.config import JobConfig
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

jobs_dir, harness, task = map(Path, sys.argv[1:4])
providers = json.loads(sys.argv[4])
config = JobConfig(
    job_name="defects",
    jobs_dir=jobs_dir,
    n_concurrent_trials=len(providers),
    quiet=True,
    agents=[AgentConfig(import_path="wmo_test_defects:Agent",
                        model_name=f"{provider['kind']}/{provider['model']}",
                        skip_model_parsing=True,
                        kwargs={"harness": str(harness), "provider_config": provider})
            for provider in providers],
    environment=EnvironmentConfig(import_path="wmo_trio.harbor:LocalEnvironment"),
    tasks=[TaskConfig(path=task)],
)


async def main() -> None:
    job = await Job.create(config)
    await job.run()


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def defect_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[TrialRecord]]:
    """One job of three hello-file trials, each with its defect: an episode that raises
    midway, a runtime that cannot be built, and a provider whose close() fails after a
    solved task; by defect, the trials that had it."""
    root = tmp_path_factory.mktemp("defects")
    plugins = root / "plugins"
    plugins.mkdir()
    (plugins / "wmo_test_defects.py").write_text(DEFECTS_PLUGIN)
    (root / "defects_job.py").write_text(DEFECTS_JOB)
    pythonpath = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    episode_script = scripted(root / "episode-script.json", [
        {"tool_calls": [call("bash", command="echo one")]},
        {"tool_calls": [call("bash", command="echo defect")]},
        {"tool_calls": [call("submit", answer="never reached")]},
    ])
    kinds = {"episodedefect": "episode", "builddefect": "build", "closefail": "close"}
    providers = [{**episode_script, "kind": "episodedefect"},
                 {**OFFLINE, "kind": "builddefect"}, {**OFFLINE, "kind": "closefail"}]
    argv = [sys.executable, str(root / "defects_job.py"), str(root / "jobs"), str(HARNESS),
            str(EXAMPLE_TASKS / "hello-file"), json.dumps(providers)]
    trials = HarborJob(argv, root / "jobs" / "defects", harbor_env(PYTHONPATH=pythonpath)).trials()
    by_defect: dict[str, list[TrialRecord]] = {name: [] for name in kinds.values()}
    for trial in trials:
        kind = str(trial.result["config"]["agent"]["model_name"]).split("/")[0]
        by_defect[kinds[kind]].append(trial)
    return by_defect


@pytest.mark.harbor
def test_episode_exception_reaches_harbor_as_its_own_type_with_a_partial_trace(
    defect_jobs: dict[str, list[TrialRecord]],
) -> None:
    [trial] = defect_jobs["episode"]
    assert trial.exception_type == "EpisodeDefect", trial.describe()
    trace = trial.trace
    assert isinstance(trace, PartialTrace)
    assert trace.stop_reason == "agent-exception:EpisodeDefect"
    assert trace.error == "EpisodeDefect: injected defect after the marker step"
    assert [s.action.arguments for s in trace.steps] == [{"command": "echo one"},
                                                          {"command": "echo defect"}]
    assert [s.observation.content for s in trace.steps] == ["one\n", "defect\n"]
    assert trace.turns == 2
    assert trace.worker_usage is not None and trace.worker_usage.calls == 2
    assert trial.agent_result["metadata"]["stop_reason"] == "agent-exception:EpisodeDefect"
    assert_trace_names_its_trial(trial)


@pytest.mark.harbor
def test_runtime_that_cannot_be_built_reaches_harbor_and_leaves_a_trace(
    defect_jobs: dict[str, list[TrialRecord]],
) -> None:
    [trial] = defect_jobs["build"]
    assert trial.exception_type == "RuntimeBuildDefect", trial.describe()
    trace = trial.trace
    assert isinstance(trace, PartialTrace)
    assert trace.stop_reason == "agent-exception:RuntimeBuildDefect"
    assert trace.error == "RuntimeBuildDefect: injected failure to build the runtime"
    assert trace.steps == [] and trace.turns == 0
    assert trial.agent_result["metadata"]["candidate_doc_hash"] == load_harness(HARNESS).doc_hash
    trial.trajectory()


@pytest.mark.harbor
def test_cleanup_failure_never_replaces_the_episode_outcome(
    defect_jobs: dict[str, list[TrialRecord]],
) -> None:
    [trial] = defect_jobs["close"]
    assert (trial.reward, trial.exception_type) == (1.0, None), trial.describe()
    assert isinstance(trial.trace, FinishedTrace)
    assert trial.trace.stop_reason == "submitted"
    assert trial.agent_result["metadata"]["stop_reason"] == "submitted"


# =======================================================================================
# 5. Constructor keyword arguments (CONTRACT section 5); no harbor run needed
# =======================================================================================


def make_agent(logs_dir: Path, **overrides: Any) -> WmoTrioHarborAgent:
    arguments: dict[str, Any] = {"model_name": "scripted/offline", "harness": str(HARNESS),
                                 "provider_config": dict(OFFLINE)}
    arguments.update(overrides)
    return WmoTrioHarborAgent(logs_dir=logs_dir, **arguments)


def refused(logs_dir: Path, argument: str, **overrides: Any) -> str:
    """Construct with `overrides`, expect a ValueError naming `argument`; return its text."""
    with pytest.raises(ValueError, match=rf"\b{re.escape(argument)}\b") as raised:
        make_agent(logs_dir, **overrides)
    return str(raised.value)


def test_agent_is_named_wmo_harness_and_has_a_version(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    assert WmoTrioHarborAgent.name() == "wmo-harness"
    assert isinstance(agent.version(), str) and agent.version()


def test_harness_is_required(tmp_path: Path) -> None:
    refused(tmp_path, "harness", harness=None)


@pytest.mark.parametrize("harness", [
    {},
    {"name": "no-prompt", "surfaces": [{"id": "param:max-turns", "kind": "param", "content": "3"}]},
    {"name": "bad-turns", "surfaces": [{"id": "prompt:core", "kind": "prompt", "content": "p"},
                                       {"id": "param:max-turns", "kind": "param", "content": "0"}]},
    "{not json",
    5,
    ["prompt:core"],
], ids=["empty", "no-prompt", "bad-param", "bad-json-text", "int", "list"])
def test_harness_must_be_a_valid_document(tmp_path: Path, harness: Any) -> None:
    refused(tmp_path, "harness", harness=harness)


def test_harness_may_be_a_path_to_a_json_file(tmp_path: Path) -> None:
    document = json.loads(HARNESS.read_text())
    copy = tmp_path / "candidate doc.json"
    copy.write_text(json.dumps(document))
    from_path = make_agent(tmp_path, harness=str(copy))
    from_object = make_agent(tmp_path, harness=document)
    assert from_path.doc.doc_hash == from_object.doc.doc_hash == load_harness(HARNESS).doc_hash


def test_harness_path_to_a_missing_file_fails_naming_harness(tmp_path: Path) -> None:
    message = refused(tmp_path, "harness", harness=str(tmp_path / "missing.json"))
    assert "missing.json" in message


def test_provider_config_is_required(tmp_path: Path) -> None:
    refused(tmp_path, "provider_config", provider_config=None)


@pytest.mark.parametrize("provider_config", [
    ["scripted", "offline"], "scripted/offline", 3,
    {"kind": "scripted"}, {"model": "offline"},
], ids=["list", "string", "int", "no-model", "no-kind"])
def test_provider_config_must_be_an_object_with_kind_and_model(
    tmp_path: Path, provider_config: Any,
) -> None:
    refused(tmp_path, "provider_config", provider_config=provider_config)


def test_provider_config_kind_must_be_known(tmp_path: Path) -> None:
    message = refused(tmp_path, "provider_config", model_name="telepathy/offline",
                      provider_config={"kind": "telepathy", "model": "offline"})
    assert "telepathy" in message


@pytest.mark.parametrize("model_name", ["scripted/other", "anthropic/offline", "offline", None])
def test_model_name_must_be_kind_slash_model(tmp_path: Path, model_name: str | None) -> None:
    refused(tmp_path, "model_name", model_name=model_name)


@pytest.mark.parametrize("backend", ["docker", "", "LOCAL", 1])
def test_harness_backend_must_be_local_e2b_or_sandbox(tmp_path: Path, backend: Any) -> None:
    refused(tmp_path, "harness_backend", harness_backend=backend)


def test_e2b_template_needs_the_e2b_backend(tmp_path: Path) -> None:
    refused(tmp_path, "e2b_template", e2b_template="my-template")
    refused(tmp_path, "e2b_template", harness_backend="local", e2b_template="my-template")


@pytest.mark.parametrize("value", [0, 241, -1, True, False, 1.5, 30.0, "30", None])
def test_command_timeout_sec_must_be_an_int_from_1_to_240(tmp_path: Path, value: Any) -> None:
    refused(tmp_path, "command_timeout_sec", command_timeout_sec=value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, 0.0, -1, True, "300", None])
def test_episode_timeout_sec_must_be_finite_and_positive(tmp_path: Path, value: Any) -> None:
    refused(tmp_path, "episode_timeout_sec", episode_timeout_sec=value)


@pytest.mark.parametrize("value", [True, False, 0, -1, 2.0, "8", None])
def test_episode_workers_must_be_a_positive_int(tmp_path: Path, value: Any) -> None:
    refused(tmp_path, "episode_workers", episode_workers=value)


@pytest.mark.parametrize("value", [1023, 0, -2048, True, 2048.0, "4096"])
def test_context_window_must_be_null_or_an_int_of_at_least_1024(tmp_path: Path, value: Any) -> None:
    refused(tmp_path, "context_window", context_window=value)


def test_extra_env_must_be_empty(tmp_path: Path) -> None:
    refused(tmp_path, "extra_env", extra_env={"OPENAI_API_KEY": "x"})
    make_agent(tmp_path, extra_env={})  # what harbor passes when none is configured


def test_boundary_values_are_accepted(tmp_path: Path) -> None:
    accepted: list[dict[str, Any]] = [
        {"command_timeout_sec": 1}, {"command_timeout_sec": 240},
        {"episode_timeout_sec": 0.001}, {"episode_timeout_sec": 7200},
        {"episode_workers": 1}, {"context_window": 1024}, {"context_window": None},
        {"harness_backend": "local"},
    ]
    for overrides in accepted:
        make_agent(tmp_path, **overrides)


def test_harbors_own_constructor_arguments_pass_through(tmp_path: Path) -> None:
    # Whatever this harbor release's BaseAgent names is harbor's, not the agent's, and
    # what harbor injects and drops itself (a setup timeout) passes too.
    from harbor.agents.base import BaseAgent

    harbor_arguments = [name for name in inspect.signature(BaseAgent.__init__).parameters
                        if name not in ("self", "logs_dir", "model_name", "kwargs")]
    assert {"logger", "mcp_servers", "skills_dir", "extra_env", "load_trajectory"} <= set(
        harbor_arguments)
    agent = make_agent(
        tmp_path,
        skip_model_parsing=True,
        load_trajectory=None,
        environment_logs_dir=PurePosixPath("/logs/agent"),
        override_setup_timeout_sec=30.0,
        extra_env={},
        mcp_servers=None,
        skills_dir=None,
    )
    assert agent.doc.doc_hash == load_harness(HARNESS).doc_hash


def test_an_unknown_argument_is_refused_naming_it_and_the_closest_known_one(tmp_path: Path) -> None:
    message = refused(tmp_path, "episode_timeout", episode_timeout=60)
    assert "did you mean episode_timeout_sec?" in message
    assert "\n" not in message


def test_a_provider_config_that_is_broken_json_says_so_and_where(tmp_path: Path) -> None:
    # harbor's --ak hands on a value that is not JSON as text; before: "got str".
    message = refused(tmp_path, "provider_config",
                      provider_config='{"kind": "scripted", "model": "offline"')
    assert "is not valid JSON: Expecting ',' delimiter at line 1 column 40" in message


def test_an_unknown_argument_is_never_offered_harbors_options_the_agent_refuses(
    tmp_path: Path,
) -> None:
    message = refused(tmp_path, "bas_url", bas_url="http://localhost:8000")
    # Before: "did you mean base_url?", which is then refused; and the docs name none of them.
    for hidden in ("base_url", "disable_web_search", "reasoning_effort"):
        assert hidden not in message
    assert "known: command_timeout_sec, context_window" in message


def test_the_agent_declares_the_documented_arguments_as_harbors_options_model() -> None:
    # harbor validates an agent's options_model at preflight and shows it as the agent's
    # schema (`harbor agents schema`); docs/agent.md's table lists the same arguments.
    page = (REPO / "docs" / "agent.md").read_text()
    table = page[page.index("| argument | meaning |"):]
    table = table[: table.index("\n\n")]
    listed = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE))
    harbors_own = {"base_url", "disable_web_search", "reasoning_effort"}  # AgentOptions'
    assert set(WmoTrioHarborAgent.options_schema()["properties"]) == listed | harbors_own


# =======================================================================================
# 6. 64 concurrent trials
# =======================================================================================

CONCURRENT_TRIALS = 64
LATENCY_S = 0.5
CALLS_PER_EPISODE = 3  # the offline policy's hello-file episode: write, read back, submit


@pytest.fixture(scope="module")
def concurrent_job(tmp_path_factory: pytest.TempPathFactory) -> list[TrialRecord]:
    jobs = tmp_path_factory.mktemp("concurrent")
    return harbor_job_here(jobs, EXAMPLE_TASKS / "hello-file",
                           provider_config={**OFFLINE, "latency_s": LATENCY_S},
                           attempts=CONCURRENT_TRIALS, concurrent=CONCURRENT_TRIALS)


@pytest.mark.harbor
def test_64_concurrent_trials_all_pass(concurrent_job: list[TrialRecord]) -> None:
    assert len(concurrent_job) == CONCURRENT_TRIALS
    failed = [t.describe() for t in concurrent_job if (t.reward, t.exception_type) != (1.0, None)]
    assert not failed, failed
    assert all(t.trace.worker_usage and t.trace.worker_usage.calls == CALLS_PER_EPISODE
               for t in concurrent_job)


@pytest.mark.harbor
def test_64_concurrent_episodes_do_not_wait_for_each_other(concurrent_job: list[TrialRecord]) -> None:
    # Counted, not timed: how many agent phases were under way at once. Each lasts at least
    # its three 0.5 s model calls; episodes that waited for one another (one at a time, or a
    # few at a time behind a small limiter) could never overlap this much.
    phases = [t.phase_seconds("agent_execution") for t in concurrent_job]
    events = sorted([(start, 1) for start, _ in phases] + [(end, -1) for _, end in phases])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    assert most >= 8, f"at most {most} of {CONCURRENT_TRIALS} episodes ran at once"


# =======================================================================================
# 7. write_file and read_file through harbor, byte for byte
# =======================================================================================


def awkward_text(size: int) -> str:
    """`size` characters of everything a shell or a transport might mangle."""
    pieces = [
        "\x00", "'single' ", '"double" ', "$(touch /app/pwned) ", "`touch /app/pwned` ",
        "${HOME} ", "\\ back\\slash \\n ", "%s %n %% ", "\n", "\r\n", "\t", "-dash ",
        "héllo ✓ 𝄞 ", "\x1b[31m", "*?[a] ", "EOF\n", "\n\n",
    ]
    out: list[str] = []
    length, index = 0, 0
    while length < size:
        piece = pieces[index % len(pieces)] + str(index)
        out.append(piece)
        length += len(piece)
        index += 1
    return "".join(out)[:size]


ROUND_TRIP_FILES: dict[str, str] = {
    # paths a shell would split, expand or take for options; contents it would mangle
    "/app/dir with spaces/it's \"quoted\" $(touch /app/pwned).txt":
        "\x00NUL first, quotes ' \" and $(touch /app/pwned) and `id`\nlines\n\n",
    "-leading-dash.txt": "a relative path starting with a dash\n",
    "--dashes/-nested/--file": "-n -e \\c\n",
    "/app/glob*?[a]\\back.txt": awkward_text(4000),
    "/app/trailing-newlines.txt": "kept\n\n\n",
    "/app/empty file": "",
    "/app/big $(touch /app/pwned) 'q'/-five megabytes.bin": awkward_text(5 * 1024 * 1024),
    "/app/overwritten.txt": "short",
}
OVERWRITTEN_FIRST = "a much longer content that the second write must replace entirely\n" * 50
READ_BACK = [path for path, content in ROUND_TRIP_FILES.items() if len(content) < 9000]


def round_trip_check() -> str:
    checks = "".join(
        f"check {shlex.quote(path)} {hashlib.sha256(content.encode()).hexdigest()}\n"
        for path, content in ROUND_TRIP_FILES.items()
    )
    return (
        "#!/bin/bash\n"
        "mkdir -p /logs/verifier\ncd /app\nok=1\n"
        'check() { got=$(sha256sum < "$1" | cut -d" " -f1); '
        'if [ "$got" != "$2" ]; then echo "MISMATCH $1" >&2; ok=0; fi; }\n'
        f"{checks}"
        '[ -e /app/pwned ] && { echo "a $(...) was run" >&2; ok=0; }\n'
        "echo $ok > /logs/verifier/reward.txt\n"
    )


@pytest.fixture(scope="module")
def round_trip_job(tmp_path_factory: pytest.TempPathFactory) -> list[TrialRecord]:
    root = tmp_path_factory.mktemp("round-trip")
    task = make_task(root / "tasks", "round-trip", test_sh=round_trip_check(),
                     instruction="Write the files exactly.\n")
    writes = [call("write_file", path="/app/overwritten.txt", content=OVERWRITTEN_FIRST)]
    writes += [call("write_file", path=path, content=content) for path, content in ROUND_TRIP_FILES.items()]
    provider = scripted(root / "script.json", [
        {"tool_calls": writes},
        {"tool_calls": [call("read_file", path=path) for path in READ_BACK]},
        {"tool_calls": [call("submit", answer="done")]},
    ])
    return harbor_job_here(root / "jobs", task, provider_config=provider)


@pytest.mark.harbor
def test_write_file_through_harbor_writes_every_byte_at_every_path(
    round_trip_job: list[TrialRecord],
) -> None:
    [trial] = round_trip_job
    # the verifier compared each file's sha256 with the content's, and found no $(...) run
    assert (trial.reward, trial.exception_type) == (1.0, None), (
        trial.describe() + (trial.path / "verifier" / "test-stdout.txt").read_text(errors="replace")
    )
    writes = [s for s in tool_steps(trial.trace) if s.action.name == "write_file"]
    assert len(writes) == len(ROUND_TRIP_FILES) + 1
    for step in writes:
        path, content = step.action.arguments["path"], step.action.arguments["content"]
        assert step.observation.content == f"wrote {path}"
        assert not step.observation.is_error
        assert step.observation.metadata["bytes"] == len(content.encode())


@pytest.mark.harbor
def test_read_file_through_harbor_returns_the_content_at_awkward_paths(
    round_trip_job: list[TrialRecord],
) -> None:
    [trial] = round_trip_job
    reads = [s for s in tool_steps(trial.trace) if s.action.name == "read_file"]
    assert [s.action.arguments["path"] for s in reads] == READ_BACK
    for step in reads:
        expected = ROUND_TRIP_FILES[step.action.arguments["path"]]
        assert not step.observation.is_error, step.observation.content
        assert step.observation.content == expected
