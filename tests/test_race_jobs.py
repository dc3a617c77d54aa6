"""`wmo-trio race` on real harbor jobs (issue 37): generated tasks in the docker-free
environment, candidates whose agent code (`code:runtime`, run in-process with
`--backend local`) passes each task at a set rate, chosen per task by a hash of its
instruction. One race, shared by the module, holds the edge cases that need trials: a
candidate whose program fails as it loads, a task whose build fails for everyone. A
second, run by the function the command runs, holds a candidate whose trials all fail
before its agent runs and a document file edited in the middle of the race. The refusals
run nothing; Ctrl-C runs a race of its own in a subprocess.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import trio
from support.race import (
    ENV,
    assert_reads_as_the_race_so_far,
    candidate,
    interrupted_race,
    make_tasks,
    race_args,
)
from support.readme import blocks, make_clone, run_as_written
from typer.testing import CliRunner

from wmo_trio.cli import app
from wmo_trio.cli._race import build_race
from wmo_trio.cli._run import RunOptions
from wmo_trio.compare import compare_jobs, load_jobs
from wmo_trio.harness import load_harness
from wmo_trio.race import RaceReport
from wmo_trio.race._harbor import read_race, run_race

ROOT = Path(__file__).resolve().parent.parent
TASKS = 10
# docs/race.md's example: it runs here as written, from a clone's layout.
[EXAMPLE] = [b for b in blocks(ROOT / "docs" / "race.md")
             if b.lang == "sh" and "wmo-trio race" in b.body]


@pytest.fixture(scope="module")
def raced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RaceReport, dict[str, str]]:
    root = tmp_path_factory.mktemp("race")
    tasks = make_tasks(root / "tasks", TASKS, broken_build=True)
    docs = {"good": candidate(root, "good", 1.0), "poor": candidate(root, "poor", 0.0),
            "broken": candidate(root, "broken", 1.0, broken=True)}
    result = CliRunner().invoke(app, [*race_args(root / "jobs", tasks, *docs.values()),
                                      "--alpha", "0.3", "--seed", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = RaceReport.model_validate_json(result.stdout)
    hashes = {name: load_harness(path).doc_hash for name, path in docs.items()}
    return root / "jobs" / "race", report, hashes


@pytest.mark.harbor
def test_a_race_drops_the_worse_candidates_and_saves_trials(
    raced: tuple[Path, RaceReport, dict[str, str]],
) -> None:
    job, report, hashes = raced
    status = {c.key: c for c in report.candidates}
    assert status[hashes["good"]].status == "survived"
    assert status[hashes["poor"]].status == "dropped"
    assert status[hashes["poor"]].behind == hashes["good"]
    assert report.stop_reason == "one candidate left" and report.finished
    # The default control, per candidate: the drops came after the gate opened.
    assert report.settings.familywise is False and report.gate_open is True
    assert report.global_evidence >= 1 / report.settings.alpha
    assert report.trials < report.full_trials == 3 * (TASKS + 1)
    assert report.trials_saved == report.full_trials - report.trials
    assert status[hashes["good"]].mean_reward == 1.0
    assert status[hashes["poor"]].mean_reward == 0.0
    # Every trial the race counted is an ordinary harbor trial of the job directory.
    assert len(load_jobs([job])) == report.trials
    assert read_race(job) == report


@pytest.mark.harbor
def test_a_candidate_whose_program_fails_before_it_acts_is_counted_zero_and_dropped(
    raced: tuple[Path, RaceReport, dict[str, str]],
) -> None:
    job, report, hashes = raced
    broken = next(c for c in report.candidates if c.key == hashes["broken"])
    assert broken.status == "dropped" and broken.mean_reward == 0.0 and broken.trials > 0
    # Its program raised as it loaded: each episode ended in error, and the verifier
    # scored what it left (nothing): 0, as the race counts it.
    results = [json.loads(f.read_text()) for f in job.glob("*/result.json")]
    stops = {r["agent_result"]["metadata"]["stop_reason"] for r in results
             if r["config"]["agent"]["kwargs"]["doc_hash"] == hashes["broken"]
             and r["task_name"] != "unbuildable"}
    assert stops == {"error"}


@pytest.mark.harbor
def test_a_task_whose_build_fails_for_everyone_is_left_out_and_said(
    raced: tuple[Path, RaceReport, dict[str, str]],
) -> None:
    _, report, _ = raced
    # The seed puts it second in the order, before the race can end.
    assert [t.task for t in report.left_out] == ["unbuildable"]
    assert "no trial of it has a reward" in report.left_out[0].reason
    assert "unbuildable" not in report.task_order and len(report.task_order) >= 2


@pytest.mark.harbor
def test_compare_reads_a_race_as_any_job(
    raced: tuple[Path, RaceReport, dict[str, str]],
) -> None:
    job, report, hashes = raced
    compared = compare_jobs([job])
    good = next(c for c in compared.candidates if c.doc_hash == hashes["good"])
    raced_good = next(c for c in report.candidates if c.key == hashes["good"])
    # Tasks, not trials: a trial that failed before its agent ran (the unbuildable task)
    # carries no doc_hash, and compare keys it by the agent's arguments instead.
    assert (good.tasks, good.mean_reward) == (raced_good.tasks, raced_good.mean_reward)
    assert json.loads((job / "result.json").read_text())["n_total_trials"] == report.trials


def test_two_identical_documents_are_refused_as_one_candidate(tmp_path: Path) -> None:
    doc = ROOT / "examples" / "harness.json"
    copy = shutil.copy(doc, tmp_path / "same.json")
    result = CliRunner().invoke(app, race_args(tmp_path / "jobs", tmp_path, doc, Path(copy)))
    assert result.exit_code == 2
    assert "are one candidate" in result.output and "give each candidate once" in result.output
    assert not (tmp_path / "jobs").exists()


def test_one_candidate_is_refused_before_anything_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, race_args(tmp_path / "jobs", tmp_path,
                                               ROOT / "examples" / "harness.json"))
    assert result.exit_code == 2 and "at least two different candidates" in result.output
    assert not (tmp_path / "jobs").exists()


@pytest.mark.harbor
def test_ctrl_c_leaves_a_job_directory_that_reads_as_the_race_so_far(tmp_path: Path) -> None:
    code, _, stderr = interrupted_race(tmp_path, "--familywise")
    assert code == 130, stderr
    assert "reads as the race so far" in stderr
    assert_reads_as_the_race_so_far(tmp_path / "jobs" / "race")
    report = read_race(tmp_path / "jobs" / "race")
    assert report.settings.familywise is True and report.gate_open is None


@pytest.mark.harbor
def test_ctrl_c_before_the_first_trial_says_no_race_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ctrl-C while Ray or harbor still starts: the run is interrupted before race.json.
    import wmo_trio.cli._run

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(wmo_trio.cli._run, "run_on_trio", interrupted)
    docs = [candidate(tmp_path, "a", 1.0), candidate(tmp_path, "b", 0.0)]
    tasks = make_tasks(tmp_path / "tasks", 2)
    result = CliRunner().invoke(app, race_args(tmp_path / "jobs", tasks, *docs))
    assert result.exit_code == 130, result.output
    assert "interrupted before the race's first trial; no race was written to" in result.output
    assert "reads as the race so far" not in result.output


@pytest.mark.harbor
def test_the_docs_example_races_the_bundled_candidates(tmp_path: Path) -> None:
    clone = make_clone(tmp_path)
    completed = run_as_written(EXAMPLE, clone)
    report = read_race(clone / "jobs" / "race")
    assert report.finished and len(report.candidates) == 3
    assert "trials:" in completed.stdout and "job directory:" in completed.stdout
    assert "control: per candidate, each one among the best dropped" in completed.stdout


@pytest.fixture(scope="module")
def raced_in_process(tmp_path_factory: pytest.TempPathFactory
                     ) -> tuple[Path, RaceReport, dict[str, str], list[int]]:
    """A race of `steady` and `unset` over four tasks, at a level no four tasks can reach
    (every round runs both): `unset`'s agent is given no time for its setup (harbor's own
    per-agent `override_setup_timeout_sec`), so each of its trials fails before its agent
    runs; `steady`'s document file is rewritten to another document after the first round."""
    root = tmp_path_factory.mktemp("race-in-process")
    tasks = make_tasks(root / "tasks", 4)
    docs = {"steady": candidate(root, "steady", 1.0), "unset": candidate(root, "unset", 1.0)}
    hashes = {name: load_harness(path).doc_hash for name, path in docs.items()}
    options = RunOptions(paths=[tasks], concurrency=2, jobs_dir=root / "jobs",
                         job_name="race", environment=ENV, backend="local")
    plan = build_race(options, list(docs.values()), baseline=None, alpha=0.001,
                      max_trials=None, seed=0)
    plan.config.agents[1].override_setup_timeout_sec = 0.0
    rounds: list[int] = []

    def edit_steady(report: RaceReport) -> None:
        rounds.append(report.rounds)
        if report.rounds == 1:  # now the file holds another document
            candidate(root, "steady", 0.0, answer="/app/elsewhere.txt")

    report = trio.run(functools.partial(run_race, plan, on_round=edit_steady))
    assert load_harness(docs["steady"]).doc_hash != hashes["steady"]
    return root / "jobs" / "race", report, hashes, rounds


@pytest.mark.harbor
def test_a_candidate_whose_trials_all_fail_before_its_agent_runs_is_credited_zero(
    raced_in_process: tuple[Path, RaceReport, dict[str, str], list[int]],
) -> None:
    job, report, hashes, _ = raced_in_process
    unset = next(c for c in report.candidates if c.key == hashes["unset"])
    # Every trial of it ran no agent (harbor recorded the setup's timeout) and has no
    # reward: each counts 0 for it, and the report says why. The tasks stay in the race:
    # the other candidate's trials of them were scored.
    assert (unset.tasks, unset.trials, unset.mean_reward) == (4, 4, 0.0)
    assert (unset.errors, unset.unscored) == (4, 4)
    assert unset.failures == {"AgentSetupTimeoutError": 4}
    assert report.left_out == [] and len(report.task_order) == 4
    results = [json.loads(f.read_text()) for f in job.glob("*/result.json")]
    theirs = [r for r in results if r["config"]["agent"]["kwargs"]["doc_hash"] == hashes["unset"]]
    assert len(theirs) == 4
    for result in theirs:
        assert result["exception_info"]["exception_type"] == "AgentSetupTimeoutError"
        assert result["agent_execution"] is None and result["verifier_result"] is None


@pytest.mark.harbor
def test_a_document_edited_during_the_race_does_not_change_its_candidate(
    raced_in_process: tuple[Path, RaceReport, dict[str, str], list[int]],
) -> None:
    job, report, hashes, rounds = raced_in_process
    assert rounds == [1, 2, 3, 4] and report.finished and report.stop_reason == "tasks exhausted"
    steady = next(c for c in report.candidates if c.key == hashes["steady"])
    # Every round, the edited file's included, ran the document the race was given, as
    # its trials' own records say, and it passed every task as that document does.
    assert (steady.tasks, steady.mean_reward, steady.errors) == (4, 1.0, 0)
    results = [json.loads(f.read_text()) for f in job.glob("*/result.json")]
    ran = [r["agent_result"]["metadata"]["candidate_doc_hash"] for r in results
           if r["agent_result"] is not None]
    assert ran == [hashes["steady"]] * 4
    # The job's configuration carries each document itself, not the path of its file.
    config = json.loads((job / "config.json").read_text())
    assert all(isinstance(agent["kwargs"]["harness"], dict) for agent in config["agents"])
