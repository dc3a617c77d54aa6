"""The engine's `RunGate`, and one episode worker's place in it (`GatePlace`)."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator


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


class GatePlace:
    """One episode worker's place in a `RunGate` (with no gate, it does nothing).

    The first thread that enters is the worker; on any other thread, every call does
    nothing (a control is handed to other threads too: an abort, the engine's task)."""

    def __init__(self, gate: RunGate | None) -> None:
        self._gate = gate
        self._held = False  # the worker holds a place of `gate`
        self._worker: int | None = None

    def enter(self) -> None:
        """Take a place, on the worker's thread (the first to enter)."""
        if self._gate is None or self._held:
            return
        me = threading.get_ident()
        if self._worker is None:
            self._worker = me
        if me == self._worker:
            self._held = self._gate.enter()

    def leave(self) -> None:
        """Give the place back, on the worker's thread. Idempotent."""
        if self._held and threading.get_ident() == self._worker:
            self._held = False
            assert self._gate is not None
            self._gate.leave()

    @contextlib.contextmanager
    def left(self) -> Iterator[None]:
        """The place let go for the block, and taken again after it (the worker's)."""
        self.leave()
        try:
            yield
        finally:
            if threading.get_ident() == self._worker:
                self.enter()
