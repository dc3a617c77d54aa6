"""`wmo-trio compare` on real harbor job directories and on research-API episodes (issue 28).

The jobs are the ones docs/compare.md's example makes: its block runs here as written
(test_readme skips it and checks that this module holds it), in a clone's layout as
test_readme runs blocks, and makes three jobs on the bundled tasks with the scripted
provider: the example document, a variant that differs only in a prompt and a variant
without `write_file` (which the offline policy needs for two of the three tasks). A fourth
is harbor's own `oracle` agent on the same tasks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from harbor.models.trial.result import TrialResult
from harbor_jobs import run_job_here
from support.readme import all_blocks, blocks, make_clone, run_as_written
from typer.testing import CliRunner

from wmo_trio import DirectoryEnvironment, load_harness, open_episode_pool
from wmo_trio.cli import app
from wmo_trio.compare import CompareError, compare, compare_jobs, load_jobs, record_from_run

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "tasks"
DOCS = {name: ROOT / "examples" / f"{name}.json"
        for name in ("harness", "harness-terse", "harness-no-write")}
CLI = [sys.executable, "-c", "from wmo_trio.cli import main; main()"]
PAGE = ROOT / "docs" / "compare.md"
# The page's example and the comparison rows it shows of its output.
[EXAMPLE] = [b for b in blocks(PAGE) if b.lang == "sh" and "wmo-trio compare" in b.body]
[SHOWN] = [b for b in all_blocks(PAGE) if b.lang == "" and b.body.startswith("┃ candidate")]
# The page's Python over the example's jobs.
[FROM_PYTHON] = [b for b in blocks(PAGE) if b.lang == "python" and "compare_jobs(" in b.body]
# The example runs the baseline twice per task, for its pass@2; a candidate compared with
# it once is enough, as a task's score is the mean of its attempts and the offline policy
# ends every attempt of a task alike.
ATTEMPTS = {"harness": 2, "harness-terse": 1, "harness-no-write": 1}


@dataclass(frozen=True)
class Example:
    clone: Path
    completed: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Example:
    clone = make_clone(tmp_path_factory.mktemp("clone"))
    return Example(clone, run_as_written(EXAMPLE, clone))


def oracle_job(jobs_dir: Path) -> Path:
    """harbor's `oracle` agent on the bundled tasks, once each, by harbor's `Job` in this
    process (harbor's command line is not what these tests are about)."""
    from harbor.models.job.config import DatasetConfig, JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig

    run_job_here(JobConfig(
        job_name="oracle", jobs_dir=jobs_dir, n_concurrent_trials=2, quiet=True,
        agents=[AgentConfig(name="oracle")], datasets=[DatasetConfig(path=TASKS)],
        environment=EnvironmentConfig(import_path="wmo_trio.harbor:LocalEnvironment")))
    return jobs_dir / "oracle"


@pytest.fixture(scope="module")
def jobs(example: Example) -> dict[str, Path]:
    made = {name: example.clone / "jobs" / name for name in DOCS}
    made["oracle"] = oracle_job(example.clone / "jobs")
    return made


def doc_hash(name: str) -> str:
    return load_harness(DOCS[name]).doc_hash


def wmo_trio(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def raw_outcomes(job: Path) -> list[tuple[str, float | None, str | None, str | None]]:
    """(task, reward, exception type, stop reason) of each trial, read as plain JSON."""
    rows = []
    for result_file in sorted(job.glob("*/result.json")):
        result = json.loads(result_file.read_text())
        rewards = (result.get("verifier_result") or {}).get("rewards") or {}
        rows.append((result["task_name"], rewards.get("reward"),
                     (result.get("exception_info") or {}).get("exception_type"),
                     ((result.get("agent_result") or {}).get("metadata") or {}).get("stop_reason")))
    return rows


def task_means(job: Path) -> dict[str, float]:
    rewards: dict[str, list[float]] = {}
    for task, reward, _, _ in raw_outcomes(job):
        if reward is not None:
            rewards.setdefault(task, []).append(reward)
    return {task: sum(values) / len(values) for task, values in rewards.items()}


def healthy(job: Path) -> bool:
    """Every trial ended as the offline policy makes it end: proof-of-work by harbor's agent
    timeout, every other task by the policy itself, submitted or, without the tool it needs,
    with no tool call (a machine loaded far past its cores can fail a trial otherwise, which
    the comparison must then report as it is)."""
    return all((exception, stop) == ("AgentTimeoutError", "cancelled-by-harbor-timeout")
               if task == "proof-of-work" else
               exception is None and stop in ("submitted", "no_tool_call")
               for task, _, exception, stop in raw_outcomes(job))


@pytest.mark.harbor
def test_real_jobs_are_compared_candidate_by_candidate_against_the_first(
    jobs: dict[str, Path],
) -> None:
    names = ["harness", "harness-terse", "harness-no-write"]
    report = compare_jobs([jobs[name] for name in names])
    assert [c.doc_hash for c in report.candidates] == [doc_hash(n) for n in names]
    seen = {name: raw_outcomes(jobs[name]) for name in names}
    for name, candidate in zip(names, report.candidates, strict=True):
        means = task_means(jobs[name])
        assert {s.task: s.mean_reward for s in candidate.per_task
                if s.mean_reward is not None} == means, seen
        assert candidate.mean_reward == pytest.approx(sum(means.values()) / len(means))
        assert candidate.trials == len(seen[name]) == 3 * ATTEMPTS[name]
        assert candidate.timeouts == sum(e == "AgentTimeoutError" for _, _, e, _ in seen[name])
        assert candidate.input_tokens > candidate.output_tokens > 0
        assert (candidate.mean_agent_seconds or 0) > 0
    baseline = task_means(jobs["harness"])
    for name, comparison in zip(names[1:], report.comparisons, strict=True):
        assert comparison.baseline == doc_hash("harness")
        differences = {task: mean - baseline[task]
                       for task, mean in task_means(jobs[name]).items() if task in baseline}
        assert {d.task: d.difference for d in comparison.per_task} == differences, seen
        assert comparison.wins == sum(d > 0 for d in differences.values())
        assert comparison.losses == sum(d < 0 for d in differences.values())
        assert comparison.mean_difference == pytest.approx(
            sum(differences.values()) / len(differences))
    # Without write_file the offline policy fails every task, however loaded the machine.
    assert report.candidates[2].mean_reward == 0.0
    if all(healthy(jobs[name]) for name in names):  # the page's example, as it shows it
        prompt_only, tool_removed = report.comparisons
        base = report.candidates[0]
        assert (base.mean_reward, base.pass_at_k) == (pytest.approx(2 / 3),
                                                      {"2": pytest.approx(2 / 3)})
        # The offline policy ignores prompts: a prompt change alone ties on every task.
        assert (prompt_only.ties, prompt_only.p_value, prompt_only.p_method) == (
            3, 1.0, "all tied")
        assert report.candidates[1].input_tokens != base.input_tokens  # its prompt differs
        # The two tasks that need write_file are lost: too few tasks to be sure.
        assert (tool_removed.losses, tool_removed.ties, tool_removed.wins) == (2, 1, 0)
        assert tool_removed.mean_difference == pytest.approx(-2 / 3)
        assert tool_removed.p_value == pytest.approx(0.5)  # 2 of the 4 sign patterns
        assert tool_removed.ci_low == pytest.approx(-1.0)


@pytest.mark.harbor
def test_the_docs_example_prints_the_comparison_rows_it_shows(
    example: Example, jobs: dict[str, Path],
) -> None:
    printed = example.completed.stdout.splitlines()
    rows = SHOWN.body.splitlines()
    assert len(rows) == 3 and rows[0] in printed  # the header, whatever the trials did
    if all(healthy(jobs[name]) for name in DOCS):
        assert [row for row in rows[1:] if row not in printed] == [], printed[-8:]


@pytest.mark.harbor
def test_the_docs_python_runs_over_the_examples_jobs(example: Example,
                                                      jobs: dict[str, Path]) -> None:
    completed = run_as_written(FROM_PYTHON, example.clone)
    assert completed.stdout.startswith(("adopt ", "keep the baseline")), completed.stdout
    assert (example.clone / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.harbor
def test_trials_are_grouped_by_doc_hash_wherever_their_job_lives(
    jobs: dict[str, Path], tmp_path: Path,
) -> None:
    moved = shutil.copytree(jobs["harness"], tmp_path / "renamed-elsewhere", symlinks=True)
    report = compare_jobs([moved, jobs["harness-no-write"]])
    assert [c.doc_hash for c in report.candidates] == [doc_hash("harness"),
                                                       doc_hash("harness-no-write")]
    # The copy and its original hold the same trials: one candidate, each trial once.
    (only,) = compare_jobs([moved, jobs["harness"], jobs["harness"]]).candidates
    assert (only.doc_hash, only.trials, only.name) == (doc_hash("harness"), 6, "harness")
    assert only.sources == [str(moved)]


@pytest.mark.harbor
def test_another_harbor_agent_is_grouped_by_agent_model_and_arguments(
    jobs: dict[str, Path],
) -> None:
    report = compare_jobs([jobs["harness"], jobs["oracle"]])
    oracle = report.candidates[1]
    assert (oracle.doc_hash, oracle.trials, oracle.input_tokens) == ("oracle", 3, 0)
    (comparison,) = report.comparisons
    baseline = task_means(jobs["harness"])
    assert comparison.tasks == 3 and task_means(jobs["oracle"]) == dict.fromkeys(baseline, 1.0)
    # The oracle solves proof-of-work too, which the offline policy cannot in time.
    assert comparison.wins == sum(mean < 1.0 for mean in baseline.values()) >= 1
    assert compare_jobs([jobs["oracle"], jobs["harness"]], baseline="3d07").candidates[
        0].doc_hash == doc_hash("harness")


@pytest.mark.harbor
def test_the_trace_names_the_candidate_when_the_result_does_not(
    jobs: dict[str, Path], tmp_path: Path,
) -> None:
    copy = shutil.copytree(jobs["harness-terse"], tmp_path / "job", symlinks=True)
    for result_file in copy.glob("*/result.json"):
        result = TrialResult.model_validate_json(result_file.read_text())
        assert result.agent_result is not None
        result.agent_result.metadata = {}
        result_file.write_text(result.model_dump_json())
        trace = result_file.parent / "agent" / "wmo-run.json"
        trace.write_text(json.dumps({**json.loads(trace.read_text()),
                                     "doc_hash": doc_hash("harness-terse")}))
    assert {r.candidate for r in load_jobs([copy])} == {doc_hash("harness-terse")}
    # With neither, harbor's records of the trial name it: its configuration, its lock.
    for trace in copy.glob("*/agent/wmo-run.json"):
        trace.unlink()
    assert {r.candidate for r in load_jobs([copy])} == {doc_hash("harness-terse")}
    for result_file in copy.glob("*/result.json"):
        result = TrialResult.model_validate_json(result_file.read_text())
        del result.config.agent.kwargs["doc_hash"]
        result_file.write_text(result.model_dump_json())
    assert {r.candidate for r in load_jobs([copy])} == {doc_hash("harness-terse")}
    # With none of them, the trials are another agent's: harbor's name, model and arguments.
    for lock in copy.glob("*/lock.json"):
        lock.unlink()
    (key,) = {r.candidate for r in load_jobs([copy])}
    assert key.startswith("wmo_trio.harbor:WmoTrioHarborAgent/scripted/offline#")


@pytest.mark.harbor
def test_a_linked_trial_result_is_refused_not_followed(
    jobs: dict[str, Path], tmp_path: Path,
) -> None:
    copy = shutil.copytree(jobs["harness"], tmp_path / "job", symlinks=True)
    victim = next(copy.glob("hello-file__*/result.json"))
    victim.unlink()
    victim.symlink_to(next(jobs["harness-no-write"].glob("hello-file__*/result.json")))
    with pytest.raises(CompareError, match="symbolic link; not followed"):
        load_jobs([copy])


@pytest.mark.harbor
def test_the_command_prints_tables_json_and_a_plot(example: Example, jobs: dict[str, Path]) -> None:
    # The tables and the plot: the docs example's `wmo-trio compare ... --plot compare.png`.
    shown = example.completed.stdout
    assert f"{doc_hash('harness-no-write')[:8]} harness-no-write" in shown
    in_process = compare_jobs([jobs[name] for name in DOCS])
    for expected in in_process.comparisons:
        assert f"{expected.mean_difference:+.3f}" in shown
        assert str(expected.p_method) in shown
    assert "plot: compare.png" in shown
    plot = example.clone / "compare.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000

    as_json = wmo_trio("compare", str(jobs["harness"]), str(jobs["harness-no-write"]), "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert set(report) == {"schema_version", "settings", "candidates", "comparisons"}
    assert report["settings"] == {"confidence": 0.95, "resamples": 10_000, "seed": 0,
                                  "missing_as_zero": False, "pool_models": False}
    assert {"doc_hash", "name", "trials", "tasks", "mean_reward", "ci_low", "ci_high",
            "pass_at_k", "timeouts", "exceptions", "unscored", "input_tokens",
            "output_tokens", "mean_agent_seconds", "per_task"} <= set(report["candidates"][0])
    assert {"baseline", "candidate", "tasks", "mean_difference", "ci_low", "ci_high",
            "p_value", "wins", "losses", "ties", "only_baseline", "only_candidate"} <= set(
        report["comparisons"][0])
    # Seeded: the same input gives the same bytes, here in another process than the command's.
    assert as_json.stdout == compare_jobs(
        [jobs["harness"], jobs["harness-no-write"]]).model_dump_json(indent=2) + "\n"


@pytest.mark.parametrize(("arguments", "fragment"), [
    ([str(ROOT / "examples")], "not a harbor job directory (no config.json)"),
    ([str(ROOT / "no-such-dir")], "not a harbor job directory"),
    (["--plot", "out.svg", str(ROOT / "examples")], "ending in .png"),
])
def test_bad_input_is_one_line_and_exit_code_2(arguments: list[str], fragment: str) -> None:
    # typer's runner, in this process: the command's own exit, and an uncaught exception
    # would be caught here (exit code 1) where a process prints its traceback.
    completed = CliRunner().invoke(app, ["compare", *arguments])
    assert completed.exit_code == 2 and isinstance(completed.exception, SystemExit), (
        completed.exception)
    assert fragment in completed.stderr and "Traceback" not in completed.stderr
    assert len(completed.stderr.strip().splitlines()) <= 2


async def test_research_episodes_compare_the_same_way(tmp_path: Path) -> None:
    """Episodes of the research pool, scored by the caller, compared by `compare`."""
    provider = {"kind": "scripted", "model": "offline"}
    docs = [load_harness(DOCS["harness"]), load_harness(DOCS["harness-no-write"])]
    records = []
    async with open_episode_pool(limit=4) as pool:
        for doc in docs:
            for index in range(5):
                workdir = tmp_path / f"{doc.doc_hash}-{index}"
                workdir.mkdir()
                line = f"hello {index}"
                instruction = (f"Create the file `out.txt` whose whole content is the line "
                               f"`{line}`")
                result = await pool.run(doc, provider, instruction,
                                        DirectoryEnvironment(workdir), task_id=f"greet-{index}")
                written = workdir / "out.txt"
                reward = float(written.is_file() and written.read_text() == line + "\n")
                records.append(record_from_run(doc, f"greet-{index}", result, reward,
                                               task_digest=hashlib.sha256(instruction.encode()).hexdigest()))
    report = compare(records)
    (comparison,) = report.comparisons
    assert report.candidates[0].mean_reward == 1.0 and report.candidates[1].mean_reward == 0.0
    assert (comparison.tasks, comparison.losses, comparison.mean_difference) == (5, 5, -1.0)
    assert comparison.p_value == pytest.approx(2 / 32)  # all five the same sign, exactly
    assert report.candidates[0].input_tokens > 0
