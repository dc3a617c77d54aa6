"""Several runs of a command line in one Python process.

A console script is `sys.exit(entry())` with `sys.argv` set: `run_in_one_process` does
exactly that once per command, in one interpreter, so commands that end before any real
work (refusals, a plan with nothing to execute) share its start, its imports (harbor's
alone are over a CPU-second) and a typer app's click command instead of paying them per
command. Each command gets its own
arguments, environment, exit status and output, as its own process would. An exception
that escapes the entry is printed by `sys.excepthook`, as the interpreter prints it, and
exits with status 1.

Commands run in the order given: one whose outcome could depend on what the process has
imported or done before (a first use) goes first.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_RUNNER = r"""
import functools, importlib, json, os, sys

import typer.main

# A typer app builds its click command (every subcommand's options, from their signatures)
# on each call: build it once and reuse it, as click's own test runner reuses a command.
typer.main.get_command = functools.cache(typer.main.get_command)

module, _, name = sys.argv[1].partition(":")
entry = getattr(importlib.import_module(module), name)
program = sys.argv[2]


def status_of(exit):
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)  # what the interpreter does with a message
    return 1


for index, (argv, environment) in enumerate(json.load(sys.stdin)):
    os.environ.clear()
    os.environ.update(environment)
    sys.argv = [program, *argv]
    try:
        sys.exit(entry())
    except SystemExit as exit:
        status = status_of(exit)
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        stream.write(f"\0end {index} {status}\0\n")
        stream.flush()
"""

_END = re.compile(r"\0end (\d+) (-?\d+)\0\n")


def run_in_one_process(
    entry: str, program: str, commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], *,
    cwd: Path, timeout: float,
) -> list[subprocess.CompletedProcess[str]]:
    """Run `program`'s console script entry (`module:callable`) once per (arguments,
    environment) in `commands`, in one process; one completed process per command, as if
    each had been run alone."""
    stdin = json.dumps([[list(argv), dict(environment)] for argv, environment in commands])
    completed = subprocess.run(
        [sys.executable, "-c", _RUNNER, entry, program], input=stdin, cwd=cwd,
        env=dict(commands[0][1]) if commands else None, capture_output=True, text=True,
        timeout=timeout)
    stdout_parts = _END.split(completed.stdout)
    stderr_parts = _END.split(completed.stderr)
    # split() gives [output, index, status, output, index, status, ..., rest].
    ended = len(stdout_parts) // 3
    assert completed.returncode == 0 and ended == len(commands) == len(stderr_parts) // 3, (
        f"the runner ended after {ended} of {len(commands)} commands "
        f"(status {completed.returncode}):\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    results = []
    for number, (argv, _environment) in enumerate(commands):
        index, status = stdout_parts[3 * number + 1], stdout_parts[3 * number + 2]
        assert (int(index), stderr_parts[3 * number + 2]) == (number, status)
        results.append(subprocess.CompletedProcess(
            [program, *argv], int(status), stdout_parts[3 * number], stderr_parts[3 * number]))
    return results
