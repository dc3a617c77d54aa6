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

`interrupt()` (any thread) is the one signal that an episode stops: the engine sends it
when the episode's caller is cancelled, a runtime when it is aborted or closed, and the
episode ends as cancelled at its next boundary (`interrupted`). `expire()` is the deadline's
(the runtime's watch sends it): the episode ends for its budget instead. Either is sticky:
it cancels every call in flight at once (trio's cancel scope, asyncio's task cancellation)
and makes every later call fail with `CallInterrupted` before it starts. That is how a
stopped episode never makes another model call and never runs another command.

The parts, one job each: `_interrupts` (the sticky interrupt and the cancellations of the
calls in flight), `_gate` (the engine's `RunGate` and a worker's place in it), `_bridges`
(a call into a trio run or onto the host's asyncio loop); `CallControl` puts them
together with the episode's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from wmo_trio.control._bridges import run_in_trio, run_on_loop
from wmo_trio.control._gate import GatePlace, RunGate
from wmo_trio.control._interrupts import CallInterrupted, Interrupts

__all__ = ["CANCEL_GRACE_S", "CallControl", "CallInterrupted", "RunGate"]

# How long an interrupted asyncio call may take to finish its own cancellation handling
# (harbor's exec kills its process there) before the worker stops waiting for it.
CANCEL_GRACE_S = 10.0


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
        self._interrupts = Interrupts()
        self._place = GatePlace(gate)

    # -- interruption -------------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        """Whether the episode was interrupted: it stops (as cancelled) at its next boundary."""
        return self._interrupts.interrupted

    def interrupt(self) -> None:
        """Stop the episode: cancel every call in flight and refuse every later one, and
        from now on `interrupted` is true (before any call is cancelled). Idempotent."""
        self._interrupts.interrupt()

    def expire(self) -> None:
        """The episode's deadline came: cancel every call in flight and refuse every later
        one, as `interrupt` does, without interrupting it (it ends for its budget).
        Idempotent."""
        self._interrupts.end_calls(interrupt=False)

    def on_interrupt(self, cancel: Callable[[], None]) -> int | None:
        """Register `cancel` to run (in the calling thread of `interrupt` or `expire`, the
        first of them) when the episode's calls end. Returns a key for `forget`, or None
        when they have ended already, in which case `cancel` was not registered and the
        caller must not start."""
        return self._interrupts.register(cancel)

    def forget(self, key: int | None) -> None:
        self._interrupts.forget(key)

    # -- the run gate ------------------------------------------------------------------

    def enter_gate(self) -> None:
        """Take a place in the engine's `RunGate`, if any: the episode's worker, before it
        computes. That thread is then the gate's user; on any other, this does nothing."""
        self._place.enter()

    def leave_gate(self) -> None:
        """Give the place back (the worker, when it waits or is done). Idempotent; does
        nothing on another thread."""
        self._place.leave()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a wait of the worker's own (a blocking SDK call): its place in the gate is
        let go for the wait and taken again after it. Every wait of this class does it
        already; on a thread other than the worker's it changes nothing."""
        with self._place.left():
            yield

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
            woke = self._interrupts.wait(max(0.0, wait))
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
            return run_in_trio(self._interrupts, afn, args)

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
        return run_on_loop(self._interrupts, self._place, loop, afn, args, CANCEL_GRACE_S)
