"""The trio engine and its hosts (issue: engine). The engine alone under pytest-trio; the
hosts under an asyncio driver shaped like harbor's trial (tasks, `asyncio.wait_for`)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import outcome
import pytest
import trio
from support.engine import FakeEpisode, check_trials, trials

from wmo_trio.control import CallControl, CallInterrupted
from wmo_trio.engine import EpisodeEngine, LoopServingHost
from wmo_trio.models import RunResult, StopReason

ROOT = Path(__file__).resolve().parent.parent




def meeting(n: int) -> list[FakeEpisode]:
    """`n` episodes whose workers only get past their start when all `n` run at once, so
    each has a thread of its own."""
    barrier = threading.Barrier(n, timeout=10)

    class Meeting(FakeEpisode):
        def run(self, control: CallControl) -> RunResult:
            barrier.wait()
            return super().run(control)

    return [Meeting() for _ in range(n)]


# -- the engine on its own ----------------------------------------------------------------


async def test_an_episode_returns_its_result_after_close_and_record() -> None:
    episode = FakeEpisode()
    result = await EpisodeEngine().run_episode(episode)
    assert result.stop_reason is StopReason.SUBMITTED
    assert episode.events == ["run", "close", ("record", "Value", False)]


def cancelling(scope: trio.CancelScope) -> Callable[[], None]:
    """For an episode's hook, called in its worker thread: cancel `scope` in this trio run,
    as a caller's timeout would, at the moment the hook is reached."""
    token = trio.lowlevel.current_trio_token()
    return lambda: token.run_sync_soon(scope.cancel)


async def _cancel_once_all_blocked(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_a_cancelled_episode_is_stopped_waited_for_cleaned_up_then_cancelled() -> None:
    with trio.CancelScope() as scope:  # cancelled once the worker runs
        episode = FakeEpisode(duration=30, on_run=cancelling(scope))
        await EpisodeEngine().run_episode(episode)
    assert scope.cancelled_caught
    assert episode.events == ["run", "stop", "close", ("record", "Value", True)]
    assert episode.worker_returned_at is not None


async def test_a_cancel_interrupts_the_episodes_control_before_its_stop() -> None:
    # The interrupt is the episode's one stop signal; stop() is only what it takes besides.
    with trio.CancelScope() as scope:
        episode = FakeEpisode(duration=30, on_run=cancelling(scope))
        await EpisodeEngine().run_episode(episode)
    assert episode.interrupted_before_stop


@pytest.mark.parametrize("quick", [False, True])
async def test_stop_runs_on_the_trio_thread_only_when_the_episode_says_it_is_quick(
    quick: bool,
) -> None:
    with trio.CancelScope() as scope:
        episode = FakeEpisode(duration=30, on_run=cancelling(scope))
        episode.stop_is_quick = quick
        await EpisodeEngine().run_episode(episode)
    assert episode.events == ["run", "stop", "close", ("record", "Value", True)]
    on_trio_thread = episode.stop_thread is threading.current_thread()
    assert on_trio_thread is quick and episode.stop_thread is not episode.run_thread
    # close and the trace write run in the worker's own thread, after its run returned
    assert episode.close_thread is episode.run_thread


async def test_a_cancellation_during_cleanup_still_propagates() -> None:
    with trio.CancelScope() as scope:
        episode = FakeEpisode(on_close=cancelling(scope))
        await EpisodeEngine().run_episode(episode)
        pytest.fail("the cancellation that arrived during cleanup was lost")
    assert scope.cancelled_caught
    # the worker had finished on its own: its trace is the full result
    assert episode.events == ["run", "close", ("record", "Value", False)]


class _Defect(BaseException):
    """Not an Exception: what a defect in a close or a trace write could raise."""


async def test_a_close_that_raises_a_base_exception_is_logged_and_the_trace_still_written(
        caplog: pytest.LogCaptureFixture) -> None:
    def fail() -> None:
        raise _Defect("close broke")

    episode = FakeEpisode(on_close=fail)
    result = await EpisodeEngine(workers=1).run_episode(episode)
    assert result.stop_reason is StopReason.SUBMITTED
    assert episode.events == ["run", "close", ("record", "Value", False)]
    assert "closing an episode failed" in caplog.text


async def test_a_trace_write_that_raises_a_base_exception_reaches_the_caller_as_itself() -> None:
    episode = FakeEpisode(record_error=_Defect("disk broke"))
    with pytest.raises(_Defect, match="disk broke"):
        await EpisodeEngine(workers=1).run_episode(episode)


async def test_a_cancellation_before_the_worker_starts_still_records() -> None:
    engine = EpisodeEngine(workers=1)
    blocker, waiting = FakeEpisode(duration=30), FakeEpisode()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run_episode, blocker)
        await trio.testing.wait_all_tasks_blocked()  # the blocker holds the one token
        with trio.CancelScope() as scope:
            # cancelled once it waits for that token
            nursery.start_soon(_cancel_once_all_blocked, scope)
            await engine.run_episode(waiting)
        # Let the blocker end; not blocker.stop(), which reads the control its run sets and
        # may run before the worker's thread has begun it on a busy machine.
        blocker.stopping.set()
    assert scope.cancelled_caught
    assert "run" not in waiting.events  # it never got a worker
    assert waiting.events[-2:] == ["close", ("record", "Error", True)]


async def test_an_episode_exception_arrives_as_itself() -> None:
    episode = FakeEpisode(error=KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        await EpisodeEngine().run_episode(episode)
    assert episode.events == ["run", "close", ("record", "Error", False)]


async def test_a_failed_close_is_logged_and_the_result_stands(caplog: Any) -> None:
    def fail() -> None:
        raise OSError("cannot close")

    result = await EpisodeEngine().run_episode(FakeEpisode(on_close=fail))
    assert result.stop_reason is StopReason.SUBMITTED
    assert "closing an episode failed" in caplog.text


async def test_a_lost_trace_of_a_healthy_episode_is_an_error() -> None:
    with pytest.raises(OSError, match="disk full"):
        await EpisodeEngine().run_episode(FakeEpisode(record_error=OSError("disk full")))


async def test_a_lost_trace_after_cancellation_is_logged(caplog: Any) -> None:
    with trio.CancelScope() as scope:
        episode = FakeEpisode(duration=30, on_run=cancelling(scope), record_error=OSError("disk full"))
        await EpisodeEngine().run_episode(episode)
    assert scope.cancelled_caught
    assert "writing the trace of a stopped episode failed" in caplog.text


async def test_the_limiter_grows_and_never_shrinks() -> None:
    engine = EpisodeEngine(workers=4)
    engine.ensure_workers(16)
    engine.ensure_workers(8)
    assert engine.limiter.total_tokens == 16
    await engine.run_episode(FakeEpisode(), workers=32)
    assert engine.limiter.total_tokens == 32


async def test_episodes_run_concurrently_up_to_the_limit() -> None:
    engine = EpisodeEngine(workers=24)
    async with trio.open_nursery() as nursery:  # hangs, then fails, unless all 24 run at once
        for episode in meeting(24):
            nursery.start_soon(engine.run_episode, episode)


async def test_warmed_workers_are_the_threads_a_burst_of_episodes_runs_on() -> None:
    # trio's thread cache is process-wide: idle threads of earlier tests count as warm.
    engine = EpisodeEngine(workers=2)
    await engine.warm_workers(12)
    warmed = set(threading.enumerate())
    assert engine.limiter.total_tokens == 12

    episodes = meeting(12)
    async with trio.open_nursery() as nursery:
        for episode in episodes:
            nursery.start_soon(engine.run_episode, episode)
    assert {e.run_thread for e in episodes} <= warmed  # no thread was created for them
    await engine.warm_workers(12)  # still fresh: starts nothing
    assert set(threading.enumerate()) <= warmed


# -- hosts: an asyncio driver shaped like harbor's trials ---------------------------------






async def _drive(host_mode: str, n: int = 64) -> list[tuple[str, FakeEpisode, float]]:
    host = LoopServingHost.for_loop(asyncio.get_running_loop(), host_mode)  # type: ignore[arg-type]
    return await trials(host, n)


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_timed_out_episodes_are_stopped_and_waited_for(mode: str) -> None:
    check_trials(asyncio.run(_drive(mode)))


class _CancelRightAfterTheEngineSettles(asyncio.SelectorEventLoop):
    """A loop that, once `armed`, cancels `victim` in the same callback as the next one the
    engine's thread hands it: the caller's cancellation then arrives just as the episode's
    outcome reaches the loop, before the waiting task has seen it."""

    armed = threading.Event()
    victim: asyncio.Task[Any] | None = None

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        if threading.current_thread().name == "wmo-trio-engine" and self.armed.is_set():
            self.armed.clear()
            victim = self.victim
            assert victim is not None

            def then_cancel(*args: Any) -> None:
                callback(*args)
                victim.cancel()

            return super().call_soon_threadsafe(then_cancel, *args, context=context)
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_a_lost_trace_is_logged_when_the_cancellation_races_its_error(caplog: Any) -> None:
    # issue 15.1: the episode finished on its own and its trace write failed; the caller's
    # cancellation arrived just as that error reached the loop. The caller gets its
    # cancellation, and the lost trace is logged, not dropped.
    loop_type = _CancelRightAfterTheEngineSettles

    class FailingTrace(FakeEpisode):
        def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
            loop_type.armed.set()
            super().record(result, cancelled)

    episode = FailingTrace(record_error=OSError("disk full"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        host = LoopServingHost.for_loop(loop, "thread")
        task = asyncio.create_task(host.run_episode(episode))
        loop_type.victim = task
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main(), loop_factory=loop_type)
    assert episode.events == ["run", "close", ("record", "Value", False)]
    lost = [r for r in caplog.records if r.getMessage() == "writing the trace of a stopped episode failed"]
    assert len(lost) == 1 and isinstance(lost[0].exc_info[1], OSError)  # type: ignore[index]


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_prepare_starts_the_workers_before_the_burst(mode: str) -> None:
    async def main() -> set[threading.Thread]:
        host = LoopServingHost.for_loop(asyncio.get_running_loop(), mode)  # type: ignore[arg-type]
        await host.prepare(16)
        warmed = set(threading.enumerate())
        episodes = meeting(16)
        await asyncio.gather(*(host.run_episode(e, workers=16) for e in episodes))
        return {e.run_thread for e in episodes} - warmed

    assert asyncio.run(main()) == set()


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_episode_errors_reach_asyncio_unwrapped(mode: str) -> None:
    async def main() -> None:
        host = LoopServingHost.for_loop(asyncio.get_running_loop(), mode)  # type: ignore[arg-type]
        with pytest.raises(KeyError, match="boom"):
            await host.run_episode(FakeEpisode(error=KeyError("boom")))

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_a_failing_prepare_reaches_asyncio_as_itself(mode: str) -> None:
    def load() -> None:
        raise ImportError("the provider's SDK is not installed")

    async def main() -> None:
        host = LoopServingHost.for_loop(asyncio.get_running_loop(), mode)  # type: ignore[arg-type]
        with pytest.raises(ImportError, match="SDK is not installed"):
            await host.prepare(4, load=load)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_a_prepare_cut_short_by_the_end_of_the_trio_run_is_an_error_asyncio_understands(
    mode: str,
) -> None:
    # The keeper ends the trio run when the loop shuts down; ended here while a prepare
    # is still loading, its trio task is cancelled, and asyncio must get an error of its
    # own kind, not trio.Cancelled.
    loading = threading.Event()

    def load() -> None:  # in a trio worker thread: returns once its task is cancelled
        loading.set()
        for _ in range(3000):
            try:
                trio.from_thread.check_cancelled()
            except trio.Cancelled:
                return
            time.sleep(0.01)

    async def main() -> None:
        host = LoopServingHost.for_loop(asyncio.get_running_loop(), mode)  # type: ignore[arg-type]
        preparing = asyncio.ensure_future(host.prepare(4, load=load))
        await asyncio.to_thread(loading.wait, 30)
        assert host._keeper is not None
        host._keeper.cancel()
        with pytest.raises(RuntimeError, match="trio run shut down"):
            await preparing

    asyncio.run(main())


class _EngineDefect(BaseException):
    """What no `except Exception` catches: an engine that breaks its promise never to raise."""


def test_an_engine_failure_while_the_caller_is_cancelled_is_logged_and_the_cancellation_stands(
    caplog: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # finish_episode never raises; if a defect made it, a cancelled caller still gets its
    # cancellation, and the failure is not dropped.
    entered: list[Any] = []  # (the asyncio loop, its event), set once the engine is in

    async def broken(*args: Any, **kwargs: Any) -> Any:
        loop, event = entered[0]
        loop.call_soon_threadsafe(event.set)
        try:
            await trio.sleep_forever()
        finally:
            raise _EngineDefect("the engine broke")

    monkeypatch.setattr(EpisodeEngine, "finish_episode", broken)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        entered.append((loop, asyncio.Event()))
        host = LoopServingHost.for_loop(loop, "thread")
        task = asyncio.ensure_future(host.run_episode(FakeEpisode()))
        await entered[0][1].wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    [failed] = [r for r in caplog.records
                if r.getMessage() == "the engine failed while a cancelled episode finished"]
    assert failed.exc_info is not None
    error = failed.exc_info[1]
    assert isinstance(error, _EngineDefect) or (
        isinstance(error, BaseExceptionGroup) and error.split(_EngineDefect)[0] is not None)


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_nothing_outlives_the_loop_and_a_second_run_works(mode: str) -> None:
    for _ in range(2):
        outcomes = asyncio.run(_drive(mode, n=8))
        assert len(outcomes) == 8
        assert not LoopServingHost._hosts
        assert "wmo-trio-engine" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_host_calls_reach_asyncio_and_are_cancelled_with_their_episode(mode: str) -> None:
    seen: list[str] = []
    fire_timeout: list[Callable[[], None]] = []  # the trial's timeout, fired by the 30 s call

    async def slow_call(seconds: float) -> str:
        if seconds == 30:
            fire_timeout[0]()
        try:
            await asyncio.sleep(seconds)
            return "finished"
        except asyncio.CancelledError:
            seen.append("asyncio side cancelled")
            raise

    class Calling(FakeEpisode):
        def run(self, control: CallControl) -> RunResult:
            seen.append(control.run_host(slow_call, 0.01))
            try:
                control.run_host(slow_call, 30)
            except CallInterrupted:
                seen.append("worker saw CallInterrupted")
            return super().run(control)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        host = LoopServingHost.for_loop(loop, mode)  # type: ignore[arg-type]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as timeout:
                fire_timeout.append(lambda: timeout.reschedule(loop.time()))
                await host.run_episode(Calling())

    asyncio.run(main())
    assert seen == ["finished", "asyncio side cancelled", "worker saw CallInterrupted"]


def _python(code: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], capture_output=True,
        text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


@pytest.mark.slow  # a fresh interpreter
def test_importing_wmo_trio_leaves_asyncio_alone() -> None:
    out = _python("""
        import asyncio, sys
        import wmo_trio, wmo_trio.engine, wmo_trio.harbor, wmo_trio.trace
        async def kind():
            return type(asyncio.get_running_loop()).__module__
        print(asyncio.run(kind()), "trio_asyncio" in sys.modules)
    """)
    assert out.split() == ["asyncio.unix_events", "False"]


@pytest.mark.slow  # a fresh interpreter
def test_the_trio_owned_host_stops_waits_and_unwraps() -> None:
    # trio-asyncio replaces asyncio's loop policy process-wide once imported, so this host
    # is exercised in its own interpreter.
    out = _python("""
        import asyncio, json, threading
        import wmo_trio.engine as engine
        from support.engine import FakeEpisode, check_trials, trials

        async def main():
            host = engine.host_for_running_loop()
            await host.prepare(64)
            warmed = threading.active_count()
            check_trials(await trials(host, 64))
            try:
                await host.run_episode(FakeEpisode(error=KeyError("boom")))
            except KeyError as error:
                unwrapped = repr(error)
            # a timeout before the episode's trio task even started still records it
            early = FakeEpisode(duration=30)
            try:
                await asyncio.wait_for(host.run_episode(early), 1e-6)
            except asyncio.TimeoutError:
                pass
            return {"host": host.name, "error": unwrapped, "early": early.events,
                    "warmed": warmed}

        print(json.dumps(engine.run(main)))
    """)
    report = json.loads(out)
    assert report["host"] == "trio-asyncio" and report["warmed"] > 64
    assert report["error"] == "KeyError('boom')"
    assert report["early"][-1][0] == "record" and report["early"][-1][2] is True


def test_the_heap_is_settled_once_per_process_before_a_burst() -> None:
    from wmo_trio.engine._engine import settle_heap

    settle_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 0  # the process's imports are out of the collector's way
    later = [[object()] for _ in range(1000)]  # objects of a burst, alive now
    settle_heap()
    # Never frozen with them (they would add 1,000 lists); the count may fall meanwhile, as
    # a frozen object that another thread lets go leaves the permanent generation.
    assert gc.get_freeze_count() < frozen + len(later)


def test_settling_the_heap_makes_young_collections_rarer_and_keeps_an_owners_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wmo_trio.engine import _engine

    before = gc.get_threshold()
    try:
        for owners, expected in (((700, 10, 10), (_engine.YOUNG_COLLECTION_THRESHOLD, 10, 10)),
                                 ((200_000, 20, 5), (200_000, 20, 5)),
                                 ((0, 10, 10), (0, 10, 10))):
            monkeypatch.setattr(_engine, "_heap_settled", False)
            gc.set_threshold(*owners)
            _engine.settle_heap()
            assert gc.get_threshold() == expected
    finally:
        gc.set_threshold(*before)


async def test_prepare_loads_off_the_trio_thread_then_warms_the_workers() -> None:
    loaded: list[threading.Thread] = []
    engine = EpisodeEngine(workers=2)
    await engine.prepare(6, load=lambda: loaded.append(threading.current_thread()))
    assert loaded and loaded[0] is not threading.current_thread()
    assert engine.limiter.total_tokens == 6


async def test_the_loads_of_concurrent_prepares_run_one_at_a_time() -> None:
    # Every trial of a burst prepares at once: their loads must not each take a thread.
    running, most = 0, 0
    lock = threading.Lock()

    def load() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.001)
        with lock:
            running -= 1

    engine = EpisodeEngine(workers=8)
    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(lambda: engine.prepare(8, load=load))
    assert most == 1


async def test_an_episode_that_arrives_during_a_warm_up_waits_for_it_then_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The warm-up holds the free tokens while its threads start, so an episode arriving
    # meanwhile never starts a thread of its own beside them.
    from wmo_trio.engine import _engine

    warming, release = trio.Event(), trio.Event()
    real = _engine._start_idle_threads

    async def held_warm_up(count: int) -> None:
        warming.set()
        await release.wait()
        await real(count)

    monkeypatch.setattr(_engine, "_start_idle_threads", held_warm_up)
    engine = EpisodeEngine(workers=4)
    episode = FakeEpisode()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.warm_workers, 4)
        await warming.wait()
        assert engine.limiter.borrowed_tokens == 4
        nursery.start_soon(engine.run_episode, episode)
        await trio.testing.wait_all_tasks_blocked()
        assert episode.events == []  # waiting for a token
        release.set()
    assert episode.events[0] == "run"
    assert engine.limiter.borrowed_tokens == 0


async def test_workers_beyond_the_run_gate_wait_their_turn_to_compute() -> None:
    # One place: while the first episode computes (holding its place, never waiting through
    # its control), the second's worker waits for the gate; the first's return frees it.
    engine = EpisodeEngine(workers=2, runnable=1)
    engine.gate.patience_s = 60.0
    first_in, go = threading.Event(), threading.Event()
    first = FakeEpisode(on_run=lambda: (first_in.set(), go.wait(60)))
    second = FakeEpisode()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run_episode, first)
        await trio.to_thread.run_sync(first_in.wait, 60)
        nursery.start_soon(engine.run_episode, second)
        await trio.testing.wait_all_tasks_blocked()
        await trio.to_thread.run_sync(time.sleep, 0.05)
        assert second.events == []  # its worker is at the gate
        go.set()
    assert second.events[0] == "run"
    assert first.worker_returned_at is not None


async def test_a_wait_through_the_control_lets_the_next_worker_compute() -> None:
    engine = EpisodeEngine(workers=2, runnable=1)
    engine.gate.patience_s = 60.0
    second_ran = threading.Event()
    waited: list[bool] = []

    class Waits(FakeEpisode):
        def run(self, control: CallControl) -> RunResult:
            # Holding the only place, this episode waits through its control until the
            # other has computed: possible only if the wait lets the place go.
            while not second_ran.is_set():
                control.sleep(0.01)
            waited.append(True)
            return super().run(control)

    class Computes(FakeEpisode):
        def run(self, control: CallControl) -> RunResult:
            second_ran.set()
            return super().run(control)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run_episode, Waits())
        nursery.start_soon(engine.run_episode, Computes())
    assert waited == [True]


async def test_an_episodes_close_and_trace_write_hold_no_place_at_the_run_gate() -> None:
    # One place: the first episode's close blocks outside its control (a provider's client
    # closing, a remote sandbox being killed); the second still computes meanwhile.
    engine = EpisodeEngine(workers=2, runnable=1)
    engine.gate.patience_s = 60.0
    closing, second_ran = threading.Event(), threading.Event()
    ran_during_close: list[bool] = []
    first = FakeEpisode(on_close=lambda: (
        closing.set(), ran_during_close.append(second_ran.wait(30))))
    second = FakeEpisode(on_run=second_ran.set)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run_episode, first)
        await trio.to_thread.run_sync(closing.wait, 60)
        nursery.start_soon(engine.run_episode, second)
    assert ran_during_close == [True]  # with the place held, only after 60 s of patience
    assert first.events[-1] == ("record", "Value", False)
