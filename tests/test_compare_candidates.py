"""What `compare` counts as a candidate, and how its report reads (issue 38).

Four small jobs on real harbor trials, made as `wmo-trio run` makes them (its job
configuration, in this process): a document whose only trial fails before its agent runs
(a task whose image does not build), the example document with the offline model, the same
document with another model, and a document whose code raises. The report's tables and
plot are checked on records made here: they are about reading, not running.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harbor_jobs import run_job_here
from rich.console import Console
from typer.testing import CliRunner

from wmo_trio.cli import app
from wmo_trio.cli._run import LOCAL_ENVIRONMENT, RunOptions, build_job_config
from wmo_trio.compare import TrialRecord, compare, compare_jobs, load_jobs, render
from wmo_trio.compare._report import figure_of, notes
from wmo_trio.harness import load_harness

ROOT = Path(__file__).resolve().parent.parent
HELLO = ROOT / "examples" / "tasks" / "hello-file"
HARNESS = ROOT / "examples" / "harness.json"
TERSE = ROOT / "examples" / "harness-terse.json"
OFFLINE, WEAK = "scripted/offline", "scripted/weak"
# The other model: a script that submits at once, so the task is never done.
SUBMIT_AT_ONCE = {"script": [{"tool_calls": [{"name": "submit", "arguments": {"answer": "x"}}]}]}


def doc_hash(path: Path) -> str:
    return load_harness(path).doc_hash


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = tmp_path_factory.mktemp("documents")
    broken = shutil.copytree(HELLO, made / "tasks" / "broken-build")
    (broken / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN exit 3\n")
    raising = json.loads(HARNESS.read_text())
    raising["name"] = "raises"
    raising["surfaces"].append({"id": "code:runtime", "kind": "code",
                                "content": "def run(kit):\n    raise RuntimeError('boom')\n"})
    (made / "raises.json").write_text(json.dumps(raising))
    return {"broken": broken, "raises": made / "raises.json"}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, documents: dict[str, Path]) -> Path:
    root = tmp_path_factory.mktemp("jobs")
    runs = {
        "1-first": RunOptions([documents["broken"]], harness=TERSE),
        "2-base": RunOptions([HELLO], harness=HARNESS),
        "3-weak": RunOptions([HELLO], harness=HARNESS, model=WEAK,
                             provider_settings=SUBMIT_AT_ONCE),
        "4-raising": RunOptions([HELLO], harness=documents["raises"], backend="local"),
    }
    for name, options in runs.items():
        options.jobs_dir, options.job_name, options.environment = root, name, LOCAL_ENVIRONMENT
        run_job_here(build_job_config(options))
    return root


@pytest.mark.harbor
def test_a_trial_that_failed_before_its_agent_ran_is_its_documents(jobs: Path) -> None:
    (record,) = load_jobs([jobs / "1-first"])
    # Before: filed under wmo_trio.harbor:WmoTrioHarborAgent/scripted/offline#<hash>.
    assert (record.candidate, record.model, record.exception) == (
        doc_hash(TERSE), OFFLINE, "BuildError")
    report = compare_jobs([jobs / "1-first", jobs / "2-base"])
    terse = next(c for c in report.candidates if c.doc_hash == doc_hash(TERSE))
    assert (terse.unscored, terse.exception_types, terse.tasks) == (1, {"BuildError": 1}, 0)
    assert any("BuildError 1" in line and "left out" in line for line in notes(report))
    counted = compare_jobs([jobs / "1-first"], missing_as_zero=True).candidates[0]
    assert (counted.tasks, counted.mean_reward) == (1, 0.0)


@pytest.mark.harbor
def test_the_baseline_has_a_scored_trial_when_a_candidate_does(jobs: Path) -> None:
    report = compare_jobs([jobs / "1-first", jobs / "2-base", jobs / "3-weak"])
    assert {(c.baseline, c.baseline_model) for c in report.comparisons} == {
        (doc_hash(HARNESS), OFFLINE)}
    weak = next(c for c in report.comparisons if c.candidate_model == WEAK)
    assert (weak.tasks, weak.mean_difference) == (1, -1.0)  # before: nothing was paired


@pytest.mark.harbor
def test_a_candidate_is_a_document_and_its_model_unless_models_are_pooled(jobs: Path) -> None:
    apart = compare_jobs([jobs / "2-base", jobs / "3-weak"])
    # Before: one candidate, its mean 0.5 over two models.
    assert [(c.doc_hash, c.model, c.mean_reward) for c in apart.candidates] == [
        (doc_hash(HARNESS), OFFLINE, 1.0), (doc_hash(HARNESS), WEAK, 0.0)]
    assert any("ran with 2 models" in line and "--pool-models" in line
               for line in notes(apart))
    (pooled,) = compare_jobs([jobs / "2-base", jobs / "3-weak"], pool_models=True).candidates
    assert (pooled.model, pooled.models, pooled.trials) == (None, [OFFLINE, WEAK], 2)
    shown = CliRunner().invoke(app, ["compare", str(jobs / "2-base"), str(jobs / "3-weak"),
                                     "--pool-models"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "2 models pooled" in shown.stdout and "pooled into one candidate" in shown.stdout


@pytest.mark.harbor
def test_episodes_that_ended_in_error_are_counted(jobs: Path,
                                                  documents: dict[str, Path]) -> None:
    report = compare_jobs([jobs / "2-base", jobs / "4-raising"])
    raising = report.candidates[1]
    assert raising.doc_hash == doc_hash(documents["raises"])
    assert (raising.name, raising.episode_errors, raising.exceptions) == ("raises", 1, 0)
    console = Console(width=200, record=True)
    render(report, console)
    row = next(line for line in console.export_text().splitlines() if "raises" in line)
    assert row.split("│")[8].strip() == "1"  # the errors column; before: 0


@pytest.mark.harbor
def test_compare_takes_a_directory_of_jobs(jobs: Path) -> None:
    completed = CliRunner().invoke(app, ["compare", str(jobs), "--json"])
    assert completed.exit_code == 0, completed.output  # before: not a harbor job directory
    assert completed.stdout == compare_jobs(sorted(jobs.iterdir())).model_dump_json(
        indent=2) + "\n"


def records(tasks: int) -> list[TrialRecord]:
    """Three candidates with long names and keys, two attempts on each of `tasks` tasks."""
    found = []
    for index, (key, name) in enumerate([
        ("a" * 32, "a-harness-document-whose-file-name-goes-on-and-on"),
        ("b" * 32, "another-harness-document-with-a-name-as-long"),
        ("terminus-2/openai/Qwen/Qwen2.5-72B-Instruct-served-by-a-long-name#1a2b3c4d", ""),
    ]):
        for task in range(tasks):
            for attempt in range(2):
                found.append(TrialRecord(
                    candidate=key, name=name or key, task=f"task-{task:02d}-{'x' * (task % 4 * 6)}",
                    reward=float((task + attempt + index) % 3 == 0)))
    return found


@pytest.mark.parametrize("width", [100, 160])
def test_long_keys_never_cut_or_drop_a_number(width: int) -> None:
    report = compare(records(6))
    console = Console(width=width, record=True)
    render(report, console)
    shown = console.export_text()
    for header in ("pass@k", "no reward", "tokens in/out", "agent s", "p", "unpaired"):
        assert header in shown, shown
    for candidate in report.candidates:
        assert f"{candidate.mean_reward:.3f}" in shown, shown  # before: "0.0…" or gone
        assert f"@2 {candidate.pass_at_k['2']:.2f}" in shown, shown
    for comparison in report.comparisons:
        assert f"{comparison.p_value:.3g}" in shown and f"{comparison.mean_difference:+.3f}" in shown
    # Keys are shortened, not cut mid-number: a name and a short hash.
    assert "aaaaaaaa a-harness-document-whos…" in shown


def test_the_plot_explains_itself_and_keeps_its_text_inside() -> None:
    report = compare(records(45))
    figure = figure_of(report)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    box = figure.bbox
    texts = [t for t in figure.findobj(lambda a: hasattr(a, "get_text")) if t.get_text()]
    outside = [t.get_text() for t in texts
               if not (box.x0 - 1 <= t.get_window_extent(renderer).x0
                       and t.get_window_extent(renderer).x1 <= box.x1 + 1)]
    assert outside == [], outside
    left, right = figure.axes
    assert len(left.get_yticklabels()) == 45
    assert "W/L/T: tasks won, lost and tied" in right.get_xlabel().replace("\n", " ")
    # The baseline named as the table names it.
    assert "aaaaaaaa a-harness-document-whos…" in right.get_title().replace("\n", " ")


def test_an_empty_panel_says_why() -> None:
    lonely = compare([TrialRecord(candidate="a" * 32, name="only", task="t", reward=None,
                                  exception="BuildError")])
    figure = figure_of(lonely)
    left, right = figure.axes
    assert any("no trial has a reward" in t.get_text() for t in left.texts)
    assert any("nothing to compare" in t.get_text() for t in right.texts)
