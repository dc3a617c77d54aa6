"""Harbor jobs of the wmo_trio agent, run as the README writes them, and what they leave:
the trial records, tasks made for a test, the environment harbor is given."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
from harbor.models.trajectories import Trajectory
from harbor_jobs import JOB_TIMEOUT_S

from wmo_trio.trace import (
    Trace,
    parse_trace,
)

REPO = Path(__file__).resolve().parents[2]


HARNESS = REPO / "examples" / "harness.json"


EXAMPLE_TASKS = REPO / "examples" / "tasks"


AGENT = "wmo_trio.harbor:WmoTrioHarborAgent"


LOCAL_ENVIRONMENT = "wmo_trio.harbor:LocalEnvironment"


OFFLINE = {"kind": "scripted", "model": "offline"}


# harbor's flag for "wmo_trio serves this model, do not look it up in litellm" (README).
SKIP_MODEL_LOOKUP = "--skip-model-parsing-and-provider-mapping"


def harbor_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "WMO_TRIO_HOST"}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", **extra)
    return env


def harbor_executable() -> str:
    found = shutil.which("harbor", path=str(Path(sys.executable).parent)) or shutil.which("harbor")
    assert found, "the harbor command line is not installed next to this python"
    return found


@dataclass
class TrialRecord:
    """What harbor and the agent left in one trial directory."""

    path: Path

    @cached_property
    def result(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.path / "result.json").read_text())
        return data

    @property
    def task(self) -> str:
        return str(self.result["task_name"])

    @property
    def reward(self) -> float | None:
        verifier = self.result.get("verifier_result")
        return None if verifier is None else verifier["rewards"]["reward"]

    @property
    def exception_type(self) -> str | None:
        info = self.result.get("exception_info")
        return None if info is None else str(info["exception_type"])

    @property
    def agent_result(self) -> dict[str, Any]:
        agent_result: dict[str, Any] = self.result["agent_result"]
        return agent_result

    @cached_property
    def trace(self) -> Trace:
        return parse_trace((self.path / "agent" / "wmo-run.json").read_bytes())

    def trajectory(self) -> Trajectory:
        return Trajectory.model_validate_json((self.path / "agent" / "trajectory.json").read_bytes())

    def phase_seconds(self, phase: str) -> tuple[float, float]:
        timing = self.result[phase]
        return _timestamp(timing["started_at"]), _timestamp(timing["finished_at"])

    def describe(self) -> str:
        info = self.result.get("exception_info") or {}
        return (f"{self.path.name}: reward={self.reward} exception={self.exception_type} "
                f"{str(info.get('exception_message', ''))[:300]}")


def _timestamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


_WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "os.execv(sys.argv[1], sys.argv[1:])")


class HarborJob:
    """One harbor job run in a subprocess of its own session (so a hung job is killed with
    every process it started). `start()` returns at once; `trials()` waits for the end."""

    def __init__(self, argv: list[str], job_dir: Path, env: Mapping[str, str]) -> None:
        self.argv = argv
        self.job_dir = job_dir
        self.env = dict(env)
        self._process: subprocess.Popen[str] | None = None
        self._trials: list[TrialRecord] | None = None

    def start(self) -> HarborJob:
        # As from a terminal, SIGINT is not ignored: a shell that starts a command in the
        # background (`make test &`, some CI runners) hands it down ignored, and harbor would
        # then never see a Ctrl-C.
        argv = [sys.executable, "-c", _WITH_DEFAULT_SIGINT, *self.argv]
        self._process = subprocess.Popen(
            argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        return self

    def trials(self) -> list[TrialRecord]:
        if self._trials is not None:
            return self._trials
        if self._process is None:
            self.start()
        assert self._process is not None
        try:
            output, _ = self._process.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            output, _ = self._process.communicate()
            pytest.fail(f"harbor job {self.job_dir} did not finish in {JOB_TIMEOUT_S} s:\n"
                        f"{output[-4000:]}")
        assert self._process.returncode == 0, (
            f"harbor exited with {self._process.returncode}:\n{output[-4000:]}"
        )
        self._trials = trial_records(self.job_dir, output)
        return self._trials


def trial_records(job_dir: Path, output: str = "") -> list[TrialRecord]:
    trials = [TrialRecord(p.parent) for p in sorted(job_dir.glob("*/result.json"))]
    assert trials, f"harbor wrote no trial results under {job_dir}:\n{output[-4000:]}"
    return trials


def harbor_run(
    jobs_dir: Path,
    tasks: Path,
    *,
    provider_config: Mapping[str, Any] = OFFLINE,
    agent: str = AGENT,
    agent_kwargs: Mapping[str, Any] | None = None,
    attempts: int = 1,
    concurrent: int = 4,
    env: Mapping[str, str] | None = None,
    job_name: str = "job",
    litellm_lookup: bool = False,
) -> HarborJob:
    """`harbor run` of this agent on `tasks` (a task, or a directory of tasks), as the README
    writes it: with `--skip-model-parsing-and-provider-mapping`, unless `litellm_lookup`
    (harbor's preflight then imports litellm to look the model up: seconds of CPU a run)."""
    model = f"{provider_config['kind']}/{provider_config['model']}"
    kwargs = {"harness": str(HARNESS), "provider_config": dict(provider_config),
              **(agent_kwargs or {})}
    argv = [harbor_executable(), "run", "-p", str(tasks), "-a", agent, "-m", model,
            "-e", LOCAL_ENVIRONMENT, "-o", str(jobs_dir), "--job-name", job_name,
            "-k", str(attempts), "-n", str(concurrent), "-y", "-q"]
    if not litellm_lookup:
        argv.append(SKIP_MODEL_LOOKUP)
    for key, value in kwargs.items():
        argv += ["--ak", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return HarborJob(argv, jobs_dir / job_name, harbor_env(**(env or {})))


def make_task(root: Path, name: str, *, base: str = "hello-file", agent_timeout_sec: float | None = None,
              instruction: str | None = None, test_sh: str | None = None) -> Path:
    """A copy of an example task under `root`, with the given changes."""
    task = root / name
    shutil.copytree(EXAMPLE_TASKS / base, task)
    if agent_timeout_sec is not None:
        toml = (task / "task.toml").read_text()
        changed, count = re.subn(r"(\[agent\]\ntimeout_sec = )[0-9.]+", rf"\g<1>{agent_timeout_sec}", toml)
        assert count == 1, "the example task.toml no longer has an [agent] timeout_sec line"
        (task / "task.toml").write_text(changed)
    if instruction is not None:
        (task / "instruction.md").write_text(instruction)
    if test_sh is not None:
        (task / "tests" / "test.sh").write_text(textwrap.dedent(test_sh).lstrip())
    return task

