"""`wmo-trio compare`: is a candidate better than the baseline, task by task?"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

BAD_INPUT = 2


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"wmo-trio compare: {message}", markup=False, highlight=False,
                               soft_wrap=True)
    return typer.Exit(BAD_INPUT)


def compare(
    job_dirs: Annotated[list[Path], typer.Argument(
        help="harbor job directories, or directories of them; their trials are grouped by "
        "candidate (doc_hash and model), whichever job holds them.")],
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="The doc_hash (or its start, or another agent's key) to compare "
        "against, @model to pick one of its models. Default: the first job's candidate with "
        "a scored trial.")] = None,
    pool_models: Annotated[bool, typer.Option(
        "--pool-models", help="One candidate per document whatever model ran it (default: "
        "one per document and model).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    plot_file: Annotated[Path | None, typer.Option(
        "--plot", help="Also draw the per-task rewards and the differences to this PNG.")]
    = None,
    missing_as_zero: Annotated[bool, typer.Option(
        "--missing-as-zero", help="Count trials without a reward (exceptions before the "
        "verifier) as reward 0 instead of leaving them out.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the bootstrap resampling.")] = 0,
) -> None:
    """Is a candidate better than the baseline? Paired statistics over the same tasks.

    Per candidate: mean reward with a bootstrap interval over tasks, pass@k, timeouts,
    errors, tokens. Per candidate against the baseline: the paired mean difference with
    its interval, an exact sign-flip p-value, wins, losses and ties. See docs/compare.md.
    """
    from wmo_trio.compare import CompareError, compare_jobs, plot, render

    if plot_file is not None and plot_file.suffix.lower() != ".png":
        raise _fail(f"--plot {plot_file}: give a file name ending in .png")
    try:
        report = compare_jobs(job_dirs, baseline=baseline, missing_as_zero=missing_as_zero,
                              seed=seed, pool_models=pool_models)
    except CompareError as error:
        raise _fail(str(error)) from None
    if plot_file is not None:
        try:
            plot(report, plot_file)
        except OSError as error:
            raise _fail(f"cannot write {plot_file}: {error.strerror}") from None
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        # Tables stay readable when output goes to a file or a CI log.
        console = Console(width=None if sys.stdout.isatty() else 160)
        render(report, console)
        if plot_file is not None:
            console.print(f"plot: {plot_file}", highlight=False, soft_wrap=True)
