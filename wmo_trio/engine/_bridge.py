"""The asyncio side of an episode submitted to the trio engine, shared by both hosts.

An asyncio task submits an episode and waits for a future that the trio side settles with
a `Finished`, never with the episode's exception: only the waiting task knows whether it
was cancelled meanwhile, so only it decides what the caller gets (the result, the
exception, or its cancellation with nothing dropped silently). An asyncio cancellation is
passed to the trio side (the submission's cancel scope), and the task then waits, shielded,
until the episode has finished, trace included.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import outcome
import trio

from wmo_trio.engine._engine import Episode, EpisodeEngine, Finished
from wmo_trio.models import RunResult

log = logging.getLogger("wmo_trio.engine")


class Submission:
    """The trio side of one episode submitted from asyncio: cancellable before it starts."""

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self._cancel_requested = False

    def cancel(self) -> None:  # on the trio thread
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, engine: EpisodeEngine, episode: Episode, workers: int | None,
                  host_loop: asyncio.AbstractEventLoop) -> Finished:
        """Run the episode on the engine under this submission's cancel scope. The
        episode's calls to the host go to `host_loop`."""
        with trio.CancelScope() as scope:
            self._scope = scope
            if self._cancel_requested:
                scope.cancel()
            return await engine.finish_episode(episode, workers=workers, host_loop=host_loop)
        raise AssertionError("finish_episode returns even when cancelled")  # pragma: no cover


def settle(future: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
    """On the asyncio loop: hand a trio task's outcome to the task waiting for it."""
    if future.done():
        return
    if isinstance(result, outcome.Value):
        future.set_result(result.value)
        return
    assert isinstance(result, outcome.Error)
    if isinstance(result.error, trio.Cancelled):
        # Only a trio run shutting down cancels these tasks; asyncio code must not see a
        # trio.Cancelled (a BaseException it would not expect).
        future.set_exception(RuntimeError("the wmo_trio engine's trio run shut down"))
    else:
        future.set_exception(result.error)


async def await_finished(future: asyncio.Future[Finished], cancel: Callable[[], None], *,
                         cancelled: bool = False) -> RunResult:
    """Wait for an episode submitted to trio and give the caller its result.

    If the waiting task is cancelled (or `cancelled` says it already was), `cancel` it on
    the trio side, wait until it has finished, trace included, and raise the cancellation:
    the finished episode's outcome is dropped (`Finished.drop`), never silently.
    """
    try:
        if cancelled:
            raise asyncio.CancelledError
        finished = await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel()
        await wait_ignoring_cancellation(future)
        if future.cancelled():
            raise
        if (error := future.exception()) is not None:
            log.warning("the engine failed while a cancelled episode finished", exc_info=error)
        else:
            future.result().drop()
        raise
    return finished.unwrap()


async def wait_ignoring_cancellation(future: asyncio.Future[Any]) -> None:
    """Wait for `future` even if the waiting task is cancelled again meanwhile."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
