"""How an episode's worker thread waits and calls out: `CallControl`.

An episode runs as plain synchronous Python in a worker thread. Everything it waits for
goes through its `CallControl`, which the engine creates for it and which it hands to its
provider and its environment:

- `run_async(afn, *args)`: a trio async function, run in the engine's trio run (a model
  call through an async SDK, a trio-native environment's command, a timed wait);
- `run_host(afn, *args)`: an asyncio coroutine function, run on the host's asyncio loop
  (harbor's `environment.exec`);
- `sleep(seconds)`: a wait that ends early when the episode is interrupted;
- `blocking()`: around any other wait of the worker's own (a blocking SDK call), so that
  the engine's `RunGate` lets another worker run meanwhile.

`interrupt()` (any thread; the engine calls it when the episode's caller is cancelled, the
runtime when it is aborted or out of budget) is sticky: it cancels every call in flight at
once (trio's cancel scope, asyncio's task cancellation) and makes every later call fail
with `CallInterrupted` before it starts. That is how a stopped episode never makes another
model call and never runs another command.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

log = logging.getLogger("wmo_trio.control")

# How long an interrupted asyncio call may take to finish its own cancellation handling
# (harbor's exec kills its process there) before the worker stops waiting for it.
CANCEL_GRACE_S = 10.0


class CallInterrupted(Exception):
    """The call was cancelled, or never started, because its episode is stopping."""


class RunGate:
    """How many episode workers run Python at once: at most `size`.

    A worker holds a place while it computes and lets it go whenever it waits (every wait
    of its `CallControl`). Without the gate, a burst whose calls return together (a
    thousand model replies, a thousand timers) makes a thousand threads runnable at once,
    and the interpreter lock is handed among them in no order: the event loops, which need
    it for a moment each, wait behind the whole crowd (`make bench`, real traffic, loop
    heartbeats). With it, the other workers wait their turn on the gate, in order, where
    they do not compete for the lock.

    The gate only orders work, it never holds an episode back for long: a worker that has
    waited `patience_s` for a place goes on without one (a worker that blocks outside its
    `CallControl` keeps its place meanwhile; this bounds what that costs the others).
    """

    def __init__(self, size: int, *, patience_s: float = 0.5) -> None:
        if size < 1:
            raise ValueError(f"a run gate needs at least one place, got {size}")
        self.patience_s = patience_s
        self._lock = threading.Lock()
        self._free = size
        # Workers waiting for a place, first come first served: each waits on a lock of its
        # own, which `leave` releases to hand it the place (a semaphore would let the worker
        # that just left take its place again ahead of them).
        self._waiting: collections.deque[threading.Lock] = collections.deque()

    def enter(self) -> bool:
        """Take a place, waiting at most `patience_s` (in turn); False when the wait ran
        out, and the worker goes on without one."""
        with self._lock:
            if self._free and not self._waiting:
                self._free -= 1
                return True
            turn = threading.Lock()
            turn.acquire()
            self._waiting.append(turn)
        if turn.acquire(timeout=self.patience_s):
            return True
        with self._lock:
            try:
                self._waiting.remove(turn)
            except ValueError:
                return True  # handed a place just as the wait ran out: it is ours
        return False

    def leave(self) -> None:
        """Give a place back: to the longest-waiting worker, if any."""
        with self._lock:
            if self._waiting:
                self._waiting.popleft().release()
            else:
                self._free += 1


class CallControl:
    """Interruption, deadline and outbound calls of one episode. Thread-safe.

    `deadline` is a `time.monotonic()` value (None: no deadline); the runtime sets it when
    the episode starts. `host_loop` is the asyncio loop `run_host` submits to, given by
    the engine when the episode came from an asyncio host.
    """

    def __init__(self, deadline: float | None = None, *,
                 host_loop: asyncio.AbstractEventLoop | None = None,
                 gate: RunGate | None = None) -> None:
        self.deadline = deadline
        self._host_loop = host_loop
        self._gate = gate
        self._in_gate = False  # the episode's worker holds a place of `gate`
        self._gate_thread: int | None = None  # that worker
        self._interrupted = threading.Event()
        self._lock = threading.Lock()
        self._cancels: dict[int, Callable[[], None]] = {}
        self._next_call = 0

    # -- interruption -------------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def interrupt(self) -> None:
        """Cancel every call in flight and refuse every later one. Idempotent."""
        with self._lock:
            if self._interrupted.is_set():
                return
            self._interrupted.set()
            cancels = list(self._cancels.values())
        for cancel in cancels:
            try:
                cancel()
            except Exception:
                log.warning("cancelling a call of an interrupted episode failed", exc_info=True)

    def on_interrupt(self, cancel: Callable[[], None]) -> int | None:
        """Register `cancel` to run (in the interrupting thread) when the episode is
        interrupted. Returns a key for `forget`, or None when the episode is interrupted
        already, in which case `cancel` was not registered and the caller must not start."""
        with self._lock:
            if self._interrupted.is_set():
                return None
            self._next_call += 1
            self._cancels[self._next_call] = cancel
            return self._next_call

    def forget(self, key: int | None) -> None:
        if key is not None:
            with self._lock:
                self._cancels.pop(key, None)

    # -- the run gate ------------------------------------------------------------------

    def enter_gate(self) -> None:
        """Take a place in the engine's `RunGate`, if any: the episode's worker, before it
        computes. That thread is then the gate's user; on any other, this does nothing."""
        if self._gate is None or self._in_gate:
            return
        me = threading.get_ident()
        if self._gate_thread is None:
            self._gate_thread = me
        if me == self._gate_thread:
            self._in_gate = self._gate.enter()

    def leave_gate(self) -> None:
        """Give the place back (the worker, when it waits or is done). Idempotent; does
        nothing on another thread."""
        if self._in_gate and threading.get_ident() == self._gate_thread:
            self._in_gate = False
            assert self._gate is not None
            self._gate.leave()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a wait of the worker's own (a blocking SDK call): its place in the gate is
        let go for the wait and taken again after it. Every wait of this class does it
        already; on a thread other than the worker's it changes nothing."""
        self.leave_gate()
        try:
            yield
        finally:
            if threading.get_ident() == self._gate_thread:
                self.enter_gate()

    # -- time ---------------------------------------------------------------------------

    def remaining(self) -> float | None:
        """Seconds until the deadline (never negative), or None without a deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def sleep(self, seconds: float) -> bool:
        """Wait up to `seconds`, bounded by the deadline. False when cut short (by an
        interrupt or by the deadline)."""
        remaining = self.remaining()
        wait = seconds if remaining is None else min(seconds, remaining)
        with self.blocking():
            woke = self._interrupted.wait(max(0.0, wait))
        if woke:
            return False
        return remaining is None or seconds <= remaining

    # -- calls ------------------------------------------------------------------------------

    def run_async[T](self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the trio async function `afn(*args)` and return its result; blocking.

        From a worker thread of a trio run (an engine episode) it runs in that run, inside
        the task that waits for the worker. Anywhere else it runs in a trio run of its own,
        started for the call (standalone use and tests). An interrupt cancels it at once;
        the worker then gets `CallInterrupted`. Its own exceptions propagate.
        """
        with self.blocking():
            if _in_trio_worker():
                return trio.from_thread.run(self._cancellable, afn, args)
            return trio.run(self._cancellable, afn, args)

    async def _cancellable[T](self, afn: Callable[..., Awaitable[T]],
                              args: tuple[Any, ...]) -> T:
        token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            key = self.on_interrupt(lambda: _run_soon(token, scope.cancel))
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
                self.forget(key)
        raise CallInterrupted("the episode is stopping; the call was cancelled")

    def run_host[T](self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the asyncio coroutine function `afn(*args)` on the host's loop and return
        its result; blocking, from the worker thread.

        One hop each way (`call_soon_threadsafe` there, a future back). An interrupt
        cancels the asyncio task; the worker gets `CallInterrupted` once the coroutine has
        handled its cancellation, or after `CANCEL_GRACE_S` if it ignores it.
        """
        loop = self._host_loop
        if loop is None:
            raise RuntimeError("this episode has no host asyncio loop to call into; it was "
                               "not started from an asyncio host")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        started: list[asyncio.Task[T]] = []

        def start() -> None:  # on the host loop
            if self.interrupted:
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
            loop.call_later(CANCEL_GRACE_S, _settle, done, None,
                            CallInterrupted("the call ignored its cancellation"))

        def cancel() -> None:  # any thread
            try:
                loop.call_soon_threadsafe(cancel_on_loop)
            except RuntimeError:  # the loop is closed: nothing runs there any more
                _settle(done, error=CallInterrupted("the host loop is closed"))

        key = self.on_interrupt(cancel)
        if key is None:
            raise CallInterrupted("the episode is stopping; the call was not started")
        try:
            try:
                loop.call_soon_threadsafe(start)
            except RuntimeError:
                raise CallInterrupted("the host loop is closed") from None
            with self.blocking():
                return done.result()
        finally:
            self.forget(key)


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
