"""The research API's race: candidates raced over episodes of `open_episode_pool`, for
harnesses that score their own episodes (no harbor, no verifier)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import outcome

from wmo_trio.harness import HarnessDoc, harness_from
from wmo_trio.models import RunResult
from wmo_trio.race._ledger import (
    Attempt,
    RaceError,
    RaceLedger,
    Round,
    default_batch,
    task_order,
)
from wmo_trio.race._report import RaceReport
from wmo_trio.research import EpisodeSpec, TrioEnvironment, open_episode_pool
from wmo_trio.settings import DEFAULT_EPISODE_TIMEOUT_SEC

Score = Callable[[TrioEnvironment, RunResult], float | Awaitable[float | None] | None]


@dataclass(frozen=True)
class RaceTask:
    """A task of a research race: its `instruction`, a factory of a fresh `environment`
    for each episode, and `score`, the caller's verdict on an episode (a reward in
    [0, 1], or None for none), given the environment the episode ran in and its result."""

    name: str
    instruction: str
    environment: Callable[[], TrioEnvironment]
    score: Score


async def race_rounds(
    candidates: Sequence[HarnessDoc | Mapping[str, Any] | str | Path],
    tasks: Sequence[RaceTask],
    *,
    provider: Any,
    alpha: float = 0.05,
    attempts: int = 1,
    seed: int = 0,
    max_trials: int | None = None,
    baseline: int | None = None,
    familywise: bool = False,
    limit: int = 32,
    episode_timeout: float = DEFAULT_EPISODE_TIMEOUT_SEC,
    backend: str | None = None,
    workers: int | str | None = None,
    ray_address: str | None = None,
) -> AsyncIterator[RaceReport]:
    """Race `candidates` (documents, as `EpisodePool.run` takes them) on `tasks`, yielding
    the report after every round; the last one is the finished race. `baseline` is the
    index of the incumbent among `candidates`; `familywise` chooses the closure's control
    over the per-candidate one (docs/race.md); `limit` bounds the episodes run at once,
    `episode_timeout` and `backend` are `EpisodePool.run`'s. Raises `RaceError` before any episode runs
    for input a race cannot use (fewer than two different documents among them).

    `workers` / `ray_address` run the episodes on Ray worker processes, as
    `open_episode_pool` takes them (one pool for the whole race). Each episode then runs
    in a copy of its environment sent to a worker, while `score` is called here with the
    object the task's factory made: a score that reads what the episode left must find it
    where both see it (a `DirectoryEnvironment`'s directory, with workers of this machine).

    Cancelling the iteration's scope cancels the round's episodes, with the pool's
    guarantees (stopped, waited for, traces written).
    """
    docs = [value if isinstance(value, HarnessDoc) else harness_from(value)
            for value in candidates]
    keys = [doc.doc_hash for doc in docs]
    if len(set(keys)) != len(keys):
        raise RaceError("two candidates are one document (one doc_hash); give each once")
    by_name = {task.name: task for task in tasks}
    if len(by_name) != len(tasks):
        raise RaceError("two tasks have one name; give each task its own")
    ledger = RaceLedger({doc.doc_hash: doc.name for doc in docs}, task_order(list(by_name), seed),
                        alpha=alpha, attempts=attempts, seed=seed, max_trials=max_trials,
                        baseline=None if baseline is None else keys[baseline],
                        familywise=familywise)
    async with open_episode_pool(limit, workers=workers, ray_address=ray_address) as pool:
        def next_round() -> Round | None:
            return ledger.next_round(default_batch(limit, len(ledger.running), attempts))

        played = next_round()
        while played is not None:
            specs: dict[int, tuple[str, RaceTask, TrioEnvironment]] = {}
            runs = []
            for key in played.candidates:
                for name in played.tasks:
                    task = by_name[name]
                    for _ in range(attempts):
                        environment = task.environment()
                        spec = EpisodeSpec(docs[keys.index(key)], provider, task.instruction,
                                           environment, task_id=name,
                                           episode_timeout=episode_timeout, backend=backend)
                        specs[id(spec)] = (key, task, environment)
                        runs.append(spec)
            outcomes: dict[tuple[str, str], list[Attempt]] = {}
            async with pool.fan_out(runs) as results:
                async for spec, result in results:
                    key, task, environment = specs[id(spec)]
                    attempt = await _scored(task, environment, result)
                    outcomes.setdefault((key, task.name), []).append(attempt)
            ledger.record(played, outcomes)
            played = next_round()  # decides first, so the last report says the race ended
            yield ledger.report()


async def race(*args: Any, **kwargs: Any) -> RaceReport:
    """`race_rounds` to its end: the finished race's report."""
    report: RaceReport | None = None
    async for report in race_rounds(*args, **kwargs):  # noqa: B007 - the last one is kept
        pass
    if report is None:
        raise RaceError("the race ran no round")
    return report


async def _scored(task: RaceTask, environment: TrioEnvironment,
                  result: outcome.Outcome[RunResult]) -> Attempt:
    """An episode's attempt: the caller's score of its result, or, for an episode that
    raised (or a score that did), no reward and the exception's type."""
    if isinstance(result, outcome.Error):
        return Attempt(None, type(result.error).__name__)
    try:
        value = task.score(environment, result.unwrap())
        if inspect.isawaitable(value):
            value = await value
    except Exception as error:
        return Attempt(None, type(error).__name__)
    return Attempt(None if value is None else float(value))
