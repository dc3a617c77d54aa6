"""Nothing a trial or a build leaves on the host breaks a later trial or job.

Trees thousands of levels deep (Python's `shutil.rmtree` recurses once per level) left in
a trial's root, in a failed build and in the agent's logs, by one harbor job in a process
of its own; then harbor's `jobs resume` of that job, which removes the trial it finds
unfinished and runs it again on the same state and cache directories. And a leftover
that cannot be removed at all.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harbor_jobs import run_job_here
from test_local_environment import (
    TASKS,
    make_environment,
    pytestmark,
    reward,
    run,
    run_harbor,
    running,
    trial_results,
)

from wmo_trio.sandbox import wait_for_removals
from wmo_trio.sandbox._hostfs import QUARANTINE

__all__ = ["pytestmark"]

# Makes a tree `levels` deep in the working directory, one relative step at a time (a
# path that long is no path at all: PATH_MAX is 4096 bytes). One line: a RUN step too.
DEEP = ("python3 -c \"import os; [os.mkdir('d') or os.chdir('d') for _ in range({levels})]; "
        "open('bottom', 'w').close()\"")


def _task(tasks: Path, name: str, *, solve: str = "", build: str = "") -> Path:
    """hello-file, its solution doing ``solve`` first, its image ``build`` last."""
    task = tasks / name
    shutil.copytree(TASKS / "hello-file", task)
    solution = task / "solution" / "solve.sh"
    solution.write_text(f"#!/bin/sh\n{solve}\n" + solution.read_text().partition("\n")[2])
    if build:
        dockerfile = task / "environment" / "Dockerfile"
        dockerfile.write_text(dockerfile.read_text() + build)
    return task


def max_depth(top: Path) -> int:
    """How many directories deep the tree below ``top`` goes (without recursing)."""
    deepest, pending = 0, [(top, 0)]
    while pending:
        directory, depth = pending.pop()
        deepest = max(deepest, depth)
        pending += [(child, depth + 1) for child in directory.iterdir()
                    if child.is_dir() and not child.is_symlink()]
    return deepest


@pytest.fixture(scope="module")
def deep_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `harbor run` (a process of its own, whose exit releases whatever it held)
    over three tasks on one state and cache directory: a solution that leaves 3,000
    levels under /root, a build whose failing RUN step leaves as many, and a solution
    that leaves 1,024 levels in /logs/agent, which harbor copies out. Then the third
    trial is made unfinished (no result.json, as a job stopped midway leaves it) and
    `harbor jobs resume` runs it again, in this process."""
    root = tmp_path_factory.mktemp("deep-job")
    tasks, state, cache = root / "tasks", root / "state", root / "cache"
    _task(tasks, "deep-root", solve=f"cd /root && {DEEP.format(levels=3000)}")
    _task(tasks, "deep-build",
          build=f"RUN cd /tmp && {DEEP.format(levels=3000)} && echo built deep && exit 3\n")
    _task(tasks, "deep-logs", solve=f"cd /logs/agent && {DEEP.format(levels=1024)}")
    completed = run_harbor(root / "jobs", "-p", str(tasks), "-a", "oracle", "-n", "3",
                           "--ek", f"state_dir={state}", "--ek", f"cache_dir={cache}")
    first = trial_results(root / "jobs")
    left = {"state": sorted(path.name for path in state.iterdir()),
            "builds": sorted(path.name for path in (cache / "builds").iterdir())}
    [logs_trial] = [root / "jobs" / "job" / name for name, result in first.items()
                    if result["task_name"] == "deep-logs"]
    copied_depth = max_depth(logs_trial / "agent")
    trial_log = (logs_trial / "trial.log").read_text()
    (logs_trial / "result.json").unlink()

    from harbor.models.job.config import JobConfig

    # What `harbor jobs resume -p <job>` runs: the job's own config, in its directory.
    config = JobConfig.model_validate_json((root / "jobs" / "job" / "config.json").read_text())
    config.jobs_dir, config.job_name = root / "jobs", "job"
    resumed: BaseException | None = None
    try:
        run_job_here(config)
    except Exception as error:  # shown by the test that needs the resume
        resumed = error
    return {"completed": completed, "first": first, "left": left, "resumed": resumed,
            "second": trial_results(root / "jobs"), "copied_depth": copied_depth,
            "trial_log": trial_log, "logs_trial": logs_trial.name}


def _by_task(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {result["task_name"]: result for result in results.values()}


@pytest.mark.harbor
def test_deep_trees_a_trial_and_a_build_leave_are_removed_without_recursion(
        deep_job: dict[str, Any]) -> None:
    assert deep_job["completed"].returncode == 0, deep_job["completed"].stderr[-3000:]
    first = _by_task(deep_job["first"])
    assert reward(first["deep-root"]) == 1.0, first["deep-root"]["exception_info"]
    failure = first["deep-build"]["exception_info"]
    assert "failed with exit code 3" in failure["exception_message"], failure
    assert "built deep" in failure["exception_message"], failure
    assert deep_job["left"] == {"state": [], "builds": []}


@pytest.mark.harbor
def test_a_copy_out_stops_at_256_levels_and_says_so_in_the_trials_log(
        deep_job: dict[str, Any]) -> None:
    assert reward(_by_task(deep_job["first"])["deep-logs"]) == 1.0
    assert deep_job["copied_depth"] == 256
    assert "more than 256 directories deep" in deep_job["trial_log"]


@pytest.mark.harbor
def test_harbor_resumes_the_job_on_the_same_state_and_cache_directories(
        deep_job: dict[str, Any]) -> None:
    assert deep_job["resumed"] is None, repr(deep_job["resumed"])
    second = deep_job["second"]
    assert deep_job["logs_trial"] not in second  # removed by harbor, run again
    assert sorted(result["task_name"] for result in second.values()) == [
        "deep-build", "deep-logs", "deep-root"]
    rerun = _by_task(second)["deep-logs"]
    assert rerun["exception_info"] is None, rerun["exception_info"]
    assert reward(rerun) == 1.0



def test_a_leftover_that_will_not_go_is_set_aside_once_and_later_starts_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A dead trial's directory holding a file nothing may remove (immutable, as root
    can make one): the next start sets the directory aside, says so once, and runs; so
    does every later one, without a word."""
    state = tmp_path / "state"
    stale = state / "dead-trial.0123456789"
    stuck = stale / "upper" / "_root" / "stuck"
    stuck.parent.mkdir(parents=True)
    stuck.write_text("immutable")
    (state / f"{stale.name}.lock").touch()  # its owners are gone: nobody holds it
    made = subprocess.run(["chattr", "+i", str(stuck)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"this filesystem keeps no immutable flag: {made.stderr.strip()}")

    async def two_trials() -> None:
        for _ in range(2):
            async with running(make_environment(tmp_path)) as environment:
                assert (await environment.exec("echo alive")).stdout == "alive\n"

    try:
        with caplog.at_level(logging.WARNING):
            run(two_trials)
        wait_for_removals()
        [aside] = (state / QUARANTINE).iterdir()
    finally:
        for path in [stuck, *(state / QUARANTINE).glob("*/upper/_root/stuck")]:
            subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)
    said = [record.getMessage() for record in caplog.records if "set it aside" in record.getMessage()]
    assert len(said) == 1, said
    assert str(stale) in said[0] and str(aside) in said[0]
    assert (aside / "upper" / "_root" / "stuck").read_text() == "immutable"
    assert sorted(path.name for path in state.iterdir()) == [QUARANTINE]
