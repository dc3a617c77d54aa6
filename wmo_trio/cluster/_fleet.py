"""The driver side of a trial fleet: harbor `TrialConfig`s run on worker processes (Ray
actors, `_trial_worker`), each trial's directory written back under its `trials_dir` on
this machine as harbor writes it in one process.

    async with open_trial_fleet(options, concurrency=64, agents=[...], environment=...) as fleet:
        result = await fleet.run_trial(trial_config, on_event=show)   # harbor's TrialResult

Trials go to whichever worker has a free place (at most `concurrency` in all, shared
evenly). A worker process that dies is restarted by Ray, which runs its unfinished trials
again there (`MAX_RESTARTS`, `CALL_RETRIES`); a trial whose worker is lost beyond that
ends as an error with a trace. Every trial ends exactly once, with one directory.

A trial's directory comes back as bounded data (`_tree`) and is then made harbor's own
again: its `config.json`, `result.json` and `lock.json` name the driver's task path and
trial directory, as in a one-process job, and so does the agent's `wmo-run.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import traceback
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

from wmo_trio._files import read_bounded
from wmo_trio.cluster._ray_wait import ray_value
from wmo_trio.cluster._session import (
    Cluster,
    ClusterError,
    ClusterOptions,
    WorkerLostError,
    open_cluster,
)
from wmo_trio.cluster._tree import DEFAULT_TREE_LIMIT_BYTES, PackedTree, pack, unpack
from wmo_trio.cluster._trial_worker import (
    MAX_EVENT_BYTES,
    EventRecord,
    TrialRequest,
    TrialReturn,
    TrialWorker,
    WorkerCheck,
)
from wmo_trio.cluster._workers import (
    CALL_RETRIES,
    WorkerInfo,
    cancelled_call,
    start_workers,
    started,
    stop_workers,
)
from wmo_trio.sandbox._hostfs import remove_tree

log = logging.getLogger("wmo_trio.cluster")

POLL_S = 0.5  # how often running trials' events are collected for the caller
_HARBOR_FILE_BYTES = 16 << 20  # result.json, config.json, lock.json, a trace: far less


@dataclass(frozen=True)
class FleetEvent:
    """One of harbor's trial events (`TrialHookEvent`, its paths the driver's), and the
    worker it happened on."""

    worker: WorkerInfo
    hook: Any


FleetCallback = Callable[[FleetEvent], Awaitable[None]]


@dataclass
class _InFlight:
    config: Any
    on_event: FleetCallback | None
    worker: WorkerInfo
    delivered: int = -1
    last_result: Any = None
    lock: trio.Lock = field(default_factory=trio.Lock)


class TrialFleet:
    """harbor trials on the workers of a cluster; made by `open_trial_fleet`."""

    def __init__(self, cluster: Cluster, handles: list[Any], infos: list[WorkerInfo],
                 slots: int, limit_bytes: int) -> None:
        self.cluster = cluster
        self.workers = infos
        self.slots_per_worker = slots
        self._handles = handles
        self._limit = limit_bytes
        self._in_flight: dict[str, _InFlight] = {}
        self._portable: dict[str, Any] = {}
        self._tasks: dict[Path, tuple[str, Any]] = {}
        self._task_lock = trio.Lock()
        order = [index for _ in range(slots) for index in range(len(handles))]
        self._free_send, self._free = trio.open_memory_channel[int](len(order))
        for index in order:
            self._free_send.send_nowait(index)

    async def run_trial(self, config: Any, on_event: FleetCallback | None = None, *,
                        retry: Any = None) -> Any:
        """Run harbor's trial for `config` (a `TrialConfig`) on a worker with a free place
        and return its `TrialResult`; its directory is then
        `config.trials_dir / config.trial_name` on this machine. `on_event` gets each of
        harbor's trial events in order, `END` last with the result; `retry` is harbor's
        `RetryConfig` for the trial (the job's).

        If the calling scope is cancelled, the trial is cancelled on its worker as harbor
        cancels one (environment stopped, trace written), its directory is written here,
        its events delivered, and `trio.Cancelled` propagates."""
        if config.source_trial is not None:
            raise ClusterError(f"trial {config.trial_name} regrades a recorded trial, which "
                               "runs in one process only: run it without workers")
        request, task = await self._request(config, retry)
        index = await self._free.receive()
        handle, state = self._handles[index], _InFlight(config, on_event, self.workers[index])
        self._in_flight[config.trial_name] = state
        try:
            ref = handle.run_trial.remote(request, task)
            try:
                returned: TrialReturn | BaseException = await ray_value(ref)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    returned = await cancelled_call(handle, ref, [config.trial_name])
                    await self._settle(state, returned, cancelled=True)
                raise
            except Exception as error:  # the worker was lost beyond Ray's retries
                returned = error
            with trio.CancelScope(shield=True):  # a finished trial is always written
                return await self._settle(state, returned, cancelled=False)
        finally:
            del self._in_flight[config.trial_name]
            self._free_send.send_nowait(index)

    async def run_trials(self, configs: Sequence[Any], *, concurrency: int,
                         watch: Callable[[Any], Awaitable[None]] | None = None,
                         placed: Callable[[str, str], None] | None = None) -> list[Any]:
        """Run `configs` (harbor `TrialConfig`s), at most `concurrency` at a time (and at
        most the fleet's), and return their `TrialResult`s in the order of `configs`;
        `watch` gets each of harbor's trial events (`TrialHookEvent`, its paths this
        machine's), `placed` each trial's name and its worker's label with every event
        (a trial run again elsewhere is placed again). The shape of a race's trial runner
        (`wmo_trio.harbor._trials`): cancelling the calling scope cancels every trial and
        returns only once each is stopped and written (see `run_trial`)."""
        results: list[Any] = [None] * len(configs)
        limiter = trio.CapacityLimiter(concurrency)

        async def forward(event: FleetEvent) -> None:
            if placed is not None:
                placed(str(event.hook.trial_name), event.worker.label)
            if watch is not None:
                await watch(event.hook)

        async def one(index: int, config: Any) -> None:
            async with limiter:
                results[index] = await self.run_trial(
                    config, forward if watch or placed else None)

        async with trio.open_nursery() as nursery:
            for index, config in enumerate(configs):
                nursery.start_soon(one, index, config)
        return results

    async def _request(self, config: Any, retry: Any) -> tuple[TrialRequest, list[Any]]:
        """What the worker is sent: the config with the agent's arguments made portable
        and the task, when it is a directory here, packed once into Ray's object store."""
        task: list[Any] = []
        digest = None
        if config.task.path is not None and config.task.git_url is None:
            digest, reference = await self._packed_task(Path(config.task.path))
            task = [reference]
        agent = await trio.to_thread.run_sync(self._portable_agent, config.agent)
        sent = config.model_copy(update={"agent": agent})
        return TrialRequest(config_json=sent.model_dump_json(), task_digest=digest,
                            retry_json=None if retry is None else retry.model_dump_json(),
                            limit_bytes=self._limit), task

    def _portable_agent(self, agent: Any) -> Any:
        """The agent's configuration as it travels: an agent class may say how its
        keyword arguments go to another machine (`portable_kwargs`: wmo_trio's inlines its
        document); the same configuration is converted once."""
        key = agent.model_dump_json()
        if key not in self._portable:
            from harbor.agents.factory import AgentFactory

            convert = getattr(AgentFactory.get_agent_class_from_config(agent), "portable_kwargs", None)
            self._portable[key] = agent if convert is None else agent.model_copy(
                update={"kwargs": convert(dict(agent.kwargs))})
        return self._portable[key]

    async def _packed_task(self, path: Path) -> tuple[str, Any]:
        async with self._task_lock:
            if path not in self._tasks:
                import ray

                tree = await trio.to_thread.run_sync(lambda: pack(path.expanduser().resolve(),
                                                                  limit=self._limit))
                if tree.left_out:
                    raise ClusterError(f"task {path} cannot be sent to the workers: "
                                       + "; ".join(tree.left_out[:3]))
                digest = uuid.uuid5(uuid.NAMESPACE_URL, tree.model_dump_json()).hex
                self._tasks[path] = (digest, await trio.to_thread.run_sync(ray.put, tree))
            return self._tasks[path]

    async def _settle(self, state: _InFlight, returned: TrialReturn | BaseException, *,
                      cancelled: bool) -> Any:
        """Write the trial's directory, deliver its last events, then its `END`."""
        config = state.config
        trial_dir = Path(config.trials_dir) / config.trial_name
        async with state.lock:
            if isinstance(returned, TrialReturn):
                state.worker = returned.worker
                for record in returned.events:
                    await self._deliver(state, record)
            result, lock = await trio.to_thread.run_sync(
                _write_trial, trial_dir, config, returned, state.last_result, cancelled, self._limit)
            if state.on_event is not None:
                from harbor.trial.hooks import TrialEvent, TrialHookEvent

                if lock is not None:
                    await state.on_event(FleetEvent(state.worker, TrialHookEvent(
                        event=TrialEvent.END, task_name=result.task_name, config=config,
                        result=result, lock=lock)))
        return result

    async def _deliver(self, state: _InFlight, record: EventRecord) -> None:
        """One event to the caller, once, in order (the caller holds `state.lock`)."""
        if record.seq <= state.delivered:
            return
        state.delivered = record.seq
        from harbor.trial.hooks import TrialEvent, TrialHookEvent

        event = _relocated_event(TrialHookEvent.model_validate_json(record.event_json), state.config)
        state.last_result = event.result
        if event.event is not TrialEvent.END and state.on_event is not None:
            await state.on_event(FleetEvent(state.worker, event))

    async def collect_events(self) -> None:
        """Deliver running trials' events as workers record them, until cancelled."""
        while True:
            await trio.sleep(POLL_S)
            busy = {state.worker.index for state in self._in_flight.values()}
            for index in sorted(busy):
                try:
                    records: list[EventRecord] = await ray_value(
                        self._handles[index].drain_events.options(max_task_retries=0).remote())
                except Exception:  # a worker restarting: its trials' ends carry their events
                    continue
                for record in records:
                    state = self._in_flight.get(record.trial_name)
                    if state is not None:
                        async with state.lock:
                            await self._deliver(state, record)


@contextlib.asynccontextmanager
async def open_trial_fleet(options: ClusterOptions, *, concurrency: int, agents: Sequence[Any] = (),
                           environment: Any = None,
                           limit_bytes: int = DEFAULT_TREE_LIMIT_BYTES) -> AsyncIterator[TrialFleet]:
    """Workers for harbor trials on the cluster `options` name, for this block: at most
    `concurrency` trials at once in all. Before the block starts, every worker has loaded
    the `agents` (harbor `AgentConfig`s) and the `environment` (`EnvironmentConfig`) and
    passed the environment's preflight on its machine, or a `ClusterError` says in one
    line which could not. Leaving the block stops every worker (trials still running
    cancelled as harbor cancels them) and the cluster when it is embedded."""
    if concurrency < 1:
        raise ClusterError("concurrency must be at least 1")
    async with open_cluster(options) as cluster:
        check = WorkerCheck(agents_json=[agent.model_dump_json() for agent in agents],
                            environment_json=None if environment is None else environment.model_dump_json())
        slots = max(1, math.ceil(concurrency / cluster.workers))
        handles = start_workers(TrialWorker, cluster, slots, uuid.uuid4().hex[:12], check)
        try:
            fleet = TrialFleet(cluster, handles, await started(handles, cluster), slots, limit_bytes)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fleet.collect_events)
                yield fleet
                nursery.cancel_scope.cancel()
        finally:
            await stop_workers(handles)


# -- a trial's directory, harbor's own again -------------------------------------------------


def _relocated_result(result: Any, config: Any) -> Any:
    trial_dir = Path(config.trials_dir) / config.trial_name
    return result.model_copy(update={"config": config, "task_id": config.task.get_task_id(),
                                     "trial_uri": trial_dir.expanduser().resolve().as_uri()})


def _relocated_lock(lock: Any, config: Any) -> Any:
    return lock.model_copy(update={"task": lock.task.model_copy(update={"path": config.task.path})})


def _relocated_event(event: Any, config: Any) -> Any:
    return event.model_copy(update={"config": config, "result": _relocated_result(event.result, config),
                                    "lock": _relocated_lock(event.lock, config)})


def _write_trial(trial_dir: Path, config: Any, returned: TrialReturn | BaseException,
                 template: Any, cancelled: bool, limit: int) -> tuple[Any, Any]:
    """The trial's directory written from what its worker returned, and its result and
    lock as harbor's records now hold them. A trial with no result of harbor's (its
    worker lost, or harbor's trial machinery raised) gets one saying so, with the trace."""
    from harbor.models.job.lock import TrialLock
    from harbor.models.trial.paths import TrialPaths
    from harbor.models.trial.result import TrialResult

    remove_tree(trial_dir)
    files = returned.files if isinstance(returned, TrialReturn) else PackedTree()
    for skipped in unpack(files, trial_dir, limit=limit):
        log.warning("trial %s: %s was not written", config.trial_name, skipped)
    paths = TrialPaths(trial_dir=trial_dir)
    result = _read_model(trial_dir, "result.json", TrialResult)
    if result is None:
        result = _error_result(config, returned, template, cancelled)
        _write_text(paths.exception_message_path, result.exception_info.exception_traceback)
    result = _relocated_result(result, config)
    lock = _read_model(trial_dir, "lock.json", TrialLock)
    if lock is not None:
        lock = _relocated_lock(lock, config)
        _write_text(paths.lock_path, lock.model_dump_json(indent=4, exclude_none=True))
    _write_text(paths.config_path, config.model_dump_json(indent=4, exclude_defaults=True))
    _write_text(paths.result_path, result.model_dump_json(indent=4))
    _relocate_trace(trial_dir, config)
    return result, lock


def _error_result(config: Any, returned: TrialReturn | BaseException, template: Any,
                  cancelled: bool) -> Any:
    from harbor.models.trial.result import AgentInfo, ExceptionInfo, TrialResult

    if isinstance(returned, TrialReturn):
        kind = "CancelledError" if cancelled and returned.error is None else (
            (returned.error or "TrialError").split(":")[0])
        message = returned.error or "the trial ended without a result"
        trace = returned.error_trace or message
    else:
        from ray.exceptions import RayActorError

        lost = isinstance(returned, RayActorError)
        kind = ("CancelledError" if cancelled
                else WorkerLostError.__name__ if lost else type(returned).__name__)
        message = (f"the worker process running this trial was lost ({type(returned).__name__}), "
                   f"after {CALL_RETRIES} retry: {str(returned).strip()[:2000]}" if lost
                   else f"its worker failed: {str(returned).strip()[:2000]}")
        trace = "".join(traceback.format_exception(returned))
    now = datetime.now(UTC)
    info = ExceptionInfo(exception_type=kind, exception_message=message,
                         exception_traceback=trace, occurred_at=now)
    if template is not None:
        return template.model_copy(update={"exception_info": info, "finished_at": now})
    return TrialResult(
        trial_name=config.trial_name, task_name=_task_name(config), trial_uri="",
        task_id=config.task.get_task_id(), source=config.task.source,
        task_checksum=_task_checksum(config), config=config,
        agent_info=AgentInfo(name=config.agent.name or str(config.agent.import_path),
                             version="unknown"),
        exception_info=info, started_at=now, finished_at=now)


def _task_name(config: Any) -> str:
    if config.task.path is not None:
        return Path(config.task.path).name
    return str(config.task.get_task_id().get_name())


def _task_checksum(config: Any) -> str:
    if config.task.path is None or config.task.git_url is not None:
        return "unknown"
    from harbor.models.task.task import Task

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return str(Task(task_dir=Path(config.task.path)).checksum)


def _read_model(trial_dir: Path, name: str, model: Any) -> Any:
    """harbor's record `name` of the trial, parsed, or None; never through a link."""
    try:
        return model.model_validate_json(read_bounded(trial_dir / name, _HARBOR_FILE_BYTES))
    except (OSError, ValueError):
        return None


def _write_text(path: Path, text: str) -> None:
    """Write one of harbor's records in the trial directory, replacing whatever the trial's
    tree put at its name (a link, a directory)."""
    remove_tree(path)
    path.write_text(text)


def _relocate_trace(trial_dir: Path, config: Any) -> None:
    """The agent's trace names the task as harbor's records do: the driver's path."""
    from wmo_trio.trace import TRACE_FILENAME, parse_trace, trace_text, write_atomically

    path = trial_dir / "agent" / TRACE_FILENAME
    try:
        trace = parse_trace(read_bounded(path, MAX_EVENT_BYTES * 64))
    except (OSError, ValueError):
        return
    if getattr(trace, "task_id", None) is None:
        return
    task_id = json.loads(json.dumps(config.task.get_task_id().model_dump(mode="json")))
    write_atomically(path, trace_text(trace.model_copy(update={"task_id": task_id})))

