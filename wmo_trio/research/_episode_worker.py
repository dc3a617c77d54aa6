"""The worker side of a remote episode pool: a Ray actor (one worker process) that runs
episodes on a trio run and an `EpisodePool` of its own, and what crosses between it and
the pool's driver (`_fan_out.RemotePool`).

Work crosses in batches, not a Ray call an episode: `submit` takes a batch of episodes
(each document and provider configuration sent once per worker process, the environments
pickled with the batch) and starts them all at once; `take` is a long poll that returns
every episode that has ended since the last one, its trace's text with it (built in
memory, never written on the worker). `cancel` cancels episodes by key, `close` every one.

A worker restarted by Ray is a new process that knows none of its predecessor's episodes,
documents or providers: its `incarnation` differs, and `submit` refuses a batch that
names a document or provider it has not been sent (`Submitted.accepted`), so the driver
sends them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import uuid
from typing import Any

import outcome
import trio
from pydantic import BaseModel, ConfigDict, Field

from wmo_trio.cluster._workers import WorkerInfo, this_worker
from wmo_trio.harness import HarnessDoc, harness_from
from wmo_trio.models import RunResult
from wmo_trio.research._pool import EpisodePool, EpisodeSpec, open_local_pool


class EpisodeData(BaseModel):
    """One episode as a worker is sent it: its document and provider configuration by key
    (`EpisodeBatch`); its environment travels beside it, pickled."""

    model_config = ConfigDict(frozen=True)

    key: int
    doc_hash: str
    provider: str
    instruction: str
    task_id: str
    episode_timeout: float
    context_window: int | None = None
    backend: str | None = None
    traced: bool = False


class EpisodeBatch(BaseModel):
    """Episodes for one worker, each with its environment (`environments[i]` is
    `episodes[i]`'s), and the documents (JSON objects, by hash) and provider configurations
    (by key) this worker process has not been sent yet."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    episodes: list[EpisodeData]
    environments: list[Any]
    docs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    providers: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Submitted(BaseModel):
    """A worker's answer to a batch: which process it is, and whether it started the batch
    (not when it names a document or provider this process was never sent)."""

    model_config = ConfigDict(frozen=True)

    incarnation: str
    accepted: bool


class EpisodeReturn(BaseModel):
    """An episode as its worker ended it: its result, or what it raised (the exception
    itself when it pickles, else its type and text), and its trace's text.

    The result travels as its JSON text, parsed where it is used: unpickled, its dozens of
    nested models (steps, actions, observations) cost the driver more CPU than the rest of
    its episode (`make bench`, the scale-out's driver). `result` holds one that has no JSON
    form."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    key: int = -1
    result_json: str | None = None
    result: RunResult | None = None
    error: Any = None
    error_text: str | None = None
    cancelled: bool = False
    trace: str | None = None

    def unwrap(self) -> RunResult:
        if self.result_json is not None:
            return RunResult.model_validate_json(self.result_json)
        if self.result is not None:
            return self.result
        if isinstance(self.error, BaseException):
            raise self.error
        raise RuntimeError(self.error_text or "the episode ended without a result")


class Taken(BaseModel):
    """The episodes a worker process ended since the last `take`."""

    model_config = ConfigDict(frozen=True)

    incarnation: str
    returns: list[EpisodeReturn]


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
    """A Ray actor: one worker process of a remote pool, with its own trio run (in a thread
    of its own), engine and `EpisodePool` of `limit` (see the module docstring)."""

    def __init__(self, index: int, limit: int) -> None:
        self._index = index
        self._incarnation = uuid.uuid4().hex
        self._docs: dict[str, HarnessDoc] = {}
        self._providers: dict[str, dict[str, Any]] = {}
        self._running: dict[int, _Cancellable] = {}  # the trio thread's alone, as is:
        self._cancelled_early: set[int] = set()  # cancelled before their batch started them
        self._ended: list[EpisodeReturn] = []
        self._ended_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None
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
                nursery.cancel_scope.cancel()  # each episode cancelled, its trace kept
        except Exception as error:  # reported by ready(): the worker cannot run episodes
            self._problem = error
        finally:
            self._ready.set()

    async def ready(self, *environments: Any) -> WorkerInfo:
        """This worker; its arguments are sample environments, unpickled on the way in (a
        class this machine cannot import fails the call)."""
        self._attach()
        return this_worker(self._index, self._problem)

    def _attach(self) -> asyncio.Event:
        if self._woken is None:
            self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        return self._woken

    async def submit(self, batch: EpisodeBatch) -> Submitted:
        """Start every episode of `batch` (see `Submitted`)."""
        self._attach()
        self._providers.update(batch.providers)
        for doc_hash, doc in batch.docs.items():
            if doc_hash not in self._docs:
                self._docs[doc_hash] = await asyncio.to_thread(harness_from, doc)
        if any(data.doc_hash not in self._docs or data.provider not in self._providers
               for data in batch.episodes):
            return Submitted(incarnation=self._incarnation, accepted=False)
        specs = [(data.key, data.traced,
                  EpisodeSpec(self._docs[data.doc_hash], self._providers[data.provider],
                              data.instruction, environment, task_id=data.task_id,
                              episode_timeout=data.episode_timeout,
                              context_window=data.context_window, backend=data.backend))
                 for data, environment in zip(batch.episodes, batch.environments, strict=True)]
        assert self._token is not None
        self._token.run_sync_soon(self._start, specs)
        return Submitted(incarnation=self._incarnation, accepted=True)

    def _start(self, specs: list[tuple[int, bool, EpisodeSpec]]) -> None:  # on the trio thread
        assert self._nursery is not None
        for key, traced, spec in specs:
            handle = self._running[key] = _Cancellable()
            if key in self._cancelled_early:
                self._cancelled_early.discard(key)
                handle.cancel()
            self._nursery.start_soon(self._one, key, traced, spec, handle)

    async def take(self, wait_s: float, linger_s: float) -> Taken:
        """Every episode ended since the last call: once at least one has, after `linger_s`
        more (so that those ending together come back together); none after `wait_s`."""
        woken = self._attach()
        woken.clear()
        if not self._ended:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), wait_s)
        if self._ended:
            await asyncio.sleep(linger_s)
        with self._ended_lock:
            ended, self._ended = self._ended, []
        return Taken(incarnation=self._incarnation, returns=ended)

    async def cancel(self, keys: list[int]) -> None:
        """Cancel these episodes (each then ends, cancelled, with its partial trace)."""
        assert self._token is not None
        self._token.run_sync_soon(self._cancel, keys)

    def _cancel(self, keys: list[int]) -> None:  # on the trio thread
        for key in keys:
            handle = self._running.get(key)
            if handle is not None:
                handle.cancel()
            else:  # its batch may still be on its way (a submit waits while it parses a document)
                self._cancelled_early.add(key)

    async def close(self) -> None:
        """Cancel every running episode, wait for each (its trace kept), and end the trio
        run."""
        assert self._token is not None and self._stop is not None
        self._token.run_sync_soon(self._stop.set)
        await asyncio.to_thread(self._thread.join)

    async def _one(self, key: int, traced: bool, spec: EpisodeSpec, handle: _Cancellable) -> None:
        assert self._pool is not None
        kept: list[str] = []
        with trio.CancelScope() as scope:
            handle.scope = scope
            if handle.requested:
                scope.cancel()
            result = await outcome.acapture(self._pool.run_keeping_trace, spec,
                                            kept.append if traced else None)
        del self._running[key]
        self._end(_returned(key, result, kept[0] if kept else None))

    def _end(self, returned: EpisodeReturn) -> None:  # on the trio thread
        with self._ended_lock:
            self._ended.append(returned)
            first = len(self._ended) == 1
        if first and self._loop is not None and self._woken is not None:
            with contextlib.suppress(RuntimeError):  # the actor's loop is closed: nobody takes
                self._loop.call_soon_threadsafe(self._woken.set)


def _returned(key: int, result: outcome.Outcome[RunResult], trace: str | None) -> EpisodeReturn:
    if isinstance(result, outcome.Value):
        try:
            return EpisodeReturn(key=key, result_json=result.value.model_dump_json(), trace=trace)
        except ValueError:  # pydantic-core's serialization errors
            return EpisodeReturn(key=key, result=result.value, trace=trace)
    assert isinstance(result, outcome.Error)
    error = result.error
    if isinstance(error, trio.Cancelled):
        return EpisodeReturn(key=key, cancelled=True, error_text="cancelled", trace=trace)
    text = f"{type(error).__name__}: {error}"
    try:
        pickle.dumps(error)
    except Exception:
        return EpisodeReturn(key=key, error_text=text, trace=trace)
    return EpisodeReturn(key=key, error=error, error_text=text, trace=trace)
