"""What `wmo-trio` prints, driven in-process through typer's runner (no job, no subprocess)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import wmo_trio
from wmo_trio.cli import app

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
