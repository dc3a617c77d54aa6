"""The host when trio owns the process: asyncio runs inside `trio_asyncio.open_loop()`.

Also the trio -> asyncio direction for trio code (`call_asyncio`, `run_asyncio`, `run`),
which only this situation offers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio

from wmo_trio.engine._bridge import Submission, await_finished, settle
from wmo_trio.engine._engine import Episode, Finished
from wmo_trio.engine._host import Host, current_engine
from wmo_trio.models import RunResult


class TrioAsyncioHost(Host):
    """Serves a trio-asyncio loop of the current trio run.

    The episode's trio task is always started, and cancelled through its own scope: a
    task that trio-asyncio dropped before it started (an asyncio cancellation arriving
    that early) would never reach the engine, and so never write its trace.
    """

    name = "trio-asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        future: asyncio.Future[Finished] = self.loop.create_future()
        submission = Submission()

        async def in_trio() -> None:
            result = await outcome.acapture(
                submission.run, current_engine(), episode, workers, self.loop)
            settle(future, result)  # this thread runs the asyncio loop too

        self.loop.run_trio_task(in_trio)  # type: ignore[attr-defined]
        return await await_finished(future, submission.cancel)

    async def prepare(self, workers: int, *, load: Callable[[], object] | None = None) -> None:
        async def warm() -> None:
            await current_engine().prepare(workers, load=load)

        await self.loop.trio_as_future(warm)  # type: ignore[attr-defined]


async def call_asyncio[T](afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """From trio: run the asyncio coroutine function `afn(*args)` on the trio-asyncio loop
    open in this context; cancelling the calling scope cancels it."""
    import trio_asyncio

    if trio_asyncio.current_loop.get() is None:
        raise RuntimeError(
            "this trio run has no asyncio loop to call into; open one with "
            "trio_asyncio.open_loop() or run through wmo_trio.engine.run_asyncio()"
        )
    result: T = await trio_asyncio.aio_as_trio(afn)(*args)
    return result


async def run_asyncio[T](afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """From trio: run an asyncio coroutine function, trio owning the loop.

    Uses the trio-asyncio loop already open in this task's context, or opens one for the
    call, whose default executor behaves as asyncio's (`AsyncioSemanticsExecutor`: its
    close does not wait for executor work nobody awaits). Cancelling the calling trio
    scope cancels the asyncio side and waits for it.
    """
    import trio_asyncio

    if trio_asyncio.current_loop.get() is not None:
        return await call_asyncio(afn, *args)
    from wmo_trio.engine._executor import AsyncioSemanticsExecutor

    async with trio_asyncio.open_loop() as loop:
        loop.set_default_executor(AsyncioSemanticsExecutor())
        return await call_asyncio(afn, *args)


def run[T](afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Like `asyncio.run(afn(*args))`, but trio owns the process and asyncio runs inside
    it (trio-asyncio). The synchronous entry for running a harbor `Job` on the trio host."""
    return trio.run(run_asyncio, afn, *args)
