"""The shared deadline watcher: one thread for every episode's budget."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from wmo_trio.episode import _deadlines as deadlines
from wmo_trio.episode._deadlines import DeadlineWatch


def test_deadlines_fire_in_order() -> None:
    watch = DeadlineWatch()
    fired: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    with watch._wakeup:  # the watcher fires neither before both are scheduled
        watch.schedule(now + 0.2, lambda: (fired.append("late"), done.set()))
        watch.schedule(now + 0.05, lambda: fired.append("early"))
    assert done.wait(30)
    assert fired == ["early", "late"]


def test_a_cancelled_deadline_never_fires() -> None:
    watch = DeadlineWatch()
    fired: list[str] = []
    with watch._wakeup:  # due at once, but the watcher cannot fire it before the cancel
        watch.cancel(watch.schedule(time.monotonic(), lambda: fired.append("x")))
    marker = threading.Event()
    watch.schedule(time.monotonic(), marker.set)  # fires after the cancelled one was due
    assert marker.wait(30)
    assert fired == []


def test_the_watcher_exits_once_only_cancelled_deadlines_remain(monkeypatch: Any) -> None:
    monkeypatch.setattr(deadlines, "_IDLE_EXIT_S", 0.05)
    watch = DeadlineWatch()
    handle = watch.schedule(time.monotonic() + 3600, lambda: None)
    thread = watch._thread
    assert thread is not None and thread.is_alive()
    watch.cancel(handle)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert watch._thread is None


def test_deadlines_cancelled_before_the_watcher_wakes_do_not_restart_it() -> None:
    # Short episodes schedule and cancel their budget back to back; the watcher waking to
    # an empty heap is not an idle period, and must not exit to be started again.
    watch = DeadlineWatch()
    watch.cancel(watch.schedule(time.monotonic() + 60, lambda: None))
    first = watch._thread
    for _ in range(20):
        _until_waiting(watch)  # the watcher is idle, waiting for work
        with watch._wakeup:  # it is notified, but runs only after both calls
            watch.cancel(watch.schedule(time.monotonic() + 60, lambda: None))
    _until_waiting(watch)
    assert watch._thread is first and first is not None and first.is_alive()


def _until_waiting(watch: DeadlineWatch) -> None:
    """Until the watcher thread waits on its condition (it has handled all it was told)."""
    limit = time.monotonic() + 30
    while True:
        with watch._wakeup:
            if watch._wakeup._waiters:  # type: ignore[attr-defined]
                return
        assert time.monotonic() < limit, "the watcher never went back to waiting"
        time.sleep(0.001)


def test_a_raising_callback_is_logged_and_later_deadlines_still_fire(caplog: Any) -> None:
    # issue 15.2: one callback that raises (an environment whose interrupt() cannot reach
    # its sandbox) used to kill the watcher, and no deadline fired again in the process.
    watch = DeadlineWatch()

    def unreachable() -> None:
        raise ConnectionError("the sandbox cannot be reached")

    watch.schedule(time.monotonic(), unreachable)
    later = threading.Event()
    watch.schedule(time.monotonic() + 0.05, later.set)
    assert later.wait(10)
    assert "a deadline's callback raised" in caplog.text
    again = threading.Event()
    watch.schedule(time.monotonic(), again.set)
    assert again.wait(10)


class _CancelledLike(BaseException):
    """Stands for trio's Cancelled, a BaseException, from a callback into a finished run."""


@pytest.mark.parametrize("raised", [KeyboardInterrupt(), SystemExit(1), _CancelledLike(),
                                    BaseExceptionGroup("both", [KeyboardInterrupt(),
                                                                ValueError("x")])])
def test_a_callback_raising_a_base_exception_leaves_the_same_watcher_serving(
    caplog: Any, raised: BaseException
) -> None:
    watch = DeadlineWatch()

    def interrupt() -> None:
        raise raised

    raised_once = threading.Event()
    watch.schedule(time.monotonic(), lambda: (raised_once.set(), interrupt()))
    assert raised_once.wait(10)
    first = watch._thread
    later = threading.Event()
    watch.schedule(time.monotonic(), later.set)
    assert later.wait(10)
    assert watch._thread is first and first is not None and first.is_alive()
    assert "a deadline's callback raised" in caplog.text
    assert type(raised).__name__ in caplog.text


def test_a_watcher_that_dies_of_a_defect_is_unregistered_and_replaced(
    monkeypatch: Any
) -> None:
    # A defect in the watcher's own code (here its clock, failing once in its thread):
    # the thread ends, the watch no longer counts it as running, and the next schedule
    # starts another that fires the deadline left waiting as well as the new one.
    watch = DeadlineWatch()
    real_monotonic = time.monotonic
    failed = threading.Event()

    def clock() -> float:
        if threading.current_thread() is watch._thread and not failed.is_set():
            failed.set()
            raise RuntimeError("a defect in the watcher")
        return real_monotonic()

    monkeypatch.setattr(deadlines.time, "monotonic", clock)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # expected to die
    waiting = threading.Event()
    watch.schedule(real_monotonic(), waiting.set)
    dead = watch._thread
    assert failed.wait(10) and dead is not None
    dead.join(10)
    assert not dead.is_alive() and watch._thread is None and not waiting.is_set()
    new = threading.Event()
    watch.schedule(real_monotonic(), new.set)
    assert waiting.wait(10) and new.wait(10)
    assert watch._thread is not None and watch._thread is not dead
