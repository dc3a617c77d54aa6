"""The calls an episode's worker makes into an event loop: a trio run (`run_in_trio`) or
the host's asyncio loop (`run_on_loop`), each cancelled at once by the episode's interrupt
or its deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from wmo_trio.control._gate import GatePlace
from wmo_trio.control._interrupts import CallInterrupted, Interrupts


def run_in_trio[T](interrupts: Interrupts, afn: Callable[..., Awaitable[T]],
                   args: tuple[Any, ...]) -> T:
    """`afn(*args)` in the trio run whose worker thread this is, or else in a trio run of
    its own; `CallInterrupted` when the interrupt cancelled it or came first."""
    if _in_trio_worker():
        return trio.from_thread.run(_cancellable, interrupts, afn, args)
    return trio.run(_cancellable, interrupts, afn, args)


async def _cancellable[T](interrupts: Interrupts, afn: Callable[..., Awaitable[T]],
                          args: tuple[Any, ...]) -> T:
    token = trio.lowlevel.current_trio_token()
    with trio.CancelScope() as scope:
        key = interrupts.register(lambda: _run_soon(token, scope.cancel))
        if key is None:
            raise CallInterrupted("the episode is stopping; the call was not started")
        try:
            return await afn(*args)
        except BaseExceptionGroup as group:
            # A call that ran a nursery (trio.run_process does) is cancelled as a group
            # of Cancelled: that is still just this scope's cancellation.
            if group.split(trio.Cancelled)[1] is None and scope.cancel_called:
                raise CallInterrupted("the episode is stopping; the call was cancelled") from None
            raise
        finally:
            interrupts.forget(key)
    raise CallInterrupted("the episode is stopping; the call was cancelled")


def run_on_loop[T](interrupts: Interrupts, place: GatePlace, loop: asyncio.AbstractEventLoop,
                   afn: Callable[..., Awaitable[T]], args: tuple[Any, ...], grace_s: float) -> T:
    """`afn(*args)` as a task on `loop`, waited for from this (worker) thread with its gate
    place let go; the interrupt cancels the task, and releases the worker `grace_s` later
    if the coroutine ignores its cancellation."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    started: list[asyncio.Task[T]] = []

    def start() -> None:  # on the host loop
        if interrupts.ended:
            _settle(done, error=CallInterrupted("the episode is stopping; call not started"))
            return
        task = loop.create_task(_awaited(afn, args))
        started.append(task)
        task.add_done_callback(finish)

    def finish(task: asyncio.Task[T]) -> None:  # on the host loop
        if task.cancelled():
            _settle(done, error=CallInterrupted("the episode is stopping; the call was cancelled"))
        elif (error := task.exception()) is not None:
            _settle(done, error=error)
        else:
            _settle(done, value=task.result())

    def cancel_on_loop() -> None:
        for task in started:
            task.cancel()
        # Release the worker if the coroutine ignores its cancellation.
        loop.call_later(grace_s, _settle, done, None,
                        CallInterrupted("the call ignored its cancellation"))

    def cancel() -> None:  # any thread
        try:
            loop.call_soon_threadsafe(cancel_on_loop)
        except RuntimeError:  # the loop is closed: nothing runs there any more
            _settle(done, error=CallInterrupted("the host loop is closed"))

    key = interrupts.register(cancel)
    if key is None:
        raise CallInterrupted("the episode is stopping; the call was not started")
    try:
        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:
            raise CallInterrupted("the host loop is closed") from None
        with place.left():
            return done.result()
    finally:
        interrupts.forget(key)


async def _awaited[T](afn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await afn(*args)


def _in_trio_worker() -> bool:
    """Whether this thread was started by `trio.to_thread.run_sync` (so `from_thread`
    reaches its run)."""
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:
        return False
    except trio.Cancelled:
        return True
    return True


def _run_soon(token: trio.lowlevel.TrioToken, fn: Callable[[], object]) -> None:
    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(fn)


def _settle[T](future: concurrent.futures.Future[T], value: T | None = None,
               error: BaseException | None = None) -> None:
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)  # type: ignore[arg-type]
    except concurrent.futures.InvalidStateError:  # settled by another thread meanwhile
        pass
