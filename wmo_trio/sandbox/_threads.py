"""What the sandbox's asyncio code makes in a worker thread, and owns only once it has it.

A blocking step (a lock taken, a directory or a cgroup made) runs in a thread so the
loop goes on. If the waiting coroutine is cancelled meanwhile, the thread still runs to
its end, and what it made would belong to no one: :func:`made_in_thread` undoes it as
soon as the thread returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["made_in_thread"]


async def made_in_thread[T](make: Callable[[], T], undo: Callable[[T], object]) -> T:
    """``make()``'s result, made in a worker thread. If cancelled while it runs, the
    cancellation propagates at once and ``undo`` is called with the result once the
    thread has made it (on the loop: keep it quick)."""
    making = asyncio.ensure_future(asyncio.to_thread(make))
    try:
        return await asyncio.shield(making)
    except asyncio.CancelledError:
        making.add_done_callback(lambda done: _undo(done, undo))
        raise


def _undo[T](done: asyncio.Future[T], undo: Callable[[T], object]) -> None:
    if not done.cancelled() and done.exception() is None:
        undo(done.result())
