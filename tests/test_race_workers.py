"""`wmo-trio race --workers` / `--ray-address`: a race's rounds on Ray worker processes
(one `TrialFleet` for the whole race), judged against the same race in one process.

One pair of races serves the module: the same candidates on the same generated tasks
(copies of the bundled hello-file), once in this process and once with `--workers 2` on
an embedded Ray. The candidates' programs pass a task by a hash of its instruction, so
both races must reach the same report, trial for trial; each program also notes the
process it ran in, which tells where the trials ran. Ctrl-C runs a race of its own in a
subprocess. The refusals run nothing.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from processes import command_lines_of, descendants, wait_until_gone
from support.race import (
    assert_reads_as_the_race_so_far,
    candidate,
    interrupted_race,
    make_tasks,
    race_args,
    research_tasks,
)
from typer.testing import CliRunner

from wmo_trio.cli import app
from wmo_trio.cli._run import running_on
from wmo_trio.compare import load_jobs
from wmo_trio.harness import load_harness
from wmo_trio.race import RaceReport, race
from wmo_trio.race._harbor import RaceProgress, read_race

TASKS = 10
BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "tasks"
TIMEOUT_S = 240  # a hang, not a slow machine


@dataclass
class Raced:
    job: Path
    report: RaceReport
    pids: list[str]  # the process of each episode, as its program noted it
    started: set[int]  # this process's children started by the race
    placed: dict[str, set[str]]  # each trial's workers, as the live display was told them


@pytest.fixture(scope="module")
def races(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Raced]:
    root = tmp_path_factory.mktemp("race-workers")
    tasks = make_tasks(root / "tasks", TASKS)
    pids = root / "pids"
    docs = [candidate(root, name, rate, pids=pids)
            for name, rate in (("good", 1.0), ("half", 0.5), ("poor", 0.0))]
    raced: dict[str, Raced] = {}
    placed: dict[str, set[str]] = collections.defaultdict(set)
    shown = RaceProgress.placed

    def noted(progress: RaceProgress, trial: str, worker: str) -> None:
        placed[trial].add(worker)
        shown(progress, trial, worker)

    RaceProgress.placed = noted  # type: ignore[method-assign]
    try:
        for name, where in (("alone", []), ("workers", ["--workers", "2"])):
            pids.unlink(missing_ok=True)
            placed.clear()
            before = set(descendants(os.getpid()))
            result = CliRunner().invoke(app, [*race_args(root / "jobs", tasks, *docs, name=name),
                                              "--alpha", "0.3", "--seed", "2", "--json", *where])
            assert result.exit_code == 0, result.output
            raced[name] = Raced(root / "jobs" / name,
                                RaceReport.model_validate_json(result.stdout),
                                pids.read_text().split(),
                                set(descendants(os.getpid())) - before, dict(placed))
    finally:
        RaceProgress.placed = shown  # type: ignore[method-assign]
    return raced


def rewards(job: Path) -> collections.Counter[tuple[str, str, Any]]:
    """(candidate, task, reward) of every trial of a race's directory, counted."""
    found: collections.Counter[tuple[str, str, Any]] = collections.Counter()
    for result_file in job.glob("*/result.json"):
        result = json.loads(result_file.read_text())
        reward = ((result.get("verifier_result") or {}).get("rewards") or {}).get("reward")
        found[(result["config"]["agent"]["kwargs"]["doc_hash"], result["task_name"], reward)] += 1
    return found


@pytest.mark.harbor
def test_a_race_on_two_workers_reaches_the_same_verdicts_on_the_same_trials(
        races: dict[str, Raced]) -> None:
    alone, workers = races["alone"].report, races["workers"].report
    # Not a race where nothing happens: one candidate dropped, trials saved.
    assert "dropped" in {c.status for c in alone.candidates}
    assert alone.finished and alone.trials < alone.full_trials
    # Every verdict, count, mean, interval and the task order: the same report.
    assert workers == alone
    assert rewards(races["workers"].job) == rewards(races["alone"].job)
    assert sum(rewards(races["workers"].job).values()) == workers.trials


@pytest.mark.harbor
def test_a_race_on_workers_runs_its_trials_in_the_worker_processes(
        races: dict[str, Raced]) -> None:
    assert set(races["alone"].pids) == {str(os.getpid())}
    ran = collections.Counter(races["workers"].pids)
    assert str(os.getpid()) not in ran
    # Each round's first two trials take the two workers' first places.
    assert len(ran) == 2 and sum(ran.values()) == races["workers"].report.trials


@pytest.mark.harbor
def test_the_live_display_is_told_which_worker_runs_each_trial(races: dict[str, Raced]) -> None:
    assert races["alone"].placed == {}
    workers = races["workers"]
    trials = {path.parent.name for path in workers.job.glob("*/result.json")}
    assert set(workers.placed) == trials and len(trials) == workers.report.trials
    # each trial on one worker (none was run again), and both workers used
    assert all(len(labels) == 1 for labels in workers.placed.values())
    assert len(set().union(*workers.placed.values())) == 2


def test_the_display_counts_the_running_trials_of_each_worker() -> None:
    assert running_on(["a", "b", "c", "d"], {"a": "w2", "b": "w1", "c": "w2"}) == (
        "; running on w1: 1, w2: 2")
    assert running_on(["a"], {}) == ""


@pytest.mark.harbor
def test_a_race_on_workers_writes_a_job_directory_of_the_same_form(
        races: dict[str, Raced]) -> None:
    alone, workers = races["alone"].job, races["workers"].job

    def files(job: Path) -> tuple[set[str], collections.Counter[tuple[str, ...]]]:
        tops = {path.name for path in job.iterdir() if path.is_file()}
        trials = collections.Counter(
            tuple(sorted(str(f.relative_to(trial)) for f in trial.rglob("*") if f.is_file()))
            for trial in job.iterdir() if trial.is_dir())
        return tops, trials

    assert files(workers) == files(alone)
    assert {"config.json", "lock.json", "result.json", "race.json"} <= files(workers)[0]
    config = json.loads((workers / "config.json").read_text())
    expected = json.loads((alone / "config.json").read_text())
    assert {**config, "job_name": None} == {**expected, "job_name": None}
    result = json.loads((workers / "result.json").read_text())
    # harbor's stats, but for the trial names (random) they list
    evals = json.loads((alone / "result.json").read_text())["stats"]["evals"]
    assert result["stats"]["evals"].keys() == evals.keys()
    for name, stats in result["stats"]["evals"].items():
        for figure in ("n_trials", "n_errors", "metrics", "pass_at_k"):
            assert stats[figure] == evals[name][figure], figure
    assert result["n_total_trials"] == races["workers"].report.trials == len(load_jobs([workers]))
    assert read_race(workers) == races["workers"].report
    for result_file in workers.glob("*/result.json"):  # the driver's paths, not a worker's
        trial = json.loads(result_file.read_text())
        assert trial["trial_uri"] == result_file.parent.resolve().as_uri()
        assert Path(trial["config"]["trials_dir"]) == workers


@pytest.mark.harbor
def test_a_race_on_workers_leaves_no_ray_process(races: dict[str, Raced]) -> None:
    started = races["workers"].started | races["alone"].started
    assert wait_until_gone(started, 30) == set(), command_lines_of(started)


@pytest.mark.harbor
def test_ctrl_c_stops_a_race_on_workers_as_in_one_process(tmp_path: Path) -> None:
    started: set[int] = set()
    scratch: set[Path] = set()

    def note_its_processes(process: subprocess.Popen[str]) -> None:
        started.update(descendants(process.pid))
        # the command's own Ray session directory, as its processes name it
        scratch.update(Path("/tmp") / match for line in command_lines_of(started).values()
                       for match in re.findall(r"/tmp/(wmo-ray-[^/ ]+)/", line))

    code, stdout, stderr = interrupted_race(tmp_path, "--workers", "2", "--json",
                                            before_signal=note_its_processes)
    assert code == 130, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "reads as the race so far" in lines[0], stderr[-3000:]
    assert stdout == ""
    assert wait_until_gone(started, 30) == set(), command_lines_of(started)
    assert len(scratch) == 1 and not any(path.exists() for path in scratch)
    assert_reads_as_the_race_so_far(tmp_path / "jobs" / "race")


@pytest.mark.parametrize(("value", "shown"), [("0", "0"), ("-2", "'-2'"), ("two", "'two'"),
                                              ("1.5", "'1.5'")])
def test_a_bad_workers_value_is_refused_before_anything_runs(tmp_path: Path, value: str,
                                                             shown: str) -> None:
    docs = [candidate(tmp_path, "a", 1.0), candidate(tmp_path, "b", 0.0)]
    result = CliRunner().invoke(app, [*race_args(tmp_path / "jobs", tmp_path, *docs),
                                      f"--workers={value}"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"wmo-trio: workers must be a positive number or 'auto', got {shown}"]
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("command", ["run", "race"])
def test_workers_without_ray_installed_say_how_to_install_it(
        tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is absent
    docs = [candidate(tmp_path, "a", 1.0), candidate(tmp_path, "b", 0.0)]
    args = (race_args(tmp_path / "jobs", tmp_path, *docs) if command == "race"
            else ["run", "-o", str(tmp_path / "jobs"), "-e", "wmo_trio.harbor:LocalEnvironment"])
    result = CliRunner().invoke(app, [*args, "--workers", "2"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "wmo-trio: running on several worker processes needs Ray, which is not installed "
        "here: pip install 'wmo_trio[ray]'"]
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "race"])
def test_a_ray_cluster_that_does_not_answer_is_one_line_before_any_trial(
        tmp_path: Path, command: str) -> None:
    docs = [candidate(tmp_path, "a", 1.0), candidate(tmp_path, "b", 0.0)]
    args = (race_args(tmp_path / "jobs", BUNDLED, *docs) if command == "race"
            else ["run", "-o", str(tmp_path / "jobs"), "-e", "wmo_trio.harbor:LocalEnvironment"])
    # Port 1 on the loopback: nothing listens there (connection refused).
    result = CliRunner().invoke(app, [*args, "--ray-address", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("wmo-trio: the Ray cluster at 127.0.0.1:1 cannot be reached")
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
async def test_the_research_race_on_two_workers_reaches_the_same_report(tmp_path: Path) -> None:
    """`race(..., workers=2)`: its episodes on an embedded Ray's worker processes, each
    scored here in the directory it wrote (a `DirectoryEnvironment` on this machine)."""
    pids = tmp_path / "pids"
    docs = [load_harness(candidate(tmp_path, name, rate, answer="answer.txt", pids=pids))
            for name, rate in (("good", 1.0), ("poor", 0.0), ("also-poor", 0.0))]
    provider = {"kind": "scripted", "model": "offline"}
    alone = await race(docs, research_tasks(tmp_path / "alone", 12), provider=provider,
                       alpha=0.3, limit=6, backend="local")
    assert set(pids.read_text().split()) == {str(os.getpid())}
    pids.unlink()
    with trio.fail_after(TIMEOUT_S):
        on_workers = await race(docs, research_tasks(tmp_path / "workers", 12),
                                provider=provider, alpha=0.3, limit=6, backend="local",
                                workers=2)
    assert [c.status for c in alone.candidates] == ["survived", "dropped", "dropped"]
    assert on_workers == alone
    ran = collections.Counter(pids.read_text().split())
    assert len(ran) == 2 and str(os.getpid()) not in ran and sum(ran.values()) == alone.trials
    # Every episode the race counted wrote its answer where the score read it.
    assert len(list((tmp_path / "workers").glob("*/*/answer.txt"))) == sum(
        round(c.mean_reward * c.tasks) for c in on_workers.candidates if c.mean_reward)
