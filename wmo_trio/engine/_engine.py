"""The trio episode engine: one per trio run, shared by every agent in it.

An episode's blocking runtime runs in a worker thread under one `trio.CapacityLimiter`.
The engine's job is the exact behaviour around that thread: when the caller is cancelled,
the episode is told to stop and its calls in flight are cancelled, its worker is waited
for (a harness must never keep running against an environment harbor is about to verify),
close and the trace write run under a shield, and only then does the caller's
cancellation propagate; it is never lost, even when it arrives as the worker returns.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import outcome
import trio

from wmo_trio.control import CallControl, RunGate
from wmo_trio.models import RunResult

log = logging.getLogger("wmo_trio.engine")

DEFAULT_EPISODE_WORKERS = 64
# Episode workers that run Python at once (see `RunGate`): the interpreter lock runs one
# thread at a time anyway, and on top of it the event loops need their turns. Two kept
# every loop's heartbeat lowest in the real-traffic scenario (`make bench`).
DEFAULT_RUNNABLE_WORKERS = 2

# trio's idle worker threads exit after 10 s; a warm-up younger than this is still standing.
_WARM_FRESH_S = 5.0
TRACE_LOST = "writing the trace of a stopped episode failed"


class Episode(Protocol):
    """One episode as the engine drives it. The engine calls, in order: `run` in a worker
    thread; if the caller is cancelled while `run` is going, it interrupts `control` (the
    episode's one stop signal) and then calls `stop` (at most once); then `close` and
    `record`, both shielded from cancellation, in the worker's thread.

    `stop_is_quick` says that `stop` only sets flags and wakes threads (never does I/O or
    waits for a lock held across I/O): the engine then calls it on the trio thread, which
    saves a thread hop per cancellation; otherwise it gets a thread of its own.
    """

    stop_is_quick: bool

    def run(self, control: CallControl) -> RunResult:
        """Run the episode to its end; every wait goes through `control`. Blocking; must
        return soon after `control` is interrupted."""
        ...

    def stop(self) -> None:
        """Whatever else stopping takes, once `control` is interrupted (killing a program
        that runs elsewhere, noting why it stopped)."""
        ...

    def close(self) -> None:
        """Release the episode's resources. Failures are logged, never raised."""
        ...

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        """Persist the trace. A failure is raised for a healthy episode and logged after a
        cancellation or an exception."""
        ...


@dataclass(frozen=True)
class Finished:
    """How an episode ended, for whoever waits for it: its outcome, and the failure to
    write the trace of a healthy episode (which the caller gets instead of the result)."""

    result: outcome.Outcome[RunResult]
    trace_error: BaseException | None = None

    def unwrap(self) -> RunResult:
        """For a caller that was not cancelled: the result, or the exception to raise."""
        if self.trace_error is not None:
            raise self.trace_error
        return self.result.unwrap()

    def drop(self) -> None:
        """For a caller that gets its cancellation instead: nothing it drops is lost
        silently. The episode's own exception is in its trace already; a trace that could
        not be written is logged."""
        if self.trace_error is not None:
            log.warning(TRACE_LOST, exc_info=self.trace_error)


class EpisodeEngine:
    """Runs episodes in worker threads under one capacity limiter.

    The limiter is grown to the largest concurrency any caller asked for and never shrunk,
    so work already in flight never finds fewer tokens than it was promised.
    """

    def __init__(self, workers: int = DEFAULT_EPISODE_WORKERS, *,
                 runnable: int = DEFAULT_RUNNABLE_WORKERS) -> None:
        self.limiter = trio.CapacityLimiter(workers)
        self.gate = RunGate(runnable)
        # For threads that must not queue for an episode token: a worker whose token is
        # already held, a stop, the cleanup of an episode that never got one. After a burst
        # of timeouts every stop and cleanup has to run at once, not a limiter's worth at a
        # time (`make bench`, the "cancel" scenarios).
        self._cleanup_limiter = trio.CapacityLimiter(math.inf)
        self._warm_lock = trio.Lock()
        self._load_lock = trio.Lock()
        self._warmed = 0
        self._warmed_at = -math.inf

    def ensure_workers(self, workers: int) -> None:
        """Grow the limiter to at least `workers` tokens (waiters are woken at once)."""
        if workers > self.limiter.total_tokens:
            self.limiter.total_tokens = workers

    async def prepare(self, workers: int, *, load: Callable[[], object] | None = None) -> None:
        """Get ready for a burst of up to `workers` episodes, before it starts: run `load`
        (what the episodes' calls will need, such as a provider's SDK import) in a worker
        thread, settle the process's heap (`settle_heap`), and start the worker threads
        (`warm_workers`). Cancellable; a failure of `load` propagates.

        Loads run one at a time: a burst's setups all prepare at once (harbor sets up every
        trial), and after the first their loads are nearly free, so one thread serves them
        all instead of a thread each beside the warmed ones."""
        if load is not None:
            async with self._load_lock:
                await trio.to_thread.run_sync(load, limiter=self._cleanup_limiter)
        settle_heap()
        await self.warm_workers(workers)

    async def warm_workers(self, workers: int) -> None:
        """Grow the limiter to `workers` and start that many worker threads now, idle in
        trio's thread cache, so that a burst of episodes finds its threads instead of
        creating them one by one on the trio thread (`make bench`, "start latency").

        Meant for a setup step just before the burst (harbor's `BaseAgent.setup`): idle
        threads exit after 10 s. Concurrent calls share one warm-up. While it runs, the
        warm-up holds the limiter's free tokens: an episode that arrives meanwhile waits
        for its token and then finds a warmed thread, instead of starting one more thread
        while the warm-up's are all busy (which left more threads than tokens).
        """
        self.ensure_workers(workers)
        async with self._warm_lock:
            fresh = trio.current_time() - self._warmed_at < _WARM_FRESH_S
            if fresh and self._warmed >= workers:
                return
            held = [object() for _ in range(int(min(workers - self.limiter.borrowed_tokens,
                                                    self.limiter.available_tokens)))]
            try:
                for holder in held:
                    self.limiter.acquire_on_behalf_of_nowait(holder)
                await _start_idle_threads(len(held))
            finally:
                for holder in held:
                    self.limiter.release_on_behalf_of(holder)
            self._warmed, self._warmed_at = workers, trio.current_time()

    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        """Run `episode` to its end and return its result.

        If the calling task is cancelled meanwhile, the episode is stopped, its worker
        thread waited for, closed and recorded under a shield, and then `trio.Cancelled`
        propagates. An exception from the episode reaches the caller as itself.
        """
        finished = await self.finish_episode(episode, workers=workers)
        # The worker's outcome comes back even when the caller was cancelled meanwhile;
        # this checkpoint is where that cancellation is delivered instead of being lost.
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            finished.drop()
            raise
        return finished.unwrap()

    async def finish_episode(self, episode: Episode, *, workers: int | None = None,
                             host_loop: asyncio.AbstractEventLoop | None = None) -> Finished:
        """Run `episode` to its end, whatever happens to the caller meanwhile, and say how
        it ended. Never raises: a cancellation of the caller stops the episode (and is
        still pending when this returns), and the episode's exception is in the result.

        `host_loop` is the asyncio loop the episode's `control.run_host` calls go to.
        """
        if workers is not None:
            self.ensure_workers(workers)
        state = _WorkerState()
        control = CallControl(host_loop=host_loop, gate=self.gate)

        async def stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                if state.request_stop():
                    # The interrupt marks the episode stopping before it cancels the call in
                    # flight, so the worker never takes that failure for a reason to make
                    # one more model call; it is quick, whatever the episode.
                    control.interrupt()
                    if episode.stop_is_quick:
                        _stop(episode)
                    else:
                        with trio.CancelScope(shield=True):
                            await trio.to_thread.run_sync(
                                _stop, episode, limiter=self._cleanup_limiter
                            )
                # Swallowed on purpose: this task only observes. Re-raising it here would
                # reach the caller wrapped in an exception group; the caller's own
                # cancellation is still pending for its next checkpoint.

        def worker() -> Finished:
            control.enter_gate()
            try:
                result = outcome.capture(episode.run, control)
            finally:
                # Not through close and record: a close runs whatever the episode's parts
                # do (an SDK client's, a remote sandbox's), blocking outside the control,
                # and the trace write waits on the disk; a place held meanwhile is one the
                # others wait out the gate's patience for (`make soak`'s wall time).
                control.leave_gate()
            return Finished(result, _finish(episode, result, state.run_returned()))

        finished: Finished | None = None
        never_ran: outcome.Error | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_cancelled)
            # The episode's token of the process-wide limiter is taken here, not by
            # to_thread, so that waiting for it stays cancellable while the worker (run,
            # close and the trace write) runs under the shield. abandon_on_cancel=False
            # says the same to trio: this thread is always waited for.
            try:
                await self.limiter.acquire_on_behalf_of(state)
            except trio.Cancelled as cancelled:
                state.run_returned()  # there is no run to stop
                never_ran = outcome.Error(cancelled)
            else:
                try:
                    with trio.CancelScope(shield=True):
                        finished = await trio.to_thread.run_sync(
                            worker, limiter=self._cleanup_limiter, abandon_on_cancel=False
                        )
                finally:
                    self.limiter.release_on_behalf_of(state)
            nursery.cancel_scope.cancel()
        if never_ran is not None:
            # Cancelled while waiting for a token: the episode never runs, but it is closed
            # and recorded all the same, on a thread that needs no token.
            with trio.CancelScope(shield=True):
                trace_error = await trio.to_thread.run_sync(
                    _finish, episode, never_ran, True, limiter=self._cleanup_limiter
                )
            finished = Finished(never_ran, trace_error)
        assert finished is not None
        return finished


_settled = threading.Lock()
_heap_settled = False


# The collector's first threshold while episodes run (CPython's default is 700).
YOUNG_COLLECTION_THRESHOLD = 100_000


def settle_heap() -> None:
    """Once per process, before the first burst, tune the garbage collector for one:

    - every object alive now (harbor's, litellm's and the SDKs' imports: hundreds of
      thousands of objects) moves out of the collector's way (`gc.freeze`): each full
      collection would walk them all. Objects alive now are never collected afterwards;
      before a burst they are the process's long-lived ones;
    - young collections become rarer (a first threshold of at least
      `YOUNG_COLLECTION_THRESHOLD`): a burst allocates fast and keeps much of it for the
      episode's length, so at the default every few hundred allocations promote survivors,
      and the promotions set off full collections of the whole burst's state, each a pause
      of the trio loop.

    Both take a share of the process's CPU under model traffic (`make bench`, the
    real-traffic scenario's "process CPU per step" and loop heartbeats). A higher first
    threshold set by the process's owner is kept, and so is a collector turned off."""
    global _heap_settled
    with _settled:
        if _heap_settled:
            return
        _heap_settled = True
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if young and young < YOUNG_COLLECTION_THRESHOLD:
        gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)


async def _start_idle_threads(count: int) -> None:
    """Have `count` threads running at once in trio's thread cache, then let them go idle
    there. Each job waits for all the others, so none is reused for the next job and the
    cache ends up with `count` distinct threads."""
    if count <= 0:
        return
    barrier = threading.Barrier(count)
    token = trio.lowlevel.current_trio_token()
    all_started = trio.Event()
    lock = threading.Lock()
    waiting = count

    def job() -> None:
        try:
            barrier.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass

    def deliver(_: outcome.Outcome[None]) -> None:  # in the worker thread
        nonlocal waiting
        with lock:
            waiting -= 1
            last = waiting == 0
        if last:
            try:
                token.run_sync_soon(all_started.set)
            except trio.RunFinishedError:
                pass

    for started in range(count):
        try:
            trio.lowlevel.start_thread_soon(job, deliver)
        except RuntimeError:  # the system refused one more thread
            barrier.abort()
            log.warning("started %d of %d worker threads ahead of time", started, count)
            return
    await all_started.wait()


class _WorkerState:
    """Whether the caller's cancellation reached the episode before its run returned: the
    worker and the watcher agree on it under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._returned = False
        self._stopping = False

    def request_stop(self) -> bool:
        """True when the run is still going, so it has to be stopped."""
        with self._lock:
            self._stopping = not self._returned
            return self._stopping

    def run_returned(self) -> bool:
        """Mark the run returned; True when it had been asked to stop."""
        with self._lock:
            self._returned = True
            return self._stopping


def _stop(episode: Episode) -> None:
    try:
        episode.stop()
    except BaseException:  # as for close (`_finish`): nothing here is a signal to the process
        log.warning("stopping a cancelled episode failed; waiting for it anyway", exc_info=True)


def _finish(episode: Episode, result: outcome.Outcome[RunResult], cancelled: bool) -> BaseException | None:
    """Close, then record. Returns the trace failure of a healthy episode, to be raised.

    Any exception counts, BaseExceptions too: in a worker thread none of them is a signal
    to the process (KeyboardInterrupt is delivered to the main thread only), so a close
    that fails so never keeps the trace from being written, and neither escapes into the
    caller's nursery."""
    try:
        episode.close()
    except BaseException:
        log.warning("closing an episode failed; its outcome stands", exc_info=True)
    try:
        episode.record(result, cancelled)
    except BaseException as error:
        if not cancelled and isinstance(result, outcome.Value):
            return error
        log.warning(TRACE_LOST, exc_info=True)
    return None
