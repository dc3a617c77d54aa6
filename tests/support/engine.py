"""A fake episode for the engine's tests, and a burst of them run and checked, shared
with the interpreters the host tests start."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import outcome

from wmo_trio.control import CallControl
from wmo_trio.engine import Host
from wmo_trio.models import RunResult, StopReason


class FakeEpisode:
    """An episode whose worker waits `duration` seconds or until stopped, and which
    records what the engine did to it, in order. `on_run` and `on_close` are called in the
    worker's thread once `run` has begun (after its "run" is noted) and in `close`."""

    stop_is_quick = False

    def __init__(self, duration: float = 0.0, *, error: BaseException | None = None,
                 on_run: Any = None, on_close: Any = None,
                 record_error: BaseException | None = None) -> None:
        self.duration = duration
        self.error = error
        self.on_run = on_run
        self.on_close = on_close
        self.record_error = record_error
        self.stopping = threading.Event()
        self.events: list[Any] = []
        self.worker_returned_at: float | None = None
        self.lock = threading.Lock()

    def _note(self, event: Any) -> None:
        with self.lock:
            self.events.append(event)

    def run(self, control: CallControl) -> RunResult:
        self.control = control
        self._note("run")
        self.run_thread = threading.current_thread()
        if self.on_run is not None:
            self.on_run()
        self.stopping.wait(self.duration)
        self.worker_returned_at = time.monotonic()
        if self.error is not None:
            raise self.error
        reason = StopReason.CANCELLED if self.stopping.is_set() else StopReason.SUBMITTED
        return RunResult(task_id="t", steps=[], stop_reason=reason, turns=0)

    def stop(self) -> None:
        self._note("stop")
        self.stop_thread = threading.current_thread()
        self.interrupted_before_stop = self.control.interrupted
        self.stopping.set()

    def close(self) -> None:
        self._note("close")
        self.close_thread = threading.current_thread()
        if self.on_close is not None:
            self.on_close()

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        self._note(("record", type(result).__name__, cancelled))
        if self.record_error is not None:
            raise self.record_error


async def trials(host: Host, n: int) -> list[tuple[str, FakeEpisode, float]]:
    """`n` episodes at once on `host`, each awaited the way harbor awaits a trial (a
    timeout around it, what `asyncio.wait_for` does): the odd ones end on their own, the
    even ones would wait 30 s and their timeout fires once their worker runs. Returns how
    each ended ("done" or "timeout"), its episode, and when its trial got control back."""
    loop = asyncio.get_running_loop()

    async def trial(index: int) -> tuple[str, FakeEpisode, float]:
        try:
            async with asyncio.timeout(None) as timeout:
                episode = FakeEpisode()
                if index % 2 == 0:
                    episode.duration = 30
                    episode.on_run = lambda: loop.call_soon_threadsafe(
                        lambda: timeout.reschedule(loop.time()))
                await host.run_episode(episode, workers=n)
            return "done", episode, 0.0
        except TimeoutError:
            return "timeout", episode, time.monotonic()

    return await asyncio.gather(*(trial(i) for i in range(n)))


def check_trials(outcomes: list[tuple[str, FakeEpisode, float]]) -> None:
    """What `trials` must give: every timed-out episode stopped and waited for before its
    trial got control back, every other one ended on its own."""
    for index, (kind, episode, returned_at) in enumerate(outcomes):
        if index % 2:
            assert kind == "done"
            assert episode.events == ["run", "close", ("record", "Value", False)]
        else:
            assert kind == "timeout"
            assert episode.events == ["run", "stop", "close", ("record", "Value", True)]
            assert episode.worker_returned_at is not None
            assert episode.worker_returned_at <= returned_at

