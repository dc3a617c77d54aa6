"""`wmo-trio run`: a harbor job with the wmo_trio agent, on the trio-owned host."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

import wmo_trio
from wmo_trio._budgets import DEFAULT_COMMAND_TIMEOUT_SEC, DEFAULT_EPISODE_TIMEOUT_SEC
from wmo_trio.models import StopReason

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
    episode_timeout_sec: float = DEFAULT_EPISODE_TIMEOUT_SEC
    command_timeout_sec: int = DEFAULT_COMMAND_TIMEOUT_SEC
    backend: str | None = None


def _task_paths(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """The harbor tasks and the directories of tasks `paths` names; `BadInput` for a path
    that is neither."""
    tasks, datasets = [], []
    for path in paths:
        if not path.exists():
            raise BadInput(f"tasks path {path} does not exist; pass -p with a harbor task "
                           "directory or a directory of tasks")
        if (path / "task.toml").is_file():
            tasks.append(path)
        elif path.is_dir() and any((child / "task.toml").is_file() for child in path.iterdir()):
            datasets.append(path)
        else:
            raise BadInput(f"{path} is neither a harbor task (no task.toml) nor a directory of "
                           "tasks; pass -p with one of those")
    return tasks, datasets


def agent_kwargs(options: RunOptions) -> dict[str, Any]:
    """The agent's keyword arguments for `options`, checked by the agent's own rules
    (`wmo_trio._agent_arguments`: document, provider kind and key, timeouts, backend),
    which need no harbor. Raises `BadInput`."""
    kind, slash, model = options.model.partition("/")
    if not slash or not kind or not model:
        raise BadInput(f"model {options.model!r} must be kind/model, e.g. {DEFAULT_MODEL}, "
                       "anthropic/claude-sonnet-4-5 or openai/<model>")
    named = sorted({"kind", "model"} & options.provider_settings.keys())
    if named:
        raise BadInput(f"--provider-config names the provider's {' and '.join(named)}, which "
                       f"-m gives (now {options.model}): pass -m <kind>/<model>, e.g. -m "
                       "anthropic/claude-sonnet-4-5, and only its settings in --provider-config")
    from wmo_trio._agent_arguments import parse_arguments, provider_for

    harness = options.harness or examples_dir() / "harness.json"
    kwargs: dict[str, Any] = {
        "harness": str(harness.resolve()),
        "provider_config": {"kind": kind, "model": model, **options.provider_settings},
        "episode_timeout_sec": options.episode_timeout_sec,
        "command_timeout_sec": options.command_timeout_sec,
        "episode_workers": max(options.concurrency, 1),
    }
    if options.backend is not None:
        kwargs["harness_backend"] = options.backend
    try:
        # Built only to be checked, as each trial's agent builds its own.
        provider_for(parse_arguments(kwargs), options.model).close()
    except ValueError as error:
        raise BadInput(_named_by_flag(str(error), options)) from None
    return kwargs


def _named_by_flag(message: str, options: RunOptions) -> str:
    """An agent argument's refusal, its `provider_config:` prefix named as this command's
    user gave it: by -m alone when they passed no --provider-config (the scripted
    model's check says `provider_config: scripted model 'online' does not exist`)."""
    argument, colon, rest = message.partition(": ")
    if colon and argument == "provider_config":
        given = "--provider-config" if options.provider_settings else f"-m {options.model}"
        return f"{given}: {rest}"
    return message


def _environment(name: str | None) -> dict[str, Any]:
    """The harbor `EnvironmentConfig` fields of the environment to run tasks in: an import
    path, or one of harbor's types (`BadInput` for another, or for Docker when its daemon
    does not answer)."""
    # harbor's enum of types is a module of its own: its job machinery stays unloaded.
    from harbor.models.environment_type import EnvironmentType

    if name is None:
        name = "docker" if docker_daemon_answers() else LOCAL_ENVIRONMENT
        if name == LOCAL_ENVIRONMENT:
            sys.stderr.write("wmo-trio: no Docker daemon answers; running tasks in the "
                             f"docker-free sandbox ({LOCAL_ENVIRONMENT}, see docs/sandbox.md)\n")
    if ":" in name:
        return {"import_path": name}
    try:
        kind = EnvironmentType(name)
    except ValueError:
        known = ", ".join(t.value for t in EnvironmentType)
        raise BadInput(f"unknown environment {name!r}; use a harbor type ({known}) or an import "
                       f"path such as {LOCAL_ENVIRONMENT}") from None
    if kind is EnvironmentType.DOCKER and not docker_daemon_answers():
        raise BadInput("the Docker daemon does not answer (docker info failed); start Docker, "
                       f"or run without Docker: -e {LOCAL_ENVIRONMENT}")
    return {"type": kind}


# The docker-free sandbox's import paths (harbor's name for it and its module's).
_DOCKER_FREE = frozenset({LOCAL_ENVIRONMENT, "wmo_trio.sandbox:LocalEnvironment"})


def _refuse_compose_tasks(tasks: list[Path], datasets: list[Path]) -> None:
    """`BadInput` naming the tasks whose environment is a Docker Compose file, which the
    docker-free sandbox cannot run: said before the job, not as a failed trial each."""
    candidates = tasks + [child for dataset in datasets for child in sorted(dataset.iterdir())
                          if (child / "task.toml").is_file()]
    compose = [task.name for task in candidates
               if (task / "environment" / "docker-compose.yaml").is_file()]
    if compose:
        named = ", ".join(compose[:5]) + (f" and {len(compose) - 5} more" if len(compose) > 5
                                          else "")
        several = len(compose) > 1
        raise BadInput(f"{len(compose)} task{'s' if several else ''} need{'' if several else 's'} "
                       f"Docker Compose ({named}), which the docker-free sandbox does not run: "
                       "run them with -e docker where a Docker daemon answers, or pass -p with "
                       "the other tasks only")


def build_job_config(options: RunOptions) -> Any:
    """Validate every option, then the harbor `JobConfig`. Raises `BadInput`.

    Every option is judged before this imports harbor's job machinery (the agent's
    arguments by the agent's own checks, which need none of it), so a bad one is refused
    at once, before a job directory exists."""
    tasks, datasets = _task_paths(options.paths)
    kwargs = agent_kwargs(options)
    for flag, value in (("-n (--n-concurrent)", options.concurrency),
                        ("-k (--n-attempts)", options.attempts)):
        if value < 1:
            raise BadInput(f"{flag} must be at least 1, got {value}")
    environment = _environment(options.environment)
    if environment.get("import_path") in _DOCKER_FREE:
        _refuse_compose_tasks(tasks, datasets)
    name = options.job_name or datetime.now().strftime("%Y-%m-%d__%H-%M-%S")
    if (options.jobs_dir / name).exists():
        raise BadInput(f"job directory {options.jobs_dir / name} already exists; pick another "
                       "--job-name")
    from harbor.models.job.config import DatasetConfig, JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    return JobConfig(
        job_name=name,
        jobs_dir=options.jobs_dir,
        n_attempts=options.attempts,
        n_concurrent_trials=options.concurrency,
        quiet=True,
        environment=EnvironmentConfig(**environment),
        # The model is wmo_trio's to serve (provider_config), not litellm's: without this,
        # harbor looks it up in litellm's tables and warns that it cannot resolve it.
        agents=[AgentConfig(import_path=AGENT_IMPORT_PATH, model_name=options.model,
                            kwargs=kwargs, skip_model_parsing=True)],
        tasks=[TaskConfig(path=path) for path in tasks],
        datasets=[DatasetConfig(path=path) for path in datasets],
    )


AGENT_TIMEOUT = "AgentTimeoutError"


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

    @property
    def timed_out(self) -> bool:
        """harbor's agent timeout: the candidate ran out of time and was still scored."""
        return self.exception == AGENT_TIMEOUT

    @property
    def errored(self) -> bool:
        """Any other exception (the trial broke: infrastructure, the agent, the verifier),
        or an episode that ended in ``error`` (the document's code or the episode raised,
        and the agent still returned): ``compare``'s ``errors`` counts the same."""
        return ((self.exception is not None and not self.timed_out)
                or self.stop_reason == StopReason.ERROR)


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (datetime.fromisoformat(end.replace("Z", "+00:00"))
            - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()


def trial_row(name: str, result: dict[str, Any]) -> TrialRow:
    """The row of a trial from its harbor `TrialResult`, as JSON data (its result.json)."""
    task = str(result.get("task_name") or name.rsplit("__", 1)[0])
    if not result.get("finished_at"):
        return TrialRow(name, task, done=False)
    rewards = (result.get("verifier_result") or {}).get("rewards") or {}
    agent = result.get("agent_result") or {}
    metadata = agent.get("metadata") or {}
    tokens = None
    if agent.get("n_input_tokens") is not None:
        tokens = (agent.get("n_input_tokens") or 0) + (agent.get("n_output_tokens") or 0)
    return TrialRow(
        name=name, task=task, done=True, reward=rewards.get("reward"),
        exception=(result.get("exception_info") or {}).get("exception_type"),
        stop_reason=metadata.get("stop_reason"), turns=metadata.get("turns"),
        tokens=tokens, seconds=_seconds(result.get("started_at"), result.get("finished_at")),
    )


def scan_job(job_dir: Path) -> list[TrialRow]:
    """The trials of a job directory as they stand now (finished or still running)."""
    rows: list[TrialRow] = []
    if not job_dir.is_dir():
        return rows
    for trial in sorted(p for p in job_dir.iterdir() if p.is_dir()):
        result_file = trial / "result.json"
        if not result_file.is_file():
            if (trial / "config.json").is_file():
                rows.append(TrialRow(trial.name, trial.name.rsplit("__", 1)[0], done=False))
            continue
        try:
            result = json.loads(result_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(result, dict):
            rows.append(trial_row(trial.name, result))
    return rows


# What each of harbor's trial events says a trial is doing now.
_PHASES = {
    "start": "starting",
    "environment-start": "starting its environment",
    "agent-start": "running the agent",
    "verification-start": "verifying",
    "cancel": "cancelling",
}


@dataclass
class JobProgress:
    """What `wmo-trio run` shows while its job runs, kept current by harbor's trial hooks
    (they run on harbor's loop, which is the trio thread: no lock is needed); with
    workers, also which worker runs each trial (`placed`)."""

    total: int
    stage: str = "creating the job: harbor's checks, the agent's preflight"
    phases: dict[str, str] = field(default_factory=dict)
    finished: dict[str, TrialRow] = field(default_factory=dict)
    interrupted: bool = False
    workers: dict[str, str] = field(default_factory=dict)

    async def placed(self, event: Any) -> None:
        """A trial event from a worker (`wmo_trio.cluster.FleetEvent`): where it runs."""
        self.workers[str(event.hook.trial_name)] = event.worker.label

    def watch(self, job: Any) -> None:
        """Register on a harbor `Job` (before it runs) the hooks that keep this current."""
        from harbor.trial.hooks import TrialEvent

        self.stage = "starting the first trials"

        async def on_event(event: Any) -> None:
            name = str(event.trial_name)
            if event.event is TrialEvent.END:
                self.phases.pop(name, None)
                self.finished[name] = trial_row(name, event.result.model_dump(mode="json"))
            elif name not in self.finished:
                self.phases[name] = _PHASES.get(str(event.event.value), str(event.event.value))

        for event in TrialEvent:
            if event.value in _PHASES or event is TrialEvent.END:
                job.add_hook(event, on_event)

    def render(self) -> Group:
        done = list(self.finished.values())
        rewards = [r.reward for r in done if r.reward is not None]
        table = Table(title="wmo-trio run", show_header=True)
        for column in ("done", "running", "timed out", "errors", "mean reward", "tokens"):
            table.add_column(column, justify="right")
        table.add_row(
            f"{len(done)}/{self.total}", str(len(self.phases)),
            str(sum(r.timed_out for r in done)), str(sum(r.errored for r in done)),
            f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
            f"{sum(r.tokens or 0 for r in done):,}",
        )
        status = Text(self.status(), style="dim")
        if not self.interrupted:
            return Group(table, status)
        return Group(table, status, Text("interrupted: cancelling the trials, each running agent "
                                         "writes its trace (Ctrl-C again to leave at once)",
                                         style="yellow"))

    def status(self) -> str:
        """One line on what the job is doing now, so a quiet start is never a mystery."""
        if not self.phases:
            return self.stage + " …" if len(self.finished) < self.total else "finishing the job …"
        counts: dict[str, int] = {}
        for phase in self.phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        parts = [f"{n} {phase}" + (" (a task's first trial builds its image)"
                                   if phase == "starting its environment" else "")
                 for phase, n in counts.items()]
        queued = self.total - len(self.finished) - len(self.phases)
        line = "now: " + ", ".join(parts) + (f"; {queued} queued" if queued > 0 else "")
        return line + running_on(self.phases, self.workers)


def running_on(running: Iterable[str], workers: dict[str, str]) -> str:
    """How many of the `running` trials each worker runs, as "; running on w1: 3, w2: 2"
    ("" when none is on a worker: a job in one process)."""
    where: dict[str, int] = {}
    for name in running:
        if name in workers:
            where[workers[name]] = where.get(workers[name], 0) + 1
    if not where:
        return ""
    return "; running on " + ", ".join(f"{label}: {n}" for label, n in sorted(where.items()))


def summary_table(rows: list[TrialRow], title: str = "trials") -> Table:
    table = Table(title=title, show_header=True)
    for column in ("trial", "reward", "stop reason", "turns", "tokens", "seconds", "exception"):
        # A narrow terminal wraps a name rather than cut it: trials are told apart by theirs.
        table.add_column(column, justify="left" if column in ("trial", "stop reason") else "right",
                         overflow="fold")
    for row in rows:
        table.add_row(
            row.name, "-" if row.reward is None else f"{row.reward:g}", row.stop_reason or "-",
            "-" if row.turns is None else str(row.turns),
            "-" if row.tokens is None else f"{row.tokens:,}",
            "-" if row.seconds is None else f"{row.seconds:.1f}", row.exception or "",
        )
    return table


def summary_line(rows: list[TrialRow]) -> str:
    """The job in one line: how many trials, their mean reward, timeouts and errors apart."""
    done = [r for r in rows if r.done]
    rewards = [r.reward for r in done if r.reward is not None]
    mean = f"mean reward {sum(rewards) / len(rewards):.3f}" if rewards else "no reward"
    timed_out, errored = sum(r.timed_out for r in done), sum(r.errored for r in done)
    return (f"{len(done)} trial{'' if len(done) == 1 else 's'}: {mean}, "
            f"{timed_out} timed out ({AGENT_TIMEOUT}, still scored), "
            f"{errored} error{'' if errored == 1 else 's'}")


def count_trials(config: Any) -> int:
    tasks = len(config.tasks)
    for dataset in config.datasets:
        tasks += sum((child / "task.toml").is_file() for child in Path(dataset.path).iterdir())
    return tasks * int(config.n_attempts)


class JobInterrupted(Exception):
    """The job was cancelled by Ctrl-C (or SIGTERM) and has ended: its trials are cancelled,
    each with its trace, and its result.json has its finished_at."""

    def __init__(self, job_dir: Path) -> None:
        super().__init__(f"interrupted: {job_dir}")
        self.job_dir = job_dir


def cluster_options(workers: str | None, ray_address: str | None) -> Any:
    """`--workers`/`--ray-address` checked, Ray's presence included (`BadInput`); None
    when the job runs in this process."""
    from wmo_trio.cluster import ClusterError, ClusterOptions, import_ray

    try:
        options = ClusterOptions.of(workers, ray_address)
        if options is not None:
            import_ray()
    except ClusterError as error:
        raise BadInput(str(error)) from None
    return options


def run_on_trio[T](afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`trio.run(afn, *args)`, an exception group that holds a single exception (however
    deeply) raised as that exception. trio's nurseries wrap whatever leaves their body in a
    group; the commands tell a refusal (`ClusterError`: exit code 2, its one line) from a
    failure by its type."""
    import trio

    try:
        return trio.run(afn, *args)
    except BaseExceptionGroup as group:
        lone: BaseException = group
        while isinstance(lone, BaseExceptionGroup) and len(lone.exceptions) == 1:
            lone = lone.exceptions[0]
        if lone is group:
            raise
        raise lone from None


async def run_with_progress(config: Any, console: Console, cluster: Any = None) -> Path:
    """Run the job on the trio host, showing live progress; returns the job directory.
    Raises `JobInterrupted` once the job has ended after a Ctrl-C (a second one ends the
    process at once, exit code 130).

    The display is transient: when the job ends it is cleared, and the caller prints the
    summary once. harbor's own bar is kept off the terminal meanwhile.

    With `cluster` (`wmo_trio.cluster.ClusterOptions`) the trials run on its workers; a
    Ctrl-C then stops each running trial on its worker as harbor stops one, writes its
    directory here, and ends the workers and an embedded Ray before `JobInterrupted`."""
    import trio

    from wmo_trio.cli._interrupt import cancelled_on_interrupt, leave_now
    from wmo_trio.harbor._job import harbor_progress_hidden, record_interrupted_end, run_job

    job_dir = Path(config.jobs_dir) / str(config.job_name)
    progress = JobProgress(count_trials(config))
    with harbor_progress_hidden(), Live(progress.render(), console=console,
                                        refresh_per_second=4, transient=True) as live:
        def on_first() -> None:
            progress.interrupted = True
            live.update(progress.render())

        def leave() -> NoReturn:
            live.stop()
            leave_now(job_dir)

        async with cancelled_on_interrupt(on_first, leave) as interrupt, \
                trio.open_nursery() as nursery:
            async def show() -> None:
                while True:
                    live.update(progress.render())
                    await trio.sleep(0.25)

            nursery.start_soon(show)
            if cluster is None:
                await run_job(config, on_create=progress.watch)
            else:
                await run_job(config, on_create=progress.watch, workers=cluster.workers,
                              ray_address=cluster.ray_address, on_event=progress.placed)
            nursery.cancel_scope.cancel()
    if interrupt.received:
        record_interrupted_end(job_dir)
        raise JobInterrupted(job_dir)
    return job_dir


def interrupted_line(job_dir: Path) -> str:
    """The one line `wmo-trio run` ends with after a Ctrl-C: how far the job got, where it is."""
    rows = scan_job(job_dir)
    cancelled = [r for r in rows if r.exception == "CancelledError"]
    done = sum(r.done for r in rows) - len(cancelled)
    count = f"{done} trial{'' if done == 1 else 's'} finished"
    if cancelled:
        traced = sum((job_dir / r.name / "agent" / "wmo-run.json").is_file() for r in cancelled)
        count += f", {len(cancelled)} cancelled " + (
            "(each with its trace)" if traced == len(cancelled) else
            "(before their agent ran: no trace)" if traced == 0 else
            f"({traced} with a trace, the others before their agent ran)")
    return f"interrupted: {count}; job directory: {job_dir.resolve()}"
