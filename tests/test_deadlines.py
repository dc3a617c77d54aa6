"""The shared deadline watcher: one thread for every episode's budget."""

from __future__ import annotations

import threading
import time
from typing import Any

from wmo_trio.episode import deadlines
from wmo_trio.episode.deadlines import DeadlineWatch


def test_deadlines_fire_in_order() -> None:
    watch = DeadlineWatch()
    fired: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    watch.schedule(now + 0.2, lambda: (fired.append("late"), done.set()))
    watch.schedule(now + 0.05, lambda: fired.append("early"))
    assert done.wait(5)
    assert fired == ["early", "late"]


def test_a_cancelled_deadline_never_fires() -> None:
    watch = DeadlineWatch()
    fired: list[str] = []
    handle = watch.schedule(time.monotonic() + 0.05, lambda: fired.append("x"))
    watch.cancel(handle)
    marker = threading.Event()
    watch.schedule(time.monotonic() + 0.1, marker.set)
    assert marker.wait(5)
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
