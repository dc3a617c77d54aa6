"""An episode's interrupt and its deadline: both end its calls in flight; only the interrupt
stops the episode."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("wmo_trio.control")


class CallInterrupted(Exception):
    """The call was cancelled, or never started, because its episode is stopping."""


class Interrupts:
    """Whether an episode's calls are over, why, and what cancels each call in flight.

    Two things end the calls: the interrupt (the episode stops: the one signal of a cancel,
    an abort or a close) and the deadline's expiry (the episode ends for its budget). Either
    cancels every call in flight and refuses every later one; `interrupted` tells them
    apart. Thread-safe; both are sticky.
    """

    def __init__(self) -> None:
        self._ended = threading.Event()
        self._interrupted = False
        self._lock = threading.Lock()
        self._cancels: dict[int, Callable[[], None]] = {}
        self._next_call = 0

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    @property
    def ended(self) -> bool:
        """Whether calls are refused: interrupted, or past the deadline."""
        return self._ended.is_set()

    def interrupt(self) -> None:
        """Stop the episode: end its calls (see `end_calls`). Idempotent."""
        self.end_calls(interrupt=True)

    def end_calls(self, *, interrupt: bool) -> None:
        """Run every registered cancellation (in this thread) and refuse every later
        registration; with `interrupt`, the episode is interrupted too. The flag is set
        before any call is cancelled, so a worker that sees its call fail sees why."""
        with self._lock:
            if interrupt:
                self._interrupted = True
            if self._ended.is_set():
                return
            self._ended.set()
            cancels = list(self._cancels.values())
        for cancel in cancels:
            try:
                cancel()
            except Exception:
                log.warning("cancelling a call in flight of an ending episode failed", exc_info=True)

    def register(self, cancel: Callable[[], None]) -> int | None:
        """Register `cancel` for the end of the calls; a key for `forget`, or None when
        they are over already (`cancel` is then not registered, and the caller must not
        start)."""
        with self._lock:
            if self._ended.is_set():
                return None
            self._next_call += 1
            self._cancels[self._next_call] = cancel
            return self._next_call

    def forget(self, key: int | None) -> None:
        if key is not None:
            with self._lock:
                self._cancels.pop(key, None)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the calls to end; whether they did."""
        return self._ended.wait(timeout)
