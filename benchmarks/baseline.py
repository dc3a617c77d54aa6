"""The asyncio baseline: how the original agent ran episodes, rebuilt for comparison.

Same behaviour class as the original bridge, written here from its description: a
process-wide `ThreadPoolExecutor` grown to the requested concurrency (a bigger pool
replaces a smaller one), the worker shielded with `asyncio.shield`, environment calls made
from the worker with `asyncio.run_coroutine_threadsafe(...).result()`, abort and close run
in the executor and waited for through repeated cancellation, the trace written
synchronously. An environment call in flight is not cancelled: a cancelled episode waits
for it, which is what the cancellation benchmark shows.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import outcome

from wmo_trio.control import CallControl
from wmo_trio.engine import Episode
from wmo_trio.models import RunResult

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_executor_size = 0


def episode_executor(workers: int) -> ThreadPoolExecutor:
    global _executor, _executor_size
    with _lock:
        if _executor is None or _executor_size < workers:
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="baseline")
            _executor_size = workers
        return _executor


def shutdown_executor() -> None:
    global _executor, _executor_size
    with _lock:
        if _executor is not None:
            _executor.shutdown(wait=True)
        _executor, _executor_size = None, 0


class BaselineControl(CallControl):
    """Worker -> host loop, the original way: block on run_coroutine_threadsafe. The
    original could not cancel a call in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(host_loop=loop)
        self._loop = loop

    def run_host[T](self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def invoke() -> T:
            return await afn(*args)

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result()


async def _wait_until_done(future: asyncio.Future[Any]) -> bool:
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


async def _uncancellable(call: Callable[[], Any], executor: ThreadPoolExecutor) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(loop.run_in_executor(executor, call))
    cancelled = await _wait_until_done(task)
    if not task.cancelled():
        task.exception()
    if cancelled:
        raise asyncio.CancelledError


async def run_episode(episode: Episode, *, workers: int = 64) -> RunResult:
    loop = asyncio.get_running_loop()
    executor = episode_executor(workers)
    task = asyncio.ensure_future(loop.run_in_executor(executor, episode.run, BaselineControl(loop)))
    cancelled = False
    try:
        result: RunResult = await asyncio.shield(task)
        return result
    except asyncio.CancelledError:
        cancelled = True
        try:
            await _uncancellable(episode.stop, executor)
        finally:
            await _wait_until_done(task)
        raise
    finally:
        try:
            await _uncancellable(episode.close, executor)
        finally:
            if task.done() and not task.cancelled():
                error = task.exception()
                final: outcome.Outcome[RunResult] = (
                    outcome.Value(task.result()) if error is None else outcome.Error(error))
            else:
                final = outcome.Error(asyncio.CancelledError())
            episode.record(final, cancelled)
