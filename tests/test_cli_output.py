"""What `wmo-trio` prints, driven in-process through typer's runner (no job, no subprocess)."""

from __future__ import annotations

import io
import logging
import re

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
            TrialRow("c__1", "c", done=True, exception="EnvironmentStartTimeoutError")]
    progress = JobProgress(total=4, finished={row.name: row for row in rows})
    header, values = [line for line in _text(progress.render()).splitlines() if "┃" in line
                      or "│" in line][:2]
    columns = [cell.strip() for cell in header.strip("┃").split("┃")]
    cells = dict(zip(columns, (cell.strip() for cell in values.strip("│").split("│")),
                     strict=True))
    assert (cells["done"], cells["timed out"], cells["errors"]) == ("4/4", "2", "1")
    assert summary_line(rows) == ("4 trials: mean reward 0.333, 2 timed out (AgentTimeoutError, "
                                  "still scored), 1 error")


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
