"""`wmo-trio run`: a harbor job with the wmo_trio agent, on the trio-owned host."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table

import wmo_trio

LOCAL_ENVIRONMENT = "wmo_trio.harbor:LocalEnvironment"
AGENT_IMPORT_PATH = "wmo_trio.harbor:WmoTrioHarborAgent"
DEFAULT_MODEL = "scripted/offline"


class BadInput(Exception):
    """Wrong input from the user: one line saying what and what to do; exit code 2."""


def examples_dir() -> Path:
    """The bundled examples: the example tasks and document, shipped as package data
    (in a source checkout, `wmo_trio/examples` links to the repository's `examples/`)."""
    return Path(wmo_trio.__file__).resolve().parent / "examples"


def docker_daemon_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class RunOptions:
    paths: list[Path]
    concurrency: int = 4
    attempts: int = 1
    jobs_dir: Path = Path("jobs")
    job_name: str | None = None
    environment: str | None = None
    harness: Path | None = None
    model: str = DEFAULT_MODEL
    provider_settings: dict[str, Any] = field(default_factory=dict)
    episode_timeout: float = 300.0
    command_timeout: int = 240
    backend: str | None = None


def _task_configs(paths: list[Path]) -> tuple[list[Any], list[Any]]:
    from harbor.models.job.config import DatasetConfig
    from harbor.models.trial.config import TaskConfig

    tasks, datasets = [], []
    for path in paths:
        if not path.exists():
            raise BadInput(f"tasks path {path} does not exist; pass -p with a harbor task "
                           "directory or a directory of tasks")
        if (path / "task.toml").is_file():
            tasks.append(TaskConfig(path=path))
        elif path.is_dir() and any((child / "task.toml").is_file() for child in path.iterdir()):
            datasets.append(DatasetConfig(path=path))
        else:
            raise BadInput(f"{path} is neither a harbor task (no task.toml) nor a directory of "
                           "tasks; pass -p with one of those")
    return tasks, datasets


def _environment_config(name: str | None) -> Any:
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.trial.config import EnvironmentConfig

    if name is None:
        name = "docker" if docker_daemon_answers() else LOCAL_ENVIRONMENT
        if name == LOCAL_ENVIRONMENT:
            sys.stderr.write("wmo-trio: no Docker daemon answers; running tasks in the "
                             f"docker-free sandbox ({LOCAL_ENVIRONMENT}, see the README)\n")
    if ":" in name:
        return EnvironmentConfig(import_path=name)
    try:
        kind = EnvironmentType(name)
    except ValueError:
        known = ", ".join(t.value for t in EnvironmentType)
        raise BadInput(f"unknown environment {name!r}; use a harbor type ({known}) or an import "
                       f"path such as {LOCAL_ENVIRONMENT}") from None
    if kind is EnvironmentType.DOCKER and not docker_daemon_answers():
        raise BadInput("the Docker daemon does not answer (docker info failed); start Docker, "
                       f"or run without Docker: -e {LOCAL_ENVIRONMENT}")
    return EnvironmentConfig(type=kind)


def build_job_config(options: RunOptions) -> Any:
    """Validate every option, then the harbor `JobConfig`. Raises `BadInput`."""
    from harbor.models.job.config import JobConfig
    from harbor.models.trial.config import AgentConfig

    from wmo_trio.harbor import WmoTrioHarborAgent

    tasks, datasets = _task_configs(options.paths)
    kind, slash, model = options.model.partition("/")
    if not slash or not kind or not model:
        raise BadInput(f"model {options.model!r} must be kind/model, e.g. {DEFAULT_MODEL}, "
                       "anthropic/claude-sonnet-4-5 or openai/<model>")
    harness = options.harness or examples_dir() / "harness.json"
    kwargs: dict[str, Any] = {
        "harness": str(harness.resolve()),
        "provider_config": {"kind": kind, "model": model, **options.provider_settings},
        "episode_timeout_sec": options.episode_timeout,
        "command_timeout_sec": options.command_timeout,
        "episode_workers": max(options.concurrency, 1),
    }
    if options.backend is not None:
        kwargs["harness_backend"] = options.backend
    # Build the agent once, here, so that every check it makes (document, provider kind,
    # API key, timeouts) fails now, before a job directory exists.
    with tempfile.TemporaryDirectory() as scratch:
        try:
            WmoTrioHarborAgent(logs_dir=Path(scratch), model_name=options.model, **kwargs)
        except ValueError as error:
            raise BadInput(str(error)) from None
    if options.concurrency < 1 or options.attempts < 1:
        raise BadInput("-n and -k must be at least 1")
    environment = _environment_config(options.environment)
    name = options.job_name or datetime.now().strftime("%Y-%m-%d__%H-%M-%S")
    if (options.jobs_dir / name).exists():
        raise BadInput(f"job directory {options.jobs_dir / name} already exists; pick another "
                       "--job-name")
    return JobConfig(
        job_name=name,
        jobs_dir=options.jobs_dir,
        n_attempts=options.attempts,
        n_concurrent_trials=options.concurrency,
        quiet=True,
        environment=environment,
        agents=[AgentConfig(import_path=AGENT_IMPORT_PATH, model_name=options.model,
                            kwargs=kwargs)],
        tasks=tasks,
        datasets=datasets,
    )


@dataclass
class TrialRow:
    name: str
    task: str
    done: bool
    reward: float | None = None
    exception: str | None = None
    stop_reason: str | None = None
    turns: int | None = None
    tokens: int | None = None
    seconds: float | None = None


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (datetime.fromisoformat(end.replace("Z", "+00:00"))
            - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()


def scan_job(job_dir: Path) -> list[TrialRow]:
    """The trials of a job directory as they stand now (finished or still running)."""
    rows: list[TrialRow] = []
    if not job_dir.is_dir():
        return rows
    for trial in sorted(p for p in job_dir.iterdir() if p.is_dir()):
        result_file = trial / "result.json"
        config_file = trial / "config.json"
        if not result_file.is_file():
            if config_file.is_file():
                rows.append(TrialRow(trial.name, trial.name.rsplit("__", 1)[0], done=False))
            continue
        try:
            result = json.loads(result_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not result.get("finished_at"):
            rows.append(TrialRow(trial.name, result.get("task_name", trial.name), done=False))
            continue
        rewards = (result.get("verifier_result") or {}).get("rewards") or {}
        agent = result.get("agent_result") or {}
        metadata = agent.get("metadata") or {}
        tokens = None
        if agent.get("n_input_tokens") is not None:
            tokens = (agent.get("n_input_tokens") or 0) + (agent.get("n_output_tokens") or 0)
        rows.append(TrialRow(
            name=trial.name, task=result.get("task_name", trial.name), done=True,
            reward=rewards.get("reward"),
            exception=(result.get("exception_info") or {}).get("exception_type"),
            stop_reason=metadata.get("stop_reason"), turns=metadata.get("turns"),
            tokens=tokens, seconds=_seconds(result.get("started_at"), result.get("finished_at")),
        ))
    return rows


def progress_table(rows: list[TrialRow], total: int) -> Table:
    done = [r for r in rows if r.done]
    rewards = [r.reward for r in done if r.reward is not None]
    table = Table(title="wmo-trio run", show_header=True)
    for column in ("done", "running", "failed", "mean reward", "tokens"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{len(done)}/{total}", str(sum(not r.done for r in rows)),
        str(sum(r.exception is not None for r in done)),
        f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
        f"{sum(r.tokens or 0 for r in rows):,}",
    )
    return table


def summary_table(rows: list[TrialRow]) -> Table:
    table = Table(title="trials", show_header=True)
    for column in ("task", "reward", "stop reason", "turns", "tokens", "seconds", "exception"):
        table.add_column(column, justify="left" if column in ("task", "stop reason") else "right")
    for row in rows:
        table.add_row(
            row.task, "-" if row.reward is None else f"{row.reward:g}", row.stop_reason or "-",
            "-" if row.turns is None else str(row.turns),
            "-" if row.tokens is None else f"{row.tokens:,}",
            "-" if row.seconds is None else f"{row.seconds:.1f}", row.exception or "",
        )
    return table


def count_trials(config: Any) -> int:
    tasks = len(config.tasks)
    for dataset in config.datasets:
        tasks += sum((child / "task.toml").is_file() for child in Path(dataset.path).iterdir())
    return tasks * int(config.n_attempts)


async def run_with_progress(config: Any, console: Console) -> Path:
    """Run the job on the trio host, showing live progress; returns the job directory."""
    from wmo_trio.harbor import run_job

    job_dir = Path(config.jobs_dir) / str(config.job_name)
    total = count_trials(config)
    with Live(progress_table([], total), console=console, refresh_per_second=4,
              transient=not console.is_terminal) as live:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                while True:
                    rows = await trio.to_thread.run_sync(scan_job, job_dir)
                    live.update(progress_table(rows, total))
                    await trio.sleep(0.5)

            nursery.start_soon(watch)
            await run_job(config)
            nursery.cancel_scope.cancel()
        live.update(progress_table(scan_job(job_dir), total))
    return job_dir
