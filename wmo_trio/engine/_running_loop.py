"""Which host serves the asyncio loop running in this thread."""

from __future__ import annotations

import asyncio
import sys

from wmo_trio.engine._host import Host
from wmo_trio.engine._loop_host import LoopServingHost
from wmo_trio.engine._trio_asyncio import TrioAsyncioHost


def _running_trio_asyncio_loop(loop: asyncio.AbstractEventLoop) -> bool:
    # Never import trio_asyncio here: importing it replaces asyncio's loop policy for the
    # whole process. If the running loop is one of its loops, it is already imported.
    module = sys.modules.get("trio_asyncio")
    return module is not None and isinstance(loop, module.BaseTrioEventLoop)


def host_for_running_loop() -> Host:
    """The host for the asyncio loop running in this thread."""
    loop = asyncio.get_running_loop()
    if _running_trio_asyncio_loop(loop):
        return TrioAsyncioHost(loop)
    return LoopServingHost.for_loop(loop)
