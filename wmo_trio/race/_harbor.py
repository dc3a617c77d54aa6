"""A race as one harbor job directory: rounds of ordinary harbor trials, run through a
`TrialRunner` (wmo_trio.harbor._trials), the race's state beside them.

The directory holds what a harbor job's does (`config.json` naming every candidate as an
agent and every task, `lock.json` and `result.json` for the trials run so far, a directory
per trial) and `race.json`, the `RaceReport` so far, rewritten after every round and when
the race is interrupted. `wmo-trio compare`, `wmo-trio trace` and harbor's viewer read it
as any job; `harbor job resume` would run the rest of the full evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from wmo_trio.harbor._trials import TrialRunner, TrialWatcher, run_trials_here
from wmo_trio.race._ledger import Attempt, RaceError, RaceLedger, default_batch, task_order
from wmo_trio.race._report import RACE_FILENAME, RaceReport

RESOLVING = "resolving the tasks (harbor's plan, the agents' preflight)"


@dataclass
class HarborRace:
    """What a race runs: a harbor `JobConfig` whose agents are the candidates, in order,
    and each candidate's key (doc_hash) and name."""

    config: Any
    keys: list[str]
    names: list[str]
    alpha: float = 0.05
    seed: int = 0
    max_trials: int | None = None
    baseline: str | None = None
    familywise: bool = False

    @property
    def job_dir(self) -> Path:
        return Path(self.config.jobs_dir) / str(self.config.job_name)


@dataclass
class RaceProgress:
    """What the live display reads: the ledger, and the trials of the round running."""

    ledger: RaceLedger | None = None
    stage: str = RESOLVING
    running: dict[str, str] = field(default_factory=dict)  # trial name -> phase
    round_trials: int = 0
    round_done: int = 0
    workers: dict[str, str] = field(default_factory=dict)  # trial name -> worker, on Ray

    def placed(self, trial: str, worker: str) -> None:
        self.workers[trial] = worker


def _task_labels(task_configs: Sequence[Any]) -> list[str]:
    """A name per task, as trials name them; a name given twice gets its place after it."""
    names = [str(task.get_task_id().get_name()).split("/")[-1] for task in task_configs]
    return [name if names.count(name) == 1 else f"{name}#{i}" for i, name in enumerate(names)]


async def run_race(race: HarborRace, *, runner: TrialRunner = run_trials_here,
                   progress: RaceProgress | None = None,
                   on_round: Callable[[RaceReport], None] | None = None) -> RaceReport:
    """From trio: run the race into its job directory and return its report.

    Cancelling the calling scope stops the round in flight (the runner cancels its
    trials, which harbor records as cancelled), writes the race so far (`finished`
    false, `stop_reason` "interrupted") and lets the cancellation go on.
    """
    from harbor.agents.factory import AgentFactory
    from harbor.job_plan import JobPlan

    from wmo_trio.engine import run_asyncio

    progress = progress or RaceProgress()
    progress.stage = RESOLVING
    config = _documents_inline(race)
    for agent in config.agents:
        AgentFactory.run_preflight(agent, skip_credential_checks=config.skip_credential_checks)
    plan = await run_asyncio(JobPlan.from_config, config)
    labels = _task_labels(plan.task_configs)
    templates: dict[tuple[int, int], Any] = {}
    for trial in plan.trial_configs:
        templates.setdefault((_index(config.agents, trial.agent),
                              _index(plan.task_configs, trial.task)), trial)
    ledger = RaceLedger(dict(zip(race.keys, race.names, strict=True)),
                        task_order(labels, race.seed), alpha=race.alpha,
                        attempts=config.n_attempts, seed=race.seed,
                        max_trials=race.max_trials, baseline=race.baseline,
                        familywise=race.familywise)
    progress.ledger = ledger
    job = _JobFiles(race.job_dir, plan, config)
    job.start()
    watch = _watcher(progress)
    try:
        while (played := ledger.next_round(default_batch(
                config.n_concurrent_trials, len(ledger.running), config.n_attempts))) is not None:
            configs: list[Any] = []
            owners: dict[str, tuple[str, str]] = {}
            for key in played.candidates:
                agent = race.keys.index(key)
                for task in played.tasks:
                    template = templates[(agent, labels.index(task))]
                    for _ in range(config.n_attempts):
                        trial = template.model_copy(
                            update={"trial_name": template.generate_trial_name()})
                        configs.append(trial)
                        owners[trial.trial_name] = (key, task)
            progress.stage = f"round {played.number}"
            progress.round_trials, progress.round_done = len(configs), 0
            results = await runner(configs, concurrency=config.n_concurrent_trials,
                                   watch=watch, placed=progress.placed)
            job.add(results)
            ledger.record(played, _attempts(race.job_dir, owners))
            job.write(ledger.report(), finished=False)
            if on_round is not None:
                on_round(ledger.report())
    except BaseException:
        ledger.interrupt()
        job.write(ledger.report(), finished=False, note=(
            "interrupted: the trials of the round in flight are in the directory (cancelled "
            "or finished) and not counted"))
        raise
    report = ledger.report()
    job.write(report, finished=True)
    return report


def _documents_inline(race: HarborRace) -> Any:
    """The race's job configuration with each candidate's document given inline (its JSON
    fields in the agent's `harness` argument), read once now. A document passed by path is
    read again by every trial's agent: a file edited during the race would change the
    candidate under way (and the agent, finding the doc_hash pinned at preflight no longer
    matching, would fail its trial's construction, and with it the round). Raises
    `RaceError` when a file no longer holds the document the race was given."""
    from wmo_trio.harness import HarnessError, harness_from

    config = race.config.model_copy(deep=True)
    for agent, key, name in zip(config.agents, race.keys, race.names, strict=True):
        try:
            doc = harness_from((agent.kwargs or {}).get("harness"))
        except HarnessError as error:
            raise RaceError(f"candidate {name}: {error}") from None
        if doc.doc_hash != key:
            raise RaceError(f"candidate {name}: its document is now {doc.doc_hash}, not the "
                            f"{key} the race was given (the file changed); start the race "
                            "again")
        agent.kwargs = {**agent.kwargs, "harness": doc.model_dump(mode="json",
                                                                  exclude_none=True)}
    return config


def _index(items: Sequence[Any], item: Any) -> int:
    return next(i for i, known in enumerate(items) if known == item)


def _watcher(progress: RaceProgress) -> TrialWatcher:
    from harbor.trial.hooks import TrialEvent

    async def watch(event: Any) -> None:
        name = str(event.trial_name)
        if event.event is TrialEvent.END:
            progress.running.pop(name, None)
            progress.workers.pop(name, None)
            progress.round_done += 1
        elif event.event in (TrialEvent.START, TrialEvent.ENVIRONMENT_START,
                             TrialEvent.AGENT_START, TrialEvent.VERIFICATION_START):
            progress.running[name] = str(event.event.value)

    return watch


def _attempts(job_dir: Path, owners: dict[str, tuple[str, str]]
              ) -> dict[tuple[str, str], list[Attempt]]:
    """The round's trials as the race reads them, through `wmo_trio.compare`'s reading of
    job directories (its reward rule, bounds and refusal of links), matched by trial name
    (a trial's candidate is the one the race gave it, whatever compare keys it by)."""
    from wmo_trio.compare import load_jobs

    attempts: dict[tuple[str, str], list[Attempt]] = {}
    for record in load_jobs([job_dir]):
        owner = owners.get(record.trial)
        if owner is not None:
            attempts.setdefault(owner, []).append(Attempt(record.reward, record.exception))
    return attempts


class _JobFiles:
    """The job directory's harbor files and race.json, written as harbor's `Job` writes
    its own (config.json once, lock.json and result.json as trials end)."""

    def __init__(self, job_dir: Path, plan: Any, config: Any) -> None:
        self.job_dir, self.plan, self.config = job_dir, plan, config
        self.results: list[Any] = []
        self.started_at = datetime.now()

    def start(self) -> None:
        self.job_dir.mkdir(parents=True, exist_ok=False)
        (self.job_dir / "config.json").write_text(
            self.config.model_dump_json(indent=4, exclude_defaults=True))
        self._harbor_files(finished=False)

    def add(self, results: Sequence[Any]) -> None:
        self.results.extend(results)

    def write(self, report: RaceReport, *, finished: bool, note: str | None = None) -> None:
        if note is not None:
            report = report.model_copy(update={"note": note})
        self._harbor_files(finished=finished)
        _write_atomically(self.job_dir / RACE_FILENAME, report.model_dump_json(indent=2))

    def _harbor_files(self, *, finished: bool) -> None:
        from harbor.models.job.lock import build_job_lock

        result = self.plan.aggregate(self.results, started_at=self.started_at,
                                     n_total_trials=len(self.results))
        if not finished:
            result.finished_at = None  # harbor's viewer reads a set finished_at as done
        _write_atomically(self.job_dir / "result.json",
                          result.model_dump_json(indent=4, exclude={"trial_results"}))
        configs = [r.config for r in self.results]
        lock = build_job_lock(config=self.config, trial_configs=configs,
                              task_download_results=self.plan.task_download_results)
        _write_atomically(self.job_dir / "lock.json",
                          lock.model_dump_json(indent=4, exclude_none=True))


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def read_race(job_dir: Path) -> RaceReport:
    """The race.json of a race's job directory (the race so far, or finished)."""
    from wmo_trio._files import read_bounded

    return RaceReport.model_validate(json.loads(read_bounded(job_dir / RACE_FILENAME,
                                                             16 * 2**20)))
