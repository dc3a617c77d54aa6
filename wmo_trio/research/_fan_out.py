"""The research API beyond one process: a pool whose episodes run on Ray worker processes
(`open_episode_pool(workers=...)` / `ray_address=...`).

Each worker (`EpisodeWorker`, a Ray actor) runs a trio run of its own in a thread, with
its own engine and `EpisodePool` of its share of the limit; the actor's asyncio methods
hand each episode to that trio run and its result back. The driver (`RemotePool`) sends
each spec as data (`EpisodeData`: the document as its JSON object, the provider
configuration with its files inline, the environment pickled), gives each episode to a
worker with a free place, and writes the episode's trace at its `trace_path` here.

Cancelling the caller's scope cancels the episode on its worker with the engine's
guarantees (stopped, its worker thread waited for, its partial trace written) and that
trace is written here before the cancellation goes on. A worker process that dies is
restarted by Ray, which runs its unfinished episodes again (`wmo_trio.cluster._workers`);
an episode whose worker is lost beyond that ends with a `WorkerLostError` and a partial
trace. Every spec gets exactly one outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import pickle
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import outcome
import trio
from pydantic import BaseModel, ConfigDict

from wmo_trio._files import read_bounded
from wmo_trio.backends import check_backend
from wmo_trio.cluster import ClusterError, ClusterOptions, WorkerLostError, open_cluster, ray_value
from wmo_trio.cluster._workers import WorkerInfo as WorkerInfo
from wmo_trio.cluster._workers import cancelled_call, start_workers, started, stop_workers, this_worker
from wmo_trio.engine._bridge import wait_ignoring_cancellation
from wmo_trio.harness import HarnessDoc, harness_from
from wmo_trio.models import RunResult
from wmo_trio.providers import Provider, ProviderConfig, build_provider, portable_provider_config
from wmo_trio.research._pool import (
    EpisodePool,
    EpisodeSpec,
    HarborEnvironment,
    Pool,
    _Resolved,
    open_local_pool,
)
from wmo_trio.settings import EpisodeSettings, PositiveInt, checked
from wmo_trio.trace import CANCELLED_BY_CALLER, TraceIdentity, trace_for, trace_text, write_atomically

# A trace holds an episode's steps, each observation capped at 10,000 characters.
MAX_TRACE_BYTES = 256 << 20


class EpisodeData(BaseModel):
    """One episode as a worker is sent it (its environment travels beside it, pickled)."""

    model_config = ConfigDict(frozen=True)

    key: int
    doc: dict[str, Any]
    doc_hash: str
    provider: dict[str, Any]
    instruction: str
    task_id: str
    episode_timeout: float
    context_window: int | None = None
    backend: str | None = None
    traced: bool = False


class EpisodeReturn(BaseModel):
    """An episode as its worker ended it: its result, or what it raised (the exception
    itself when it pickles, else its type and text), and its trace's text."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    result: RunResult | None = None
    error: Any = None
    error_text: str | None = None
    cancelled: bool = False
    trace: str | None = None

    def unwrap(self) -> RunResult:
        if self.result is not None:
            return self.result
        if isinstance(self.error, BaseException):
            raise self.error
        raise RuntimeError(self.error_text or "the episode ended without a result")


class _Cancellable:
    """The trio side of one episode a worker runs: cancellable before it has started."""

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.requested = False

    def cancel(self) -> None:  # on the trio thread
        self.requested = True
        if self.scope is not None:
            self.scope.cancel()


class EpisodeWorker:
    """A Ray actor: one worker process of a remote pool, with its own trio run, engine and
    `EpisodePool` of `limit` (see the module docstring)."""

    def __init__(self, index: int, limit: int) -> None:
        self._index = index
        self._scratch = Path(tempfile.mkdtemp(prefix="wmo-trio-episodes-"))
        self._docs: dict[str, HarnessDoc] = {}
        self._running: dict[int, tuple[_Cancellable, asyncio.Future[EpisodeReturn]]] = {}
        self._ready = threading.Event()
        self._pool: EpisodePool | None = None
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._problem: BaseException | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._serve, limit),
                                        name="wmo-trio-episodes", daemon=True)
        self._thread.start()
        self._ready.wait()

    async def _serve(self, limit: int) -> None:
        self._stop = trio.Event()
        try:
            async with open_local_pool(limit) as pool, trio.open_nursery() as nursery:
                self._pool, self._nursery = pool, nursery
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        except Exception as error:  # reported by ready(): the worker cannot run episodes
            self._problem = error
        finally:
            self._ready.set()

    async def ready(self, *environments: Any) -> WorkerInfo:
        """This worker; its arguments are sample environments, unpickled on the way in (a
        class this machine cannot import fails the call)."""
        return this_worker(self._index, self._problem)

    async def cancel(self, keys: list[int]) -> None:
        assert self._token is not None
        for key in keys:
            if key in self._running:
                self._token.run_sync_soon(self._running[key][0].cancel)

    async def close(self) -> None:
        """Cancel every running episode, wait for each (its trace written), end the trio
        run and remove the scratch directory."""
        assert self._token is not None and self._stop is not None
        await self.cancel(list(self._running))
        futures = [future for _, future in self._running.values()]
        if futures:
            await asyncio.wait(futures)
        self._token.run_sync_soon(self._stop.set)
        await asyncio.to_thread(self._thread.join)
        from wmo_trio.cluster import remove_tree

        await asyncio.to_thread(remove_tree, self._scratch)

    async def run_episode(self, data: EpisodeData, environment: Any) -> EpisodeReturn:
        """Run one episode in this worker's pool (on its trio run) and return it. If this
        call is cancelled, the episode is cancelled there and waited for first."""
        assert self._token is not None and self._nursery is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EpisodeReturn] = loop.create_future()
        handle = _Cancellable()
        self._running[data.key] = (handle, future)

        def settle(returned: EpisodeReturn) -> None:
            if not future.done():
                future.set_result(returned)

        def deliver(returned: EpisodeReturn) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, returned)

        nursery = self._nursery
        self._token.run_sync_soon(lambda: nursery.start_soon(self._one, data, environment, handle, deliver))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self._token.run_sync_soon(handle.cancel)
            await wait_ignoring_cancellation(future)
            raise
        finally:
            self._running.pop(data.key, None)

    async def _one(self, data: EpisodeData, environment: Any, handle: _Cancellable,
                   deliver: Callable[[EpisodeReturn], None]) -> None:
        assert self._pool is not None
        trace = self._scratch / f"{data.key}.json" if data.traced else None
        doc = self._docs.get(data.doc_hash)
        if doc is None:
            doc = self._docs[data.doc_hash] = await trio.to_thread.run_sync(harness_from, data.doc)
        spec = EpisodeSpec(doc, data.provider, data.instruction, environment, task_id=data.task_id,
                           episode_timeout=data.episode_timeout, trace_path=trace,
                           context_window=data.context_window, backend=data.backend)
        with trio.CancelScope() as scope:
            handle.scope = scope
            if handle.requested:
                scope.cancel()
            result = await outcome.acapture(self._pool.run_spec, spec)
        deliver(await trio.to_thread.run_sync(_returned, result, trace))


def _returned(result: outcome.Outcome[RunResult], trace: Path | None) -> EpisodeReturn:
    text = None
    if trace is not None:
        with contextlib.suppress(OSError, ValueError):
            text = read_bounded(trace, MAX_TRACE_BYTES).decode("utf-8")
        trace.unlink(missing_ok=True)
    if isinstance(result, outcome.Value):
        return EpisodeReturn(result=result.value, trace=text)
    assert isinstance(result, outcome.Error)
    error = result.error
    if isinstance(error, trio.Cancelled):
        return EpisodeReturn(cancelled=True, error_text="cancelled", trace=text)
    try:
        pickle.dumps(error)
    except Exception:
        return EpisodeReturn(error_text=f"{type(error).__name__}: {error}", trace=text)
    return EpisodeReturn(error=error, error_text=f"{type(error).__name__}: {error}", trace=text)


class RemotePool(Pool):
    """A pool whose episodes run on the workers of a cluster; made by `open_episode_pool`
    with `workers=` or `ray_address=`."""

    def __init__(self, limit: int, handles: list[Any], workers: list[WorkerInfo], slots: int) -> None:
        self.limit = limit
        self.workers = workers
        self._handles = handles
        self._keys = itertools.count()
        self._resolved = _Resolved()
        self._docs: dict[str, dict[str, Any]] = {}
        self._providers: dict[int, tuple[object, dict[str, Any]]] = {}
        self._loaded: set[type] = set()
        self._limiter = trio.CapacityLimiter(limit)
        self._checked: dict[int, tuple[EpisodeSpec, EpisodeData]] = {}  # by a fan-out, by id
        order = [index for _ in range(slots) for index in range(len(handles))]
        self._free_send, self._free = trio.open_memory_channel[int](len(order))
        for index in order:
            self._free_send.send_nowait(index)

    async def started(self, specs: list[EpisodeSpec]) -> None:
        """Before a fan-out: every spec can be sent, and every worker can load each kind
        of environment the specs use; a `ValueError` or `ClusterError` otherwise."""
        for spec in specs:
            self._checked[id(spec)] = (spec, await self._data(spec, 0))
        await self._load([spec.environment for spec in specs])

    async def run_spec(self, spec: EpisodeSpec) -> RunResult:
        """Run one spec on a worker with a free place (see `Pool.run`)."""
        known = self._checked.pop(id(spec), None)
        if known is not None and known[0] is spec:  # checked by its fan-out just before
            data = known[1].model_copy(update={"key": next(self._keys)})
        else:
            data = await self._data(spec, next(self._keys))
            await self._load([spec.environment])
        async with self._limiter:
            return await self._run_data(spec, data)

    async def _run_data(self, spec: EpisodeSpec, data: EpisodeData) -> RunResult:
        index = await self._free.receive()
        handle = self._handles[index]
        started_at = datetime.now(UTC)
        try:
            ref = handle.run_episode.remote(data, spec.environment)
            try:
                returned: EpisodeReturn | BaseException = await ray_value(ref)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    returned = await cancelled_call(handle, ref, [data.key])
                    await self._write_trace(spec, data, returned, started_at, cancelled=True)
                raise
            except Exception as error:
                returned = WorkerLostError(
                    f"episode {data.task_id}: its worker process was lost ({type(error).__name__}): "
                    f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}")
        finally:
            self._free_send.send_nowait(index)
        with trio.CancelScope(shield=True):
            await self._write_trace(spec, data, returned, started_at, cancelled=False)
        if isinstance(returned, BaseException):
            raise returned
        return returned.unwrap()

    async def _write_trace(self, spec: EpisodeSpec, data: EpisodeData,
                           returned: EpisodeReturn | BaseException, started_at: datetime, *,
                           cancelled: bool) -> None:
        """The episode's trace at its `trace_path`: its worker's, or (none came back) a
        partial one saying why."""
        if spec.trace_path is None:
            return
        text = returned.trace if isinstance(returned, EpisodeReturn) else None
        if text is None:
            identity = TraceIdentity(task_id=data.task_id, doc_hash=data.doc_hash,
                                     model=f"{data.provider['kind']}/{data.provider['model']}",
                                     started_at=started_at, ended_at=datetime.now(UTC))
            error = returned if isinstance(returned, BaseException) else RuntimeError(
                returned.error_text or "the episode ended without a trace")
            text = trace_text(trace_for(identity, None if cancelled else outcome.Error(error),
                                        cancelled=CANCELLED_BY_CALLER if cancelled else None, log=None))
        await trio.to_thread.run_sync(write_atomically, Path(spec.trace_path), text)

    async def _data(self, spec: EpisodeSpec, key: int) -> EpisodeData:
        """`spec` as data for a worker, checked as `EpisodePool.run` checks it, before
        anything runs: a `ValueError` naming what cannot be sent."""
        settings: EpisodeSettings = EpisodeSettings.parse(
            {"episode_timeout": spec.episode_timeout, "context_window": spec.context_window})
        check_backend(spec.backend)
        doc = await self._resolved.doc(spec.doc)
        if doc.doc_hash not in self._docs:
            self._docs[doc.doc_hash] = doc.model_dump(mode="json")
        _sendable(spec)
        return EpisodeData(key=key, doc=self._docs[doc.doc_hash], doc_hash=doc.doc_hash,
                           provider=await self._provider(spec.provider), instruction=spec.instruction,
                           task_id=spec.task_id, episode_timeout=settings.episode_timeout_sec,
                           context_window=settings.context_window, backend=spec.backend,
                           traced=spec.trace_path is not None)

    async def _provider(self, value: ProviderConfig | Mapping[str, Any] | Provider) -> dict[str, Any]:
        """A provider configuration as it travels (checked by building it here once)."""
        if not isinstance(value, ProviderConfig | Mapping):
            raise ValueError(f"a provider object ({type(value).__name__}) cannot be sent to a "
                             "worker process; give its configuration (kind, model, settings)")
        known = self._providers.get(id(value))
        if known is None or known[0] is not value:
            portable = portable_provider_config(value)
            await trio.to_thread.run_sync(lambda: build_provider(portable).close())
            known = self._providers[id(value)] = (value, portable)
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
        for index, handle in enumerate(self._handles):
            try:
                await ray_value(handle.ready.options(max_task_retries=0).remote(*new.values()))
            except Exception as error:
                names = ", ".join(f"{kind.__module__}.{kind.__qualname__}" for kind in new)
                last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                raise ClusterError(f"{self.workers[index].label} cannot load the environment "
                                   f"({names}): {last}") from None
        self._loaded.update(new)


def _sendable(spec: EpisodeSpec) -> None:
    """A spec's environment travels pickled: one that holds this process's live objects
    cannot, and is refused in one line."""
    environment = spec.environment
    if isinstance(environment, HarborEnvironment):
        raise ValueError(f"episode {spec.task_id}: a HarborEnvironment wraps a harbor environment "
                         "of this process and cannot be sent to a worker process; run such "
                         "episodes in one process (no workers)")
    try:
        from ray import cloudpickle

        cloudpickle.dumps(environment)  # type: ignore[no-untyped-call]
    except Exception as error:
        raise ValueError(f"episode {spec.task_id}: its environment ({type(environment).__name__}) "
                         f"cannot be sent to a worker process: {type(error).__name__}: {error}"
                         ) from None


@contextlib.asynccontextmanager
async def open_remote_pool(limit: int, options: ClusterOptions) -> AsyncIterator[RemotePool]:
    """A `RemotePool` of at most `limit` concurrent episodes on the workers `options` name,
    for this block (see `wmo_trio.research.open_episode_pool`)."""
    limit = checked(PositiveInt, limit, "limit")
    async with open_cluster(options) as cluster:
        slots = max(1, math.ceil(limit / cluster.workers))
        handles = start_workers(EpisodeWorker, cluster, slots, slots)
        try:
            yield RemotePool(limit, handles, await started(handles, cluster), slots)
        finally:
            await stop_workers(handles)

