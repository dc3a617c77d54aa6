"""An episode's interrupt: sticky, and the cancellations of its calls in flight."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("wmo_trio.control")


class CallInterrupted(Exception):
    """The call was cancelled, or never started, because its episode is stopping."""


class Interrupts:
    """Whether an episode is interrupted, and what cancels each of its calls in flight.
    Thread-safe; the interrupt is sticky."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._cancels: dict[int, Callable[[], None]] = {}
        self._next_call = 0

    @property
    def interrupted(self) -> bool:
        return self._set.is_set()

    def interrupt(self) -> None:
        """Run every registered cancellation (in this thread) and refuse every later
        registration. Idempotent."""
        with self._lock:
            if self._set.is_set():
                return
            self._set.set()
            cancels = list(self._cancels.values())
        for cancel in cancels:
            try:
                cancel()
            except Exception:
                log.warning("cancelling a call of an interrupted episode failed", exc_info=True)

    def register(self, cancel: Callable[[], None]) -> int | None:
        """Register `cancel` for the interrupt; a key for `forget`, or None when the
        episode is interrupted already (`cancel` is then not registered, and the caller
        must not start)."""
        with self._lock:
            if self._set.is_set():
                return None
            self._next_call += 1
            self._cancels[self._next_call] = cancel
            return self._next_call

    def forget(self, key: int | None) -> None:
        if key is not None:
            with self._lock:
                self._cancels.pop(key, None)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the interrupt; whether it came."""
        return self._set.wait(timeout)
