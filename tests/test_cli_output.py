"""What `wmo-trio` prints, driven in-process through typer's runner (no job, no subprocess)."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

import wmo_trio
from wmo_trio.cli import app
from wmo_trio.cli._run import (
    LOCAL_ENVIRONMENT,
    JobProgress,
    RunOptions,
    TrialRow,
    build_job_config,
    examples_dir,
    summary_line,
    summary_table,
)
from wmo_trio.models import Action, ActionKind, Observation, RunResult, Step, TokenUsage
from wmo_trio.trace import write_trace

runner = CliRunner()
COMMANDS = [[], ["run"], ["trace"], ["doc", "validate"], ["doc", "hash"], ["sandbox", "images"],
            ["sandbox", "prune"]]


def test_version_names_wmo_trio_python_and_harbor() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert re.fullmatch(rf"wmo-trio {re.escape(wmo_trio.__version__)} \(Python 3\.\d+\.\d+, "
                        r"harbor \d+\.\d+\.\d+\)\n", result.stdout), result.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "wmo-trio")
def test_dash_h_is_help_and_no_option_shows_a_python_type(command: list[str]) -> None:
    short = runner.invoke(app, [*command, "-h"], env={"COLUMNS": "120"})
    long = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
    assert short.exit_code == 0 and short.stdout == long.stdout
    assert "Usage: wmo-trio" in short.stdout
    # typer's own help shows `<bool>` beside a flag and `<list[Path]>` beside a path
    assert not re.search(r"<(bool|int|str|float|path|list\[\w+\])>", short.stdout), short.stdout


def test_flags_take_no_value_and_values_are_named() -> None:
    text = runner.invoke(app, ["run", "-h"], env={"COLUMNS": "150"}).stdout
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("│ --")}
    assert re.search(r"--help\s+-h\s+Show this", rows["--help"])
    assert re.search(r"-n\s+INTEGER\s+Trials run at once", rows["--n-concurrent"])
    assert re.search(r"-p\s+PATH\s+A harbor task", rows["--path"])
    trace_help = runner.invoke(app, ["trace", "-h"], env={"COLUMNS": "150"}).stdout
    assert re.search(r"│ --json\s+Print JSON", trace_help), trace_help


def test_job_name_says_what_it_is_and_its_default() -> None:
    text = " ".join(runner.invoke(app, ["run", "-h"], env={"COLUMNS": "150"}).stdout.split())
    assert "--job-name TEXT The job directory's name under --jobs-dir. Default: the start time" \
        in text.replace("│ ", ""), text


def _text(renderable: object, width: int = 150) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_live_display_says_what_the_job_waits_for() -> None:
    progress = JobProgress(total=4)
    assert "creating the job" in _text(progress.render())
    progress.phases = {"a__1": "starting its environment", "b__1": "running the agent"}
    progress.finished = {"c__1": TrialRow("c__1", "c", done=True, reward=1.0)}
    assert progress.status() == ("now: 1 starting its environment (a task's first trial builds "
                                 "its image), 1 running the agent; 1 queued")


def test_timeouts_and_errors_are_counted_apart() -> None:
    rows = [TrialRow("a__1", "a", done=True, reward=1.0),
            TrialRow("b__1", "b", done=True, reward=0.0, exception="AgentTimeoutError"),
            TrialRow("b__2", "b", done=True, reward=0.0, exception="AgentTimeoutError"),
            TrialRow("c__1", "c", done=True, exception="EnvironmentStartTimeoutError"),
            # No harbor exception, but the episode raised: compare counts it an error too.
            TrialRow("d__1", "d", done=True, reward=0.0, stop_reason="error"),
            TrialRow("d__2", "d", done=True, reward=0.0, stop_reason="provider_error")]
    progress = JobProgress(total=6, finished={row.name: row for row in rows})
    header, values = [line for line in _text(progress.render()).splitlines() if "┃" in line
                      or "│" in line][:2]
    columns = [cell.strip() for cell in header.strip("┃").split("┃")]
    cells = dict(zip(columns, (cell.strip() for cell in values.strip("│").split("│")),
                     strict=True))
    assert (cells["done"], cells["timed out"], cells["errors"]) == ("6/6", "2", "2")
    assert summary_line(rows) == ("6 trials: mean reward 0.200, 2 timed out (AgentTimeoutError, "
                                  "still scored), 2 errors")


def test_the_summary_names_each_trial() -> None:
    rows = [TrialRow("hello-file__AbC", "hello-file", done=True, reward=1.0),
            TrialRow("hello-file__XyZ", "hello-file", done=True, reward=0.0)]
    text = _text(summary_table(rows))
    assert "hello-file__AbC" in text and "hello-file__XyZ" in text


def test_run_leaves_the_model_to_wmo_trio() -> None:
    """harbor looks a model up in litellm's tables unless told not to, and warns for every
    model wmo_trio serves itself ("LiteLLM could not resolve model")."""
    from harbor.agents.factory import AgentFactory

    config = build_job_config(RunOptions(paths=[examples_dir() / "tasks" / "hello-file"],
                                         environment=LOCAL_ENVIRONMENT))
    [agent] = config.agents
    assert agent.skip_model_parsing
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    try:
        AgentFactory.run_preflight(agent)
    finally:
        logging.getLogger().removeHandler(handler)
    assert not [r for r in records if "could not resolve model" in r.getMessage()]


# -- wmo-trio trace --------------------------------------------------------------------------


def _result(cls: type[RunResult] = RunResult, /, **fields: Any) -> RunResult:
    """A trace; the identifying text fields it requires (they are being renamed and added
    to) read "t" unless given."""
    filled = {name: "t" for name, info in cls.model_fields.items()
              if info.is_required() and info.annotation in (str, "str") and name not in fields}
    return cls(**filled, **fields)


def _trace_file(where: Path, steps: list[Step], usage_calls: int = 1, **fields: object) -> Path:
    trace = _result(steps=steps, stop_reason=fields.pop("stop_reason", "submitted"),
                    answer=str(fields.pop("answer", "done")), turns=len(steps),
                    worker_usage=TokenUsage(input_tokens=10, output_tokens=2, calls=usage_calls))
    return write_trace(where, trace)


def _step(name: str, arguments: dict[str, str], output: str, said: str = "") -> Step:
    return Step(action=Action(kind=ActionKind.TOOL_CALL, name=name, arguments=arguments,
                              content=said or None),
                observation=Observation(content=output))


def test_trace_says_one_call_not_one_calls(tmp_path: Path) -> None:
    path = _trace_file(tmp_path, [_step("submit", {"answer": "done"}, "submitted")])
    result = runner.invoke(app, ["trace", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith("2 output, 1 call")


def test_a_trace_without_steps_says_why(tmp_path: Path) -> None:
    """A code:runtime program that only called the model has no steps: an empty table."""
    path = _trace_file(tmp_path, [], usage_calls=2, stop_reason="no_action", answer="")
    result = runner.invoke(app, ["trace", str(path)])
    assert result.exit_code == 0, result.output
    assert "no steps recorded: the episode ended (no_action) after 2 model calls, without " \
        "calling a tool" in " ".join(result.stdout.split())


def test_a_trials_text_cannot_drive_the_terminal(tmp_path: Path) -> None:
    hostile = "\x1b]0;owned\x07\x1b[2J\u202eevil"
    path = _trace_file(tmp_path, [_step("bash", {"command": "echo " + hostile}, hostile,
                                        said=hostile)])
    result = runner.invoke(app, ["trace", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert result.stdout.count("\\x1b]0;owned\\x07\\x1b[2J\\u202eevil") == 3


@pytest.mark.parametrize("content", ['{"a": 1}', "[1, 2", '"text"'])
def test_a_json_file_that_is_no_trace_is_one_line_exit_2(tmp_path: Path, content: str) -> None:
    path = tmp_path / "other.json"
    path.write_text(content)
    result = runner.invoke(app, ["trace", str(path)])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wmo-trio: {path} is not a wmo_trio trace")


def test_trace_never_follows_a_link_a_trial_left(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"task_id": "host secret"}')
    job = tmp_path / "job"
    (job / "a__1" / "agent").mkdir(parents=True)
    (job / "a__1" / "agent" / "wmo-run.json").symlink_to(secret)
    _trace_file(job / "b__1" / "agent", [_step("bash", {"command": "true"}, "")])
    result = runner.invoke(app, ["trace", str(job)])
    assert result.exit_code == 0, result.output
    assert "b__1" in result.stdout and "a__1" not in result.stdout
    trial = runner.invoke(app, ["trace", str(job / "a__1")])
    assert trial.exit_code == 2 and "is a link" in trial.stderr and "host secret" not in trial.output
    (job / "c__1").symlink_to(job / "b__1")  # a linked trial directory is not entered either
    again = runner.invoke(app, ["trace", str(job)])
    assert "c__1" not in again.stdout and again.stdout.count("stop reason") == 1


def test_one_unreadable_trace_among_many_is_skipped_and_said(tmp_path: Path) -> None:
    job = tmp_path / "job"
    _trace_file(job / "good__1" / "agent", [_step("bash", {"command": "true"}, "")])
    (job / "cut__1" / "agent").mkdir(parents=True)
    (job / "cut__1" / "agent" / "wmo-run.json").write_text('{"steps": [')
    result = runner.invoke(app, ["trace", str(job)])
    assert result.exit_code == 0, result.output
    assert "good__1" in result.stdout
    [line] = result.stderr.splitlines()
    assert line.startswith("wmo-trio: skipped: ") and "cut__1" in line


def test_the_trace_names_its_trial_when_the_trace_says(tmp_path: Path) -> None:
    """Traces gain their trial's identity (doc_hash, task and trial names, model, times);
    older ones show their task id. Both read."""
    from wmo_trio.cli._trace import identity_line

    class Identified(RunResult):
        doc_hash: str
        task_name: str
        trial_name: str
        model: str
        started_at: str
        ended_at: str

    trace = _result(Identified, steps=[], stop_reason="submitted", turns=0,
                    doc_hash="1b3cb3bea2d1a9acb923a2b2c5b4c0f0", task_name="hello-file",
                    trial_name="hello-file__AbC", model="scripted/offline",
                    started_at="2026-12-03T11:00:00Z", ended_at="2026-12-03T11:00:02.5Z")
    assert identity_line(trace) == (
        "trial hello-file__AbC · task hello-file · model scripted/offline · doc "
        "1b3cb3bea2d1a9acb923a2b2c5b4c0f0 · started 2026-12-03 11:00:00 UTC · 2.5 s")
    if "task_id" in RunResult.model_fields:
        old = RunResult(task_id="8f1e", steps=[], stop_reason="submitted", turns=0)
        assert identity_line(old) == "task id 8f1e"


def test_a_narrow_terminal_wraps_names_rather_than_cutting_them() -> None:
    rows = [TrialRow("proof-of-work__LU8oB9K", "proof-of-work", done=True, reward=0.0,
                     stop_reason="cancelled-by-harbor-timeout", exception="AgentTimeoutError")]
    text = _text(summary_table(rows), width=80)
    assert "…" not in text
    assert "cancelled-by-harbor-timeout" in "".join(
        line.split("│")[3].strip() for line in text.splitlines() if line.count("│") > 3)


def test_an_error_naming_a_hostile_path_is_one_safe_line(tmp_path: Path) -> None:
    where = tmp_path / "job\x1b]0;owned\x07\nname"
    result = runner.invoke(app, ["trace", str(where)])
    assert result.exit_code == 2
    assert "\x1b" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert "job\\x1b]0;owned\\x07\\nname does not exist" in result.stderr
