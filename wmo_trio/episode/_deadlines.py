"""One thread that fires every episode's wall-clock deadline.

An episode's budget must interrupt a model call or a command in flight, which a check
between steps cannot do. A timer thread per episode would double the thread count of a
1,024-episode run, so all deadlines share this watcher. It starts on first use and exits
after an idle period, so it never outlives the work that needed it by more than that.

A callback that raises (an environment whose `interrupt()` cannot reach a remote sandbox)
is logged; the watcher goes on, so every later deadline in the process still fires. That
holds for any exception, `BaseException`s included: in this thread a `KeyboardInterrupt`
or `SystemExit` can only be one a callback raised itself (signals go to the main thread,
and a thread's `SystemExit` ends that thread, not the process), and trio's `Cancelled` from
a callback that crossed into a finished run means only that this callback is over. None
of them is a reason to stop every other episode's budget.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("wmo_trio.episode")

_IDLE_EXIT_S = 2.0


class DeadlineHandle:
    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False


class DeadlineWatch:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, DeadlineHandle]] = []
        self._order = itertools.count()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, deadline: float, callback: Callable[[], None]) -> DeadlineHandle:
        """Call `callback` (in the watcher thread) once `time.monotonic()` reaches `deadline`."""
        handle = DeadlineHandle(deadline, callback)
        with self._wakeup:
            heapq.heappush(self._heap, (deadline, next(self._order), handle))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="wmo-trio-deadlines", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is handle:
                self._wakeup.notify()
        return handle

    def cancel(self, handle: DeadlineHandle) -> None:
        with self._wakeup:
            handle.cancelled = True
            # The watcher may be sleeping toward this very deadline: let it re-plan, so an
            # idle process does not keep the thread until a long-cancelled budget.
            if self._heap and self._heap[0][2] is handle:
                self._wakeup.notify()

    def _serve(self) -> None:
        try:
            self._fire_until_idle()
        except BaseException:
            # A defect of the watcher itself: it must not stay registered as running, so
            # the next `schedule` starts another, which fires what is still waiting.
            with self._wakeup:
                if self._thread is threading.current_thread():
                    self._thread = None
            raise

    def _fire_until_idle(self) -> None:
        while True:
            with self._wakeup:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    # Exit only after a whole idle period: a deadline scheduled and
                    # cancelled before this thread woke to it is not idleness.
                    if not self._wakeup.wait(_IDLE_EXIT_S) and not self._heap:
                        self._thread = None
                        return
                    continue
                deadline, _, handle = self._heap[0]
                delay = deadline - time.monotonic()
                if delay > 0:
                    self._wakeup.wait(delay)
                    continue
                heapq.heappop(self._heap)
            if not handle.cancelled:
                try:
                    handle.callback()
                except BaseException:  # the callback's failure, not the watcher's: see above
                    log.warning("a deadline's callback raised; later deadlines still fire",
                                exc_info=True)


DEADLINES = DeadlineWatch()
