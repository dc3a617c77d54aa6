"""Waiting for Ray from trio: an `ObjectRef`'s value without a thread per wait."""

from __future__ import annotations

import contextlib
from typing import Any

import trio


async def ray_value(ref: Any) -> Any:
    """The value of the Ray `ObjectRef` `ref` (or what its task raised), awaited in trio.

    Ray settles the reference's future in a thread of its own, which wakes this task. If
    the calling scope is cancelled, the wait ends with `trio.Cancelled`; the remote work
    goes on (stopping it is the caller's: a worker's `cancel`)."""
    future = ref.future()
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    future.add_done_callback(wake)
    await done.wait()
    return future.result()
