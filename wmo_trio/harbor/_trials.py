"""Running explicit harbor trials into a job directory: the seam a race runs its rounds
through.

A `TrialRunner` takes harbor `TrialConfig`s (each names its `trials_dir`: the job
directory) and returns their `TrialResult`s in the same order, each trial written by
harbor's own `Trial` as in any job (`<job>/<trial>/result.json`, the agent's logs). This
module's `run_trials_here` runs them in this process with harbor's `TrialQueue` (its
concurrency bound, retries and hooks) on trio-asyncio's loop; a `TrialFleet`'s
`run_trials` (`wmo_trio.cluster`) runs them on Ray worker processes and keeps the same
contract: same order, same files, and on cancellation the trials stopped and waited for
before it returns. `open_trial_runner` gives the one or the other for a job's options.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from wmo_trio.engine import run_asyncio

if TYPE_CHECKING:
    from wmo_trio.cluster import ClusterOptions

# A callback for harbor's trial events (`TrialHookEvent`), run on harbor's loop.
TrialWatcher = Callable[[Any], Awaitable[None]]
# Told a trial's name and the label of the worker process it runs on, as it starts there.
TrialPlacement = Callable[[str, str], None]


class TrialRunner(Protocol):
    async def __call__(self, configs: Sequence[Any], *, concurrency: int,
                       watch: TrialWatcher | None = None,
                       placed: TrialPlacement | None = None) -> list[Any]:
        """Run `configs` (harbor `TrialConfig`s), at most `concurrency` at a time, and
        return their `TrialResult`s in order; `watch` sees every trial event, and `placed`
        where each trial runs (never called when every trial runs in this process)."""
        ...


async def run_trials_here(configs: Sequence[Any], *, concurrency: int,
                          watch: TrialWatcher | None = None,
                          placed: TrialPlacement | None = None) -> list[Any]:
    """From trio: run harbor trials in this process with harbor's `TrialQueue` and return
    their results in the order of `configs`.

    Cancelling the calling trio scope cancels the trials: harbor records each as
    cancelled (`CancelledError` in its result.json) and stops its environment, and this
    returns only after every one has finished doing so.
    """
    from harbor.trial.hooks import TrialEvent
    from harbor.trial.queue import TrialQueue

    async def run_all() -> list[Any]:
        import asyncio

        queue = TrialQueue(n_concurrent=concurrency)
        if watch is not None:
            for event in TrialEvent:
                queue.add_hook(event, watch)
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coro) for coro in queue.submit_batch(list(configs))]
        return [task.result() for task in tasks]

    return await run_asyncio(run_all)


@asynccontextmanager
async def open_trial_runner(config: Any, cluster: ClusterOptions | None = None
                            ) -> AsyncIterator[TrialRunner]:
    """The trial runner for this block, for trials of the harbor `JobConfig` `config`:
    `run_trials_here` without `cluster`; with it, the `run_trials` of a `TrialFleet` on
    the workers it names, opened once for the block. Every worker has then loaded each of
    `config`'s agents and its environment before the block starts (a `ClusterError` in one
    line otherwise, before any trial); leaving the block stops the workers, and an
    embedded Ray, whether it ends normally, raises or is cancelled."""
    if cluster is None:
        yield run_trials_here
        return
    from wmo_trio.cluster import open_trial_fleet

    async with open_trial_fleet(cluster, concurrency=config.n_concurrent_trials,
                                agents=config.agents, environment=config.environment) as fleet:
        yield fleet.run_trials
