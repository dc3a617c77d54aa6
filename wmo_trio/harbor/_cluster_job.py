"""One harbor job on the workers of a trial fleet: harbor's own `Job` on this machine
(its plan, its records, `result.json` with its stats, `harbor jobs resume`), its trials
run by harbor's own trial machinery on the workers (`wmo_trio.cluster`).

harbor 0.25 has no extension point for where a job's trials run: a `Job` hands every
trial to its `TrialQueue` (`Job._trial_queue`), whose `_run_trial` runs it in this
process. This module is the one place that reaches in: it swaps that queue for one whose
`_run_trial` sends the trial to the fleet and fires the job's hooks (harbor's progress and
stats, the caller's) with each event the worker saw. `require_harbor_queue` fails loudly
when a harbor release moves what it relies on (tests/test_harbor_internals.py runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio_asyncio
from harbor.job import Job
from harbor.trial.queue import TrialQueue

from wmo_trio.cluster import ClusterOptions, FleetCallback, FleetEvent, TrialFleet, open_trial_fleet
from wmo_trio.engine import run_asyncio


def require_harbor_queue(job: Any) -> TrialQueue:
    """The `TrialQueue` a harbor `Job` runs its trials through, or a `RuntimeError`
    saying this harbor release is not the one wmo_trio's workers are built for."""
    queue = getattr(job, "_trial_queue", None)
    if not isinstance(queue, TrialQueue) or not isinstance(getattr(queue, "_hooks", None), dict) \
            or not callable(getattr(queue, "_run_trial", None)):
        raise RuntimeError("this harbor release runs a job's trials otherwise than harbor 0.25 "
                           "(Job._trial_queue); wmo_trio's workers need harbor 0.25")
    return queue


class FleetTrialQueue(TrialQueue):  # type: ignore[misc]
    """harbor's `TrialQueue` whose trials run on a `TrialFleet`; harbor's concurrency
    bound (`-n`) and the job's hooks stay as they were."""

    def __init__(self, fleet: TrialFleet, replaced: TrialQueue, on_event: FleetCallback | None) -> None:
        super().__init__(n_concurrent=replaced._n_concurrent, retry_config=replaced._retry_config,
                         hooks=replaced._hooks)
        self._fleet = fleet
        self._on_event = on_event
        # The job's hooks run on this loop, whichever trio task delivers an event.
        self._loop = trio_asyncio.current_loop.get()

    async def _run_trial(self, trial_config: Any) -> Any:
        async with self._semaphore:
            return await trio_asyncio.trio_as_aio(self._fleet.run_trial)(
                trial_config, self._forward, retry=self._retry_config)

    async def _forward(self, event: FleetEvent) -> None:
        """In trio: the job's hooks for this event (harbor's asyncio coroutines), then the
        caller's."""
        for hook in self._hooks[event.hook.event]:
            await trio_asyncio.aio_as_trio(hook, loop=self._loop)(event.hook)
        if self._on_event is not None:
            await self._on_event(event)


async def run_job_on_fleet(config: Any, options: ClusterOptions, *,
                           on_create: Callable[[Any], None] | None = None,
                           on_event: FleetCallback | None = None) -> Any:
    """From trio: harbor's `Job` for `config` with its trials on the workers `options`
    name; its `JobResult`. Workers are started, and must load the agents and the
    environment, before the job is created (a `ClusterError` otherwise, and no job
    directory). Cancelling the calling scope cancels the job: each running trial is
    cancelled on its worker as harbor cancels one, its directory written here, then the
    workers and an embedded cluster are stopped."""
    async with open_trial_fleet(options, concurrency=config.n_concurrent_trials,
                                agents=config.agents, environment=config.environment) as fleet:

        async def create_and_run() -> Any:
            job = await Job.create(config)
            job._trial_queue = FleetTrialQueue(fleet, require_harbor_queue(job), on_event)
            if on_create is not None:
                on_create(job)
            return await job.run()

        return await run_asyncio(create_and_run)
