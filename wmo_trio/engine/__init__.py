"""The trio episode engine and the hosts that connect it to harbor's asyncio code.

- `EpisodeEngine` runs episodes (see `Episode`) in worker threads under one capacity
  limiter per trio run, with shielded cleanup and exact cancellation.
- `host_for_running_loop()` picks how an asyncio caller reaches the engine: through
  trio-asyncio when trio owns the loop, else through a trio run started for that loop.
- `HostCaller` is how a worker thread calls an asyncio coroutine function (harbor's
  `environment.exec`) on the host loop, cancelled together with its episode.
- `run_asyncio` / `run` run an asyncio main (such as a harbor `Job`) with trio owning the
  loop: the design wmo_trio is built around.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from wmo_trio.engine._engine import DEFAULT_EPISODE_WORKERS, Episode, EpisodeEngine
from wmo_trio.engine._hosts import (
    DEFAULT_HOST_MODE,
    Host,
    HostCaller,
    HostInterrupted,
    LoopServingHost,
    TrioAsyncioHost,
    call_asyncio,
    current_engine,
    default_host_mode,
    host_for_running_loop,
)

__all__ = [
    "DEFAULT_EPISODE_WORKERS",
    "DEFAULT_HOST_MODE",
    "Episode",
    "EpisodeEngine",
    "Host",
    "HostCaller",
    "HostInterrupted",
    "LoopServingHost",
    "TrioAsyncioHost",
    "call_asyncio",
    "current_engine",
    "default_host_mode",
    "host_for_running_loop",
    "run",
    "run_asyncio",
]

async def run_asyncio[T](afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """From trio: run an asyncio coroutine function, trio owning the loop.

    Uses the trio-asyncio loop already open in this task's context, or opens one for the
    call. Cancelling the calling trio scope cancels the asyncio side and waits for it.
    """
    import trio_asyncio

    result: T
    if trio_asyncio.current_loop.get() is not None:
        result = await trio_asyncio.aio_as_trio(afn)(*args)
    else:
        async with trio_asyncio.open_loop():
            result = await trio_asyncio.aio_as_trio(afn)(*args)
    return result


def run[T](afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Like `asyncio.run(afn(*args))`, but trio owns the process and asyncio runs inside
    it (trio-asyncio). The synchronous entry for running a harbor `Job` on the trio host."""
    return trio.run(run_asyncio, afn, *args)
