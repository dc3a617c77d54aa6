"""The worker side of a trial fleet: a Ray actor (one worker process) that runs harbor's
own trials, many at once on the actor's asyncio loop, each in a scratch directory of its
machine, and hands back each trial's directory as bounded data.

What crosses between the driver and a worker is the pydantic data below. A worker is
told the trial's `TrialConfig` as harbor wrote it, with the agent's document inline and
the task, when it is a directory of the driver's, as a packed tree it unpacks once (no
shared filesystem); it runs the trial with harbor's `TrialQueue` (harbor's retries and
hooks), records each of harbor's trial events for the driver to collect, and returns the
trial's directory, which it then removes.

Only the driver decides when trials stop (`cancel`, then `close`), so that each stops as
harbor stops a trial (its environment stopped, its trace written): Ray starts every worker
process in a process group of its own, which a Ctrl-C at the driver's terminal does not
reach.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from wmo_trio.cluster._tree import DEFAULT_TREE_LIMIT_BYTES, PackedTree, pack, unpack
from wmo_trio.cluster._workers import WorkerInfo, this_worker
from wmo_trio.sandbox._hostfs import remove_tree

# A trial event holds the trial's config and its result so far: kilobytes.
MAX_EVENT_BYTES = 4 << 20


class WorkerCheck(BaseModel):
    """What every worker must be able to load before any trial starts: the agents'
    classes and the environment (its class, and its own preflight on that machine)."""

    model_config = ConfigDict(frozen=True)

    agents_json: list[str] = Field(default_factory=list)
    environment_json: str | None = None


class EventRecord(BaseModel):
    """One of harbor's trial events (`TrialHookEvent`, as JSON) as a worker saw it."""

    model_config = ConfigDict(frozen=True)

    trial_name: str
    seq: int
    event_json: str = Field(max_length=MAX_EVENT_BYTES)


class TrialRequest(BaseModel):
    """One trial for a worker: its config as the worker runs it, harbor's retry policy,
    the packed task's digest (None: the worker's harbor fetches the task itself), and the
    bound on the trial directory it returns."""

    model_config = ConfigDict(frozen=True)

    config_json: str
    retry_json: str | None = None
    task_digest: str | None = None
    limit_bytes: int = DEFAULT_TREE_LIMIT_BYTES


class TrialReturn(BaseModel):
    """A trial as its worker ended it: its directory (with harbor's `result.json`), the
    trial's events, whether it was cancelled, and the error and trace when harbor's trial
    machinery itself raised."""

    files: PackedTree
    events: list[EventRecord] = Field(default_factory=list)
    cancelled: bool = False
    error: str | None = None
    error_trace: str | None = None
    worker: WorkerInfo


class TrialWorker:
    """A Ray actor: one worker process of a fleet (see the module docstring). Methods are
    coroutines on the actor's asyncio loop; `run_trial` calls run concurrently."""

    def __init__(self, index: int, fleet_id: str, check: WorkerCheck) -> None:
        # litellm (which harbor imports) otherwise fetches a price list at import.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        self._root = Path(tempfile.gettempdir()) / f"wmo-trio-fleet-{fleet_id}-{index}"
        remove_tree(self._root)  # what an earlier process of this worker left (Ray restarted it)
        self._root.mkdir(parents=True)
        self._seq = itertools.count()
        self._undrained: list[EventRecord] = []
        self._events: dict[str, list[EventRecord]] = {}
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._tasks: dict[str, asyncio.Future[Path]] = {}
        try:
            _load(check)
        except Exception as error:
            self._info = this_worker(index, error)
        else:
            self._info = this_worker(index)

    async def ready(self) -> WorkerInfo:
        return self._info

    async def drain_events(self) -> list[EventRecord]:
        """The events recorded since the last call."""
        events, self._undrained = self._undrained, []
        return events

    async def cancel(self, trial_names: list[str] | None = None) -> None:
        """Cancel these running trials (None: every one), as harbor cancels a trial; each
        `run_trial` call then returns its cancelled trial."""
        for name, task in list(self._running.items()):
            if trial_names is None or name in trial_names:
                task.cancel()

    async def close(self) -> None:
        """Cancel what still runs, wait for it, and remove this worker's scratch directory."""
        await self.cancel()
        if self._running:
            await asyncio.wait(list(self._running.values()))
        await asyncio.to_thread(remove_tree, self._root)

    async def run_trial(self, request: TrialRequest, task: list[Any]) -> TrialReturn:
        """Run one trial to its end (or its cancellation) and return it. `task` holds the
        reference to the packed task, unresolved: it is fetched only the first time."""
        from harbor.models.job.config import RetryConfig
        from harbor.models.trial.config import TrialConfig
        from harbor.trial.hooks import TrialEvent
        from harbor.trial.queue import TrialQueue

        config = TrialConfig.model_validate_json(request.config_json)
        name = config.trial_name
        trials_dir = self._root / "trials" / name
        self._events[name] = []
        try:
            if request.task_digest is not None and config.task.path is not None:
                path = await self._task(request.task_digest, task[0], config.task.path.name)
                config = config.model_copy(update={"task": config.task.model_copy(update={"path": path})})
            config = config.model_copy(update={"trials_dir": trials_dir})
            retry = (RetryConfig.model_validate_json(request.retry_json)
                     if request.retry_json else None)
            queue = TrialQueue(n_concurrent=1, retry_config=retry,
                               hooks={event: [self._record] for event in TrialEvent})
            running = self._running[name] = asyncio.ensure_future(queue.submit(config))
        except Exception as failed:
            return self._returned(name, trials_dir, None, request.limit_bytes, error=failed)
        try:
            await asyncio.wait([running])  # cancel() cancels the trial, not this call
        except asyncio.CancelledError:
            running.cancel()
            while not running.done():
                try:
                    await asyncio.wait([running])
                except asyncio.CancelledError:
                    continue
            raise
        finally:
            self._running.pop(name, None)
        cancelled = running.cancelled()
        error = None if cancelled else running.exception()
        return await asyncio.to_thread(self._returned, name, trials_dir, cancelled,
                                       request.limit_bytes, error=error)

    def _returned(self, name: str, trials_dir: Path, cancelled: bool | None, limit: int,
                  error: BaseException | None = None) -> TrialReturn:
        trial_dir = trials_dir / name
        files = pack(trial_dir, limit=limit) if trial_dir.is_dir() else PackedTree()
        remove_tree(trials_dir)
        return TrialReturn(
            files=files, events=self._events.pop(name, []), cancelled=bool(cancelled),
            error=None if error is None else f"{type(error).__name__}: {error}",
            error_trace=None if error is None else "".join(traceback.format_exception(error)),
            worker=self._info)

    async def _record(self, event: Any) -> None:
        """harbor's hook for every trial event: kept for the driver."""
        record = EventRecord(trial_name=event.trial_name, seq=next(self._seq),
                             event_json=event.model_dump_json())
        self._undrained.append(record)
        self._events.setdefault(event.trial_name, []).append(record)

    async def _task(self, digest: str, reference: Any, name: str) -> Path:
        """The task's directory on this machine, unpacked once per digest."""
        if digest not in self._tasks:
            loaded = self._tasks[digest] = asyncio.get_running_loop().create_future()
            try:
                tree: PackedTree = await reference
                target = self._root / "tasks" / digest / name
                await asyncio.to_thread(unpack, tree, target)
                loaded.set_result(target)
            except BaseException as error:
                del self._tasks[digest]
                loaded.set_exception(error)
                raise
        return await asyncio.shield(self._tasks[digest])


def _load(check: WorkerCheck) -> None:
    """Import the agents and the environment as harbor will, and run the environment's
    preflight (a Docker daemon, the docker-free sandbox) on this machine. Importing the
    agents also installs what wmo_trio's agent changes in harbor (its trial locks name the
    document by hash) before the first trial's lock is written."""
    from harbor.agents.factory import AgentFactory
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig

    for agent in check.agents_json:
        AgentFactory.get_agent_class_from_config(AgentConfig.model_validate_json(agent))
    if check.environment_json is not None:
        environment = EnvironmentConfig.model_validate_json(check.environment_json)
        EnvironmentFactory.run_preflight(type=environment.type, import_path=environment.import_path)
