"""asyncio's default-executor semantics on a trio-asyncio loop.

Imported only where a trio-asyncio loop is opened: importing `trio_asyncio` replaces
asyncio's loop policy for the whole process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
import trio_asyncio


class AsyncioSemanticsExecutor(trio_asyncio.TrioExecutor):  # type: ignore[misc]
    """The default executor of a loop opened by `run_asyncio`.

    trio-asyncio's own `TrioExecutor` keeps a cancelled caller waiting until the thread
    returns, and its loop's close waits for every call nobody awaits any more. Under
    `asyncio.run`, the semantics harbor is written for, a cancelled `run_in_executor`
    caller stops waiting at once and the thread runs on. Here it does too, and so the
    loop's close does not wait for fire-and-forget work either: harbor hands its
    job-finished telemetry to the executor without awaiting it, and building that event
    imports litellm (about 6.6 s on a loaded 2-core machine), which `wmo-trio run` then
    waited for after its job had ended. Work still running when the process exits is
    dropped with it (trio's worker threads are daemon threads); harbor's own sender drops
    an event it cannot deliver too.
    """

    async def submit(self, func: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(func, *args, limiter=self._limiter,
                                             abandon_on_cancel=True)
