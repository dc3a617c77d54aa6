"""The research API beyond one process: a pool whose episodes run on Ray worker processes
(`open_episode_pool(workers=...)` / `ray_address=...`).

Each worker (`_episode_worker.EpisodeWorker`, a Ray actor) runs a trio run of its own with
its own engine and `EpisodePool` of its share of the limit. The driver (`RemotePool`)
checks each spec here and sends it as data, gives each episode a free place on a worker,
and writes each episode's trace at its `trace_path` here.

The driver's cost per episode is what bounds a fan-out of thousands on a few cores, so
nothing is done once per episode that can be done once per batch or once per worker: each
worker has a sender that sends the episodes given to it meanwhile as one batch (its
documents and provider configurations once per worker process), a poller that takes back
every episode ended since its last poll in one call and writes their traces in one thread
hop, and a canceller that sends cancellations the same way. These three run shielded for
the pool's lifetime, so that an episode whose caller is cancelled still gets its partial
trace back from its worker.

Cancelling the caller's scope cancels the episode on its worker with the engine's
guarantees (stopped, its worker thread waited for, its partial trace written) and that
trace is written here before the cancellation goes on. A worker process that dies loses
the episodes it ran: each runs again once (on whichever worker has a free place: Ray
restarts the dead one), and ends with a `WorkerLostError` and a partial trace when it is
lost again. Every spec gets exactly one outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import outcome
import trio

from wmo_trio.backends import check_backend
from wmo_trio.cluster import ClusterError, ClusterOptions, WorkerLostError, open_cluster, ray_value
from wmo_trio.cluster._workers import CALL_RETRIES, STOP_GRACE_S, start_workers, started, stop_workers
from wmo_trio.cluster._workers import WorkerInfo as WorkerInfo
from wmo_trio.engine import settle_heap
from wmo_trio.models import RunResult
from wmo_trio.providers import Provider, ProviderConfig, build_provider, portable_provider_config
from wmo_trio.research._episode_worker import (
    EpisodeBatch,
    EpisodeData,
    EpisodeReturn,
    EpisodeWorker,
    Submitted,
    Taken,
)
from wmo_trio.research._pool import EpisodeSpec, HarborEnvironment, Pool, _Resolved
from wmo_trio.settings import EpisodeSettings, PositiveInt, checked
from wmo_trio.trace import CANCELLED_BY_CALLER, TraceIdentity, trace_for, trace_text, write_atomically

TAKE_WAIT_S = 1.0  # a poll's longest wait on its worker: how soon the poller sees a stop
TAKE_LINGER_S = 0.25  # after the first ended episode, how long a poll gathers others: at most a
# few polls a second each worker, however slowly episodes end (a poll costs both processes
# a Ray call; 20 ms cost the driver twice the CPU on a loaded machine)
CONTROL_CALLS = 4  # a worker's calls at once besides its episodes: submit, take, cancel, ready


@dataclass(eq=False)
class _Pending:
    """One episode of the driver's, from its place on a worker to its outcome."""

    spec: EpisodeSpec
    data: EpisodeData
    tries: int = 0
    sent: bool = False
    cancelling: bool = False
    incarnation: str | None = None  # the worker process it was started on
    returned: EpisodeReturn | BaseException | None = None
    ended: trio.Event = field(default_factory=trio.Event)

    def end(self, returned: EpisodeReturn | BaseException) -> None:
        if not self.ended.is_set():
            self.returned = returned
            self.ended.set()


@dataclass(eq=False)
class _Link:
    """The driver's side of one worker: what it was sent, what runs there."""

    index: int
    handle: Any
    info: WorkerInfo
    outbox: trio.MemorySendChannel[_Pending]
    inbox: trio.MemoryReceiveChannel[_Pending]
    incarnation: str | None = None
    sent_docs: set[str] = field(default_factory=set)
    sent_providers: set[str] = field(default_factory=set)
    running: dict[int, _Pending] = field(default_factory=dict)
    cancels: list[int] = field(default_factory=list)
    started: trio.Event = field(default_factory=trio.Event)  # something to poll for
    cancelled: trio.Event = field(default_factory=trio.Event)  # something to cancel
    alive: bool = True
    failed_in_a_row: int = 0


class RemotePool(Pool):
    """A pool whose episodes run on the workers of a cluster; made by `open_episode_pool`
    with `workers=` or `ray_address=`."""

    def __init__(self, limit: int, handles: list[Any], workers: list[WorkerInfo], slots: int) -> None:
        self.limit = limit
        self.workers = workers
        self._links = []
        for index, (handle, info) in enumerate(zip(handles, workers, strict=True)):
            outbox, inbox = trio.open_memory_channel[_Pending](math.inf)
            self._links.append(_Link(index, handle, info, outbox, inbox))
        self._keys = itertools.count()
        self._resolved = _Resolved()
        self._docs: dict[str, dict[str, Any]] = {}
        self._providers: dict[int, tuple[object, str]] = {}
        self._provider_configs: dict[str, dict[str, Any]] = {}
        self._settings: dict[tuple[float, int | None], EpisodeSettings] = {}
        self._loaded: set[type] = set()
        self._backends: set[str | None] = set()  # checked
        self._limiter = trio.CapacityLimiter(limit)
        self._checked: dict[int, tuple[EpisodeSpec, EpisodeData]] = {}  # by a fan-out, by id
        order = [index for _ in range(slots) for index in range(len(handles))]
        self._free_send, self._free = trio.open_memory_channel[int](len(order))
        for index in order:
            self._free_send.send_nowait(index)

    # -- the caller's side ---------------------------------------------------------------

    async def started(self, specs: list[EpisodeSpec]) -> None:
        """Before a fan-out: every spec can be sent, and every worker can load each kind
        of environment the specs use; a `ValueError` or `ClusterError` otherwise."""
        _sendable(specs)
        for spec in specs:
            self._checked[id(spec)] = (spec, await self._data(spec, 0))
        await self._load([spec.environment for spec in specs])

    async def run_spec(self, spec: EpisodeSpec) -> RunResult:
        """Run one spec on a worker with a free place (see `Pool.run`)."""
        known = self._checked.pop(id(spec), None)
        if known is not None and known[0] is spec:  # checked by its fan-out just before
            data = known[1].model_copy(update={"key": next(self._keys)})
        else:
            _sendable([spec])
            data = await self._data(spec, next(self._keys))
            await self._load([spec.environment])
        async with self._limiter:
            return await self._run(_Pending(spec, data))

    async def _run(self, pending: _Pending) -> RunResult:
        started_at = datetime.now(UTC)
        while True:
            pending.tries += 1
            link = await self._place()
            try:
                pending.sent, pending.cancelling = False, False
                pending.returned, pending.ended = None, trio.Event()
                link.running[pending.data.key] = pending
                link.outbox.send_nowait(pending)
                try:
                    await pending.ended.wait()
                except trio.Cancelled:
                    with trio.CancelScope(shield=True):
                        await self._cancelled(link, pending, started_at)
                    raise
            finally:
                link.running.pop(pending.data.key, None)
                self._free_place(link)
            if isinstance(pending.returned, EpisodeReturn):
                return pending.returned.unwrap()
            if pending.tries > CALL_RETRIES:  # lost again: no run of its own
                assert pending.returned is not None
                with trio.CancelScope(shield=True):
                    await self._write_partial(pending, started_at, pending.returned, cancelled=False)
                raise pending.returned

    async def _cancelled(self, link: _Link, pending: _Pending, started_at: datetime) -> None:
        """The caller was cancelled: cancel the episode on its worker and wait, at most
        `STOP_GRACE_S`, for it to come back with its trace (then written here by the
        poller); write a partial one here when none comes."""
        if not pending.sent:  # still in the outbox: the sender drops it
            pending.cancelling = True
            pending.end(EpisodeReturn(key=pending.data.key, cancelled=True))
        elif not pending.ended.is_set():
            pending.cancelling = True
            link.cancels.append(pending.data.key)
            link.cancelled.set()
            with trio.move_on_after(STOP_GRACE_S):
                await pending.ended.wait()
        returned = pending.returned
        if not (isinstance(returned, EpisodeReturn) and returned.trace is not None):
            await self._write_partial(pending, started_at, returned or TimeoutError(
                f"the worker did not return the cancelled episode within {STOP_GRACE_S:g} s"),
                cancelled=True)

    async def _place(self) -> _Link:
        """A free place on a live worker; a `WorkerLostError` when every worker is lost."""
        while True:
            try:
                index = await self._free.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise WorkerLostError("every worker process of the pool was lost") from None
            if self._links[index].alive:
                return self._links[index]

    def _free_place(self, link: _Link) -> None:
        with contextlib.suppress(trio.ClosedResourceError):
            self._free_send.send_nowait(link.index)

    async def _write_partial(self, pending: _Pending, started_at: datetime,
                             returned: EpisodeReturn | BaseException, *, cancelled: bool) -> None:
        """The partial trace of an episode whose worker returned none, saying why."""
        if pending.spec.trace_path is None:
            return
        data = pending.data
        config = self._provider_configs[data.provider]
        identity = TraceIdentity(task_id=data.task_id, doc_hash=data.doc_hash,
                                 model=f"{config['kind']}/{config['model']}",
                                 started_at=started_at, ended_at=datetime.now(UTC))
        error = returned if isinstance(returned, BaseException) else RuntimeError(
            returned.error_text or "the episode ended without a trace")
        text = trace_text(trace_for(identity, None if cancelled else outcome.Error(error),
                                    cancelled=CANCELLED_BY_CALLER if cancelled else None, log=None))
        await trio.to_thread.run_sync(write_atomically, Path(pending.spec.trace_path), text)

    # -- each worker's sender, poller and canceller ----------------------------------------

    async def serve(self) -> None:
        """Every worker's sender, poller and canceller, until cancelled (see the module
        docstring)."""
        async with trio.open_nursery() as nursery:
            for link in self._links:
                nursery.start_soon(self._send, link)
                nursery.start_soon(self._poll, link)
                nursery.start_soon(self._cancel, link)

    async def _send(self, link: _Link) -> None:
        """Whatever was given to this worker since its last batch, as one batch."""
        async for first in link.inbox:
            batch = [first]
            with contextlib.suppress(trio.WouldBlock):
                while True:
                    batch.append(link.inbox.receive_nowait())
            # not what was cancelled meanwhile, nor what was lost and runs elsewhere now
            batch = [pending for pending in batch
                     if not pending.cancelling and link.running.get(pending.data.key) is pending]
            for pending in batch:
                pending.sent = True
            if batch:
                await self._submit(link, batch)

    async def _submit(self, link: _Link, batch: list[_Pending]) -> None:
        environments = [pending.spec.environment for pending in batch]
        episodes = [pending.data for pending in batch]
        for _ in range(2):  # a second time with every table, when a new process refused it
            docs = {data.doc_hash: self._docs[data.doc_hash] for data in episodes
                    if data.doc_hash not in link.sent_docs}
            providers = {data.provider: self._provider_configs[data.provider] for data in episodes
                         if data.provider not in link.sent_providers}
            try:
                submitted: Submitted = await ray_value(link.handle.submit.options(
                    max_task_retries=0).remote(EpisodeBatch(episodes=episodes, environments=environments,
                                                            docs=docs, providers=providers)))
            except Exception as error:
                self._lost(link, batch, error)
                return
            self._seen(link, submitted.incarnation)
            if submitted.accepted:
                link.sent_docs.update(docs)
                link.sent_providers.update(providers)
                for pending in batch:
                    pending.incarnation = submitted.incarnation
                link.started.set()
                return
        self._lost(link, batch, WorkerLostError(f"{link.info.label} refused a batch twice"))

    async def _poll(self, link: _Link) -> None:
        """The episodes this worker ended, as they end: their traces written here (one
        thread hop a poll), then each handed to its caller."""
        while True:
            if not any(pending.incarnation is not None for pending in link.running.values()):
                await link.started.wait()
                link.started = trio.Event()
                continue
            try:
                taken: Taken = await ray_value(link.handle.take.options(max_task_retries=0).remote(
                    TAKE_WAIT_S, TAKE_LINGER_S))
            except Exception as error:
                self._lost(link, [p for p in link.running.values() if p.incarnation is not None], error)
                continue
            self._seen(link, taken.incarnation)
            ended = [(link.running[returned.key], returned) for returned in taken.returns
                     if returned.key in link.running]
            traces = [(Path(pending.spec.trace_path), returned.trace) for pending, returned in ended
                      if pending.spec.trace_path is not None and returned.trace is not None]
            if traces:
                await trio.to_thread.run_sync(_write_traces, traces)
            for pending, returned in ended:
                pending.end(returned)

    async def _cancel(self, link: _Link) -> None:
        """The cancellations asked for since the last call, as one call."""
        while True:
            await link.cancelled.wait()
            link.cancelled = trio.Event()
            keys, link.cancels = link.cancels, []
            with contextlib.suppress(Exception):  # a lost worker: its poller says so
                await ray_value(link.handle.cancel.options(max_task_retries=0).remote(keys))

    def _seen(self, link: _Link, incarnation: str) -> None:
        """A call answered by the worker process `incarnation`: when that is a new one (Ray
        restarted the worker), what its predecessor ran is lost, and nothing was sent to
        it yet."""
        link.failed_in_a_row = 0
        if incarnation == link.incarnation:
            return
        if link.incarnation is not None:
            self._lost(link, [pending for pending in link.running.values()
                              if pending.incarnation not in (None, incarnation)],
                       WorkerLostError(f"{link.info.label} was restarted"), counts=False)
        link.incarnation = incarnation
        link.sent_docs, link.sent_providers = set(), set()

    def _lost(self, link: _Link, pendings: list[_Pending], error: BaseException, *,
              counts: bool = True) -> None:
        """These episodes' worker process was lost: each ends with the error (its caller
        runs it again while it has tries left). A worker whose calls fail twice in a row
        with no answer between is gone for good (Ray queues calls for a worker it
        restarts): no more places on it."""
        if counts:
            link.failed_in_a_row += 1
            if link.failed_in_a_row >= 2 and link.alive:
                link.alive = False
                pendings = list(link.running.values())
                if not any(other.alive for other in self._links):
                    self._free_send.close()
        lost = WorkerLostError(f"its worker process was lost ({type(error).__name__}): "
                               f"{_last_line(error)}")
        for pending in pendings:
            if link.running.get(pending.data.key) is pending:  # not a retry placed elsewhere
                pending.incarnation = None
                pending.end(lost)

    # -- specs as data ---------------------------------------------------------------------

    async def _data(self, spec: EpisodeSpec, key: int) -> EpisodeData:
        """`spec` as data for a worker, checked as `EpisodePool.run` checks it, before
        anything runs: a `ValueError` naming what cannot be sent."""
        settings = self._settings.get((spec.episode_timeout, spec.context_window))
        if settings is None:
            settings = EpisodeSettings.parse(
                {"episode_timeout": spec.episode_timeout, "context_window": spec.context_window})
            self._settings[(spec.episode_timeout, spec.context_window)] = settings
        if spec.backend not in self._backends:
            check_backend(spec.backend)
            self._backends.add(spec.backend)
        doc = await self._resolved.doc(spec.doc)
        if doc.doc_hash not in self._docs:
            self._docs[doc.doc_hash] = doc.model_dump(mode="json")
        return EpisodeData(key=key, doc_hash=doc.doc_hash, provider=await self._provider(spec.provider),
                           instruction=spec.instruction, task_id=spec.task_id,
                           episode_timeout=settings.episode_timeout_sec,
                           context_window=settings.context_window, backend=spec.backend,
                           traced=spec.trace_path is not None)

    async def _provider(self, value: ProviderConfig | Mapping[str, Any] | Provider) -> str:
        """A provider configuration's key; the configuration as it travels is checked (by
        building it here) once per object."""
        if not isinstance(value, ProviderConfig | Mapping):
            raise ValueError(f"a provider object ({type(value).__name__}) cannot be sent to a "
                             "worker process; give its configuration (kind, model, settings)")
        known = self._providers.get(id(value))
        if known is None or known[0] is not value:
            portable = portable_provider_config(value)
            await trio.to_thread.run_sync(lambda: build_provider(portable).close())
            key = hashlib.blake2b(json.dumps(portable, sort_keys=True, default=str).encode(),
                                  digest_size=16).hexdigest()
            self._provider_configs[key] = portable
            known = self._providers[id(value)] = (value, key)
        return known[1]

    async def _load(self, environments: list[Any]) -> None:
        """Every worker loads one environment of each kind not loaded yet (its class
        imported there): a `ClusterError` naming the first that cannot."""
        new: dict[type, Any] = {}
        for environment in environments:
            if type(environment) not in self._loaded:
                new.setdefault(type(environment), environment)
        if not new:
            return
        for link in self._links:
            try:
                await ray_value(link.handle.ready.options(max_task_retries=0).remote(*new.values()))
            except Exception as error:
                names = ", ".join(f"{kind.__module__}.{kind.__qualname__}" for kind in new)
                raise ClusterError(f"{link.info.label} cannot load the environment "
                                   f"({names}): {_last_line(error)}") from None
        self._loaded.update(new)


def _sendable(specs: list[EpisodeSpec]) -> None:
    """Specs' environments travel pickled: one that holds this process's live objects
    cannot, and is refused in one line naming its episode. One pickling for all of them;
    one each only to find the culprit."""
    from ray import cloudpickle

    for spec in specs:
        if isinstance(spec.environment, HarborEnvironment):
            raise ValueError(f"episode {spec.task_id}: a HarborEnvironment wraps a harbor "
                             "environment of this process and cannot be sent to a worker "
                             "process; run such episodes in one process (no workers)")
    try:
        cloudpickle.dumps([spec.environment for spec in specs])  # type: ignore[no-untyped-call]
        return
    except Exception:
        pass
    for spec in specs:
        try:
            cloudpickle.dumps(spec.environment)  # type: ignore[no-untyped-call]
        except Exception as error:
            raise ValueError(f"episode {spec.task_id}: its environment "
                             f"({type(spec.environment).__name__}) cannot be sent to a worker "
                             f"process: {type(error).__name__}: {error}") from None


def _write_traces(traces: list[tuple[Path, str]]) -> None:
    for path, text in traces:
        write_atomically(path, text)


def _last_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


@contextlib.asynccontextmanager
async def open_remote_pool(limit: int, options: ClusterOptions) -> AsyncIterator[RemotePool]:
    """A `RemotePool` of at most `limit` concurrent episodes on the workers `options` name,
    for this block (see `wmo_trio.research.open_episode_pool`)."""
    limit = checked(PositiveInt, limit, "limit")
    async with open_cluster(options) as cluster:
        slots = max(1, math.ceil(limit / cluster.workers))
        handles = start_workers(EpisodeWorker, cluster, CONTROL_CALLS, slots)
        try:
            pool = RemotePool(limit, handles, await started(handles, cluster), slots)
            settle_heap()  # as a pool in one process does before its first burst
            async with trio.open_nursery() as nursery:
                # Shielded: an episode whose caller is cancelled waits for its worker's
                # answer, which these bring, whatever else was cancelled.
                service = trio.CancelScope(shield=True)

                async def serve() -> None:
                    with service:
                        await pool.serve()

                nursery.start_soon(serve)
                try:
                    yield pool
                finally:
                    service.cancel()
        finally:
            await stop_workers(handles)
