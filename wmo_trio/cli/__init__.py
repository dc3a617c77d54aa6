"""The `wmo-trio` command line: run jobs on the trio host, read traces, check documents."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from wmo_trio._budgets import (
    DEFAULT_COMMAND_TIMEOUT_SEC,
    DEFAULT_EPISODE_TIMEOUT_SEC,
    MAX_COMMAND_TIMEOUT_SEC,
)
from wmo_trio.cli._compare import compare as compare_command
from wmo_trio.cli._help import Command, Group

if TYPE_CHECKING:
    from wmo_trio.harness import HarnessDoc

app = typer.Typer(
    name="wmo-trio",
    help="Run harness candidates as harbor agents on Trio, and read their traces.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
    context_settings={"help_option_names": ["-h", "--help"]},
)
doc_app = typer.Typer(help="Check harness documents.", no_args_is_help=True, cls=Group)
app.add_typer(doc_app, name="doc")
sandbox_app = typer.Typer(help="The docker-free environment's cache of built task images.",
                          no_args_is_help=True, cls=Group)
app.add_typer(sandbox_app, name="sandbox")
app.command("compare", cls=Command)(compare_command)

# Tables stay readable when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 140)
errors = Console(stderr=True)

BAD_INPUT = 2
INFRASTRUCTURE_FAILURE = 1


def _print_version(wanted: bool) -> None:
    if wanted:
        from importlib.metadata import PackageNotFoundError, version

        from wmo_trio import __version__

        try:
            harbor = f", harbor {version('harbor')}"
        except PackageNotFoundError:
            harbor = ""
        sys.stdout.write(f"wmo-trio {__version__} (Python {sys.version.split()[0]}{harbor})\n")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[bool, typer.Option(
        "--version", help="Print the versions of wmo-trio, Python and harbor, and exit.",
        is_eager=True, callback=_print_version)] = False,
) -> None:
    """Run harness candidates as harbor agents on Trio, and read their traces."""


def fail(message: str, code: int = BAD_INPUT) -> typer.Exit:
    from wmo_trio.cli._text import visible

    # One line, whatever a path or a name in it holds.
    shown = visible(message).replace("\n", "\\n")
    errors.print(f"wmo-trio: {shown}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


# The options `run` and `race` share, each written once: both build their harbor job with
# `build_job_config`, so a flag means the same in both (the job name's default included).
TaskPaths = Annotated[list[Path] | None, typer.Option(
    "-p", "--path", help="A harbor task directory or a directory of tasks (repeatable). "
    "Default: the bundled example tasks.")]
Concurrency = Annotated[int, typer.Option(
    "-n", "--n-concurrent", help="Trials run at once (a race's round holds enough tasks to keep "
    "them busy).")]
Attempts = Annotated[int, typer.Option("-k", "--n-attempts", help="Attempts per task.")]
JobsDir = Annotated[Path, typer.Option("-o", "--jobs-dir", help="Where job directories go.")]
JobName = Annotated[str | None, typer.Option(
    "--job-name", help="The job directory's name under --jobs-dir. Default: the start time, as "
    "harbor names it (2026-01-31__14-05-09).")]
Environment = Annotated[str | None, typer.Option(
    "-e", "--env", help="A harbor environment type or import path. Default: docker when a "
    "Docker daemon answers, else wmo_trio.harbor:LocalEnvironment.")]
Model = Annotated[str, typer.Option(
    "-m", "--model", help="kind/model: scripted/offline (no API key), anthropic/<model>, "
    "or openai/<model> for OpenAI or any OpenAI-compatible server (vLLM, SGLang, Ollama, "
    "OpenRouter; give its base_url with --provider-config).")]
ProviderConfig = Annotated[str | None, typer.Option(
    "--provider-config", help="Extra provider settings as a JSON object, e.g. "
    '\'{"base_url": "http://localhost:8000/v1", "api_key_env": null}\'.')]
Backend = Annotated[str | None, typer.Option(
    "--backend", help="Where the episode's program runs: local, e2b or sandbox. Default: "
    "sandbox for a code:runtime document where this machine can run it, else local.")]
Workers = Annotated[str | None, typer.Option(
    "--workers", help="Run the trials on N worker processes of this machine (auto: one per "
    "core), on a Ray started and stopped by this command; needs pip install "
    "'wmo_trio\\[ray]'.")]
RayAddress = Annotated[str | None, typer.Option(
    "--ray-address", help="Run the trials on the running Ray cluster at ADDRESS (auto: "
    "RAY_ADDRESS, or the cluster ray start began here), one worker per node unless "
    "--workers says how many.")]


@app.command(cls=Command)
def run(
    path: TaskPaths = None,
    concurrency: Concurrency = 4,
    attempts: Attempts = 1,
    jobs_dir: JobsDir = Path("jobs"),
    job_name: JobName = None,
    environment: Environment = None,
    harness: Annotated[Path | None, typer.Option(
        "--harness", help="The harness document (JSON). Default: the bundled example.")] = None,
    model: Model = "scripted/offline",
    provider_config: ProviderConfig = None,
    episode_timeout_sec: Annotated[float, typer.Option(
        "--episode-timeout", help="The episode's wall-clock budget, seconds (more than 0).")]
    = DEFAULT_EPISODE_TIMEOUT_SEC,
    command_timeout_sec: Annotated[int, typer.Option(
        "--command-timeout", help=f"Each command's timeout, 1..{MAX_COMMAND_TIMEOUT_SEC} s.")]
    = DEFAULT_COMMAND_TIMEOUT_SEC,
    backend: Backend = None,
    workers: Workers = None,
    ray_address: RayAddress = None,
) -> None:
    """Run a harbor job with the wmo_trio agent, trio owning the loop (trio-asyncio)."""
    from rich.live import Live
    from rich.spinner import Spinner

    from wmo_trio.cli._interrupt import INTERRUPTED, only_interrupts
    from wmo_trio.cli._run import (
        BadInput,
        JobInterrupted,
        RunOptions,
        build_job_config,
        cluster_options,
        examples_dir,
        interrupted_line,
        run_on_trio,
        run_with_progress,
        scan_job,
        summary_line,
        summary_table,
    )

    settings = _provider_settings(provider_config)
    options = RunOptions(
        paths=path or [examples_dir() / "tasks"], concurrency=concurrency, attempts=attempts,
        jobs_dir=jobs_dir, job_name=job_name, environment=environment, harness=harness,
        model=model, provider_settings=settings, episode_timeout_sec=episode_timeout_sec,
        command_timeout_sec=command_timeout_sec, backend=backend,
    )
    refused: BadInput | None = None
    # Loading harbor takes seconds the first time: say so at once rather than sit silent
    # (a Live draws its first frame as it starts; rich's status waits for its first tick).
    with Live(Spinner("dots", "loading harbor, checking the options and the harness "
                      "document …"), console=console, transient=True):
        try:
            cluster = cluster_options(workers, ray_address)
            config = build_job_config(options)
        except BadInput as error:
            refused = error
        except KeyboardInterrupt:
            raise fail("interrupted before the job started", INTERRUPTED) from None
    if refused is not None:
        raise fail(str(refused))
    from wmo_trio.cluster import ClusterError

    job_dir = Path(config.jobs_dir) / str(config.job_name)
    try:
        run_on_trio(run_with_progress, config, console, cluster)
    except JobInterrupted:
        raise fail(interrupted_line(job_dir), INTERRUPTED) from None
    except ClusterError as error:  # before any trial: no cluster there, a worker cannot load
        raise fail(str(error)) from None
    except Exception as error:  # the job itself broke: infrastructure, not the candidate
        raise fail(f"the job failed: {type(error).__name__}: {error}",
                   INFRASTRUCTURE_FAILURE) from error
    except BaseException as error:
        # Ctrl-C in the instants before the job's signal handling starts or after it ends.
        if not only_interrupts(error):
            raise
        raise fail(interrupted_line(job_dir), INTERRUPTED) from None
    try:
        rows = scan_job(job_dir)
        console.print(summary_table(rows, title=f"wmo-trio run: job {job_dir.name}"))
        console.print(summary_line(rows), highlight=False, soft_wrap=True)
        console.print(f"job directory: {job_dir.resolve()}", highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        raise fail(interrupted_line(job_dir), INTERRUPTED) from None


@app.command(cls=Command)
def race(
    harness: Annotated[list[Path], typer.Option(
        "--harness", help="A candidate harness document (JSON); repeat for each candidate.")],
    path: TaskPaths = None,
    baseline: Annotated[Path | None, typer.Option(
        "--baseline", help="The incumbent's document: each candidate stops as soon as it is "
        "shown better or worse than it.")] = None,
    alpha: Annotated[float, typer.Option(
        "--alpha", help="The error level, however often the race looks: with all "
        "candidates equal, the chance of any verdict; for each candidate among the best "
        "(or not worse than the baseline), the chance it is dropped (called worse).")] = 0.05,
    familywise: Annotated[bool, typer.Option(
        "--familywise", help="Make alpha the chance of any wrong verdict in the race, even "
        "with several candidates tied for best (closed testing; costs trials).")] = False,
    max_trials: Annotated[int | None, typer.Option(
        "--max-trials", help="Stop before running more trials than this.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the task order.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    concurrency: Concurrency = 4,
    attempts: Attempts = 1,
    jobs_dir: JobsDir = Path("jobs"),
    job_name: JobName = None,
    environment: Environment = None,
    model: Model = "scripted/offline",
    provider_config: ProviderConfig = None,
    backend: Backend = None,
    workers: Workers = None,
    ray_address: RayAddress = None,
) -> None:
    """Race candidates on the same tasks in rounds; drop each as soon as it is shown worse.

    Every trial is an ordinary harbor trial in one job directory (compare, trace and
    harbor's viewer read it), with the race's state in its race.json. See docs/race.md.
    """
    from rich.live import Live
    from rich.spinner import Spinner

    from wmo_trio.cli._interrupt import INTERRUPTED
    from wmo_trio.cli._race import build_race, run_with_display, standings_table, summary_lines
    from wmo_trio.cli._run import BadInput, RunOptions, cluster_options, examples_dir, run_on_trio

    options = RunOptions(
        paths=path or [examples_dir() / "tasks"], concurrency=concurrency, attempts=attempts,
        jobs_dir=jobs_dir, job_name=job_name, environment=environment, model=model,
        provider_settings=_provider_settings(provider_config), backend=backend)
    refused: BadInput | None = None
    with Live(Spinner("dots", "loading harbor, checking the options and the documents …"),
              console=errors, transient=True):
        try:
            cluster = cluster_options(workers, ray_address)
            plan = build_race(options, harness, baseline=baseline, alpha=alpha,
                              max_trials=max_trials, seed=seed, familywise=familywise)
        except BadInput as error:
            refused = error
    if refused is not None:
        raise fail(str(refused))
    from wmo_trio.cluster import ClusterError

    try:
        report = run_on_trio(run_with_display, plan, None if as_json else console, cluster)
    except KeyboardInterrupt:
        job = plan.job_dir.resolve()
        if (job / "race.json").is_file():
            raise fail(f"interrupted; {job} reads as the race so far (race.json)",
                       INTERRUPTED) from None
        raise fail(f"interrupted before the race's first trial; no race was written to {job}",
                   INTERRUPTED) from None
    except ClusterError as error:  # before any trial: no cluster there, a worker cannot load
        raise fail(str(error)) from None
    except Exception as error:  # the race itself broke: infrastructure, not a candidate
        raise fail(f"the race failed: {type(error).__name__}: {error}",
                   INFRASTRUCTURE_FAILURE) from error
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
        return
    console.print(standings_table(report, f"wmo-trio race: job {plan.job_dir.name}"))
    for line in summary_lines(report):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    console.print(f"job directory: {plan.job_dir.resolve()}", highlight=False, soft_wrap=True)


def _provider_settings(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise fail(f"--provider-config is not JSON: {error.msg}") from None
    if not isinstance(settings, dict):
        raise fail("--provider-config must be a JSON object")
    return settings


@app.command(cls=Command)
def trace(
    path: Annotated[Path, typer.Argument(help="A wmo-run.json, a trial directory, a job "
                                         "directory or a directory of jobs.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    full: Annotated[bool, typer.Option("--full", help="Show every text, command and "
                                       "observation whole.")] = False,
) -> None:
    """Show episodes step by step: the model's text, each action as sent, observations, stop
    reason, the trial's reward and usage."""
    from wmo_trio.cli._run import BadInput
    from wmo_trio.cli._text import visible
    from wmo_trio.cli._trace import FULL, find, render
    from wmo_trio.cli._trace import as_json as to_json

    problems: list[str] = []
    try:
        found = find(path, problems)
    except BadInput as error:
        raise fail(str(error)) from None
    for problem in problems:
        errors.print(f"wmo-trio: skipped: {visible(problem)}", markup=False, highlight=False,
                     soft_wrap=True)
    for one in found:
        if one.note:
            errors.print(f"wmo-trio: {visible(one.note)}", markup=False, highlight=False,
                         soft_wrap=True)
    if as_json:
        sys.stdout.write(to_json(found) + "\n")
        return
    for one in found:
        render(one, console, FULL if full else None)


def _load_doc(file: Path) -> HarnessDoc:
    from wmo_trio.harness import HarnessError, load_harness

    try:
        return load_harness(file)
    except HarnessError as error:
        raise fail(str(error)) from None


def _printable(text: str) -> str:
    """`text` for one line of output: quoted and escaped when it holds control characters,
    and never an encoding error (a file name from argv may hold undecodable bytes)."""
    shown = text if text.isprintable() else repr(text)
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")


_NOTES_LISTED = 5
DocFile = Annotated[Path, typer.Argument(help="A harness document (JSON).")]


@doc_app.command("validate", cls=Command)
def doc_validate(file: DocFile) -> None:
    """Check a harness document against every rule; exit code 2 when it is invalid."""
    doc = _load_doc(file)
    # Written, not printed through rich: scripts read the hash, so the line never wraps.
    sys.stdout.write(f"{_printable(str(file))}: valid ({_printable(doc.name)} v{doc.version}, "
                     f"{len(doc.surfaces)} surfaces, tools {', '.join(doc.tools)}; "
                     f"hash {doc.doc_hash})\n")
    unknown = doc.unknown_params
    if unknown:
        listed = ", ".join(unknown[:_NOTES_LISTED])
        more = f" and {len(unknown) - _NOTES_LISTED} more" if len(unknown) > _NOTES_LISTED else ""
        errors.print(f"note: {len(unknown)} parameter surface{'s' if len(unknown) > 1 else ''} "
                     f"wmo_trio does not read, kept and hashed: {listed}{more}",
                     markup=False, highlight=False, soft_wrap=True)


@doc_app.command("hash", cls=Command)
def doc_hash(file: DocFile) -> None:
    """Print the document's doc_hash."""
    sys.stdout.write(_load_doc(file).doc_hash + "\n")


CacheDir = Annotated[Path | None, typer.Option(
    "--cache-dir", help="The image cache (default: ~/.cache/wmo-trio/sandbox, as "
    "LocalEnvironment's cache_dir).")]


@sandbox_app.command("images", cls=Command)
def sandbox_images(cache_dir: CacheDir = None) -> None:
    """List the built task images: key, task, size, last use, whether a trial uses it, and
    who built it for which job: every job run with the cache shares it."""
    from datetime import datetime

    from rich.table import Table

    from wmo_trio.cli._text import visible
    from wmo_trio.sandbox import ImageCache, default_cache_dir

    cache = ImageCache(cache_dir or default_cache_dir())
    table = Table(box=None, show_edge=False, pad_edge=False)
    for column in ("image", "task", "size", "last used", "in use", "built by, for job"):
        # Only the last column wraps (a job's path): the others stay in line.
        table.add_column(column, justify="right" if column == "size" else "left",
                         no_wrap=column != "built by, for job", overflow="fold")
    for image in cache.entries():
        used = datetime.fromtimestamp(image.built_at).strftime("%Y-%m-%d %H:%M")
        built_by = f"{image.user}, {image.job}" if image.user else "-"
        table.add_row(image.key, visible(image.task), f"{image.size_bytes / 2**20:.1f} MiB",
                      used, "yes" if image.in_use else "", visible(built_by))
    console.print(table, highlight=False)
    console.print(f"cache: {cache.root} (shared: every job run with it, whoever runs it, builds "
                  "and reuses its images here)", highlight=False, soft_wrap=True)


@sandbox_app.command("prune", cls=Command)
def sandbox_prune(
    cache_dir: CacheDir = None,
    older_than_days: Annotated[float | None, typer.Option(
        "--older-than-days", help="Only images last used this many days ago or more.")] = None,
) -> None:
    """Remove built images and host layers no trial or build is using (they are made
    again when next needed); what a running trial or build holds is kept and named."""
    from wmo_trio.sandbox import ImageCache, default_cache_dir

    cache = ImageCache(cache_dir or default_cache_dir())
    older = None if older_than_days is None else older_than_days * 86400
    if not cache.root.exists():
        console.print("removed 0 image(s), 0.0 MiB", highlight=False)
        return
    pruned = cache.prune(older)
    freed = sum(image.size_bytes for image in pruned.removed)
    console.print(f"removed {len(pruned.removed)} image(s), {freed / 2**20:.1f} MiB",
                  highlight=False)
    # One line each, however long the path: a script may read them.
    for image in pruned.images_in_use:
        console.print(f"kept image {image.key} ({image.task}): a trial or build uses it",
                      highlight=False, soft_wrap=True)
    for layer in pruned.layers_in_use:
        console.print(f"kept host layer {layer}: a trial or build uses it", highlight=False,
                      soft_wrap=True)


def main() -> None:
    # harbor imports litellm, which otherwise tries to download a model cost map at import
    # and stalls for seconds on a machine without internet access.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        app()
    finally:
        # The interpreter may still wait for threads as it exits (a sandbox's directories
        # being removed): a Ctrl-C then ends it as SIGINT ends a process, not with a
        # traceback of threading's shutdown.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
