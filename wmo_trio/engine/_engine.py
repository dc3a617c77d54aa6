"""The trio episode engine: one per trio run, shared by every agent in it.

An episode's blocking runtime runs in a worker thread under one `trio.CapacityLimiter`.
The engine's job is the exact behaviour around that thread: when the caller is cancelled,
the episode is told to stop and its worker is waited for (a harness must never keep
running against an environment harbor is about to verify); cleanup and the trace write run
under a shield; the caller's cancellation then propagates, and is never lost even when it
arrives as the worker returns.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
from typing import Protocol

import outcome
import trio

from wmo_trio.models import RunResult

log = logging.getLogger("wmo_trio.engine")

DEFAULT_EPISODE_WORKERS = 64

# trio's idle worker threads exit after 10 s; a warm-up younger than this is still standing.
_WARM_FRESH_S = 5.0


class Episode(Protocol):
    """One episode as the engine drives it. The engine calls, in order: `run` in a worker
    thread; `stop` (at most once) if the caller is cancelled while `run` is going; then
    `close` and `record`, both shielded from cancellation, in the worker's thread.

    `stop` runs in a thread of its own, unless the episode has a true `stop_is_quick`
    attribute: a `stop` that only sets flags and wakes threads (never does I/O or waits
    for a lock held across I/O) is called on the trio thread, which saves a thread hop per
    cancellation.
    """

    def run(self) -> RunResult:
        """Run the episode to its end. Blocking; must return soon after `stop()`."""
        ...

    def stop(self) -> None:
        """Ask `run` to return as soon as it can (cooperative cancel, abort the runtime,
        cancel the environment call in flight)."""
        ...

    def close(self) -> None:
        """Release the episode's resources. Failures are logged, never raised."""
        ...

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        """Persist the trace. A failure is raised for a healthy episode and logged after a
        cancellation or an exception."""
        ...


class Interruptible(Protocol):
    def interrupt(self) -> None: ...


class EpisodeCalls:
    """The host callers an episode's worker created, so that the engine can cancel their
    calls in flight itself when the episode is cancelled, whatever `Episode.stop` does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callers: list[Interruptible] = []
        self._interrupted = False

    def add(self, caller: Interruptible) -> None:
        with self._lock:
            self._callers.append(caller)
            interrupted = self._interrupted
        if interrupted:
            caller.interrupt()

    def interrupt_all(self) -> None:
        with self._lock:
            self._interrupted = True
            callers = list(self._callers)
        for caller in callers:
            caller.interrupt()


# Set around an episode's worker; trio copies the context into the worker thread.
CURRENT_EPISODE_CALLS: contextvars.ContextVar[EpisodeCalls | None] = contextvars.ContextVar(
    "wmo_trio_episode_calls", default=None
)


class EpisodeEngine:
    """Runs episodes in worker threads under one capacity limiter.

    The limiter is grown to the largest concurrency any caller asked for and never shrunk,
    so work already in flight never finds fewer tokens than it was promised.
    """

    def __init__(self, workers: int = DEFAULT_EPISODE_WORKERS) -> None:
        self.limiter = trio.CapacityLimiter(workers)
        # For threads that must not queue for an episode token: a worker whose token is
        # already held, a stop, the cleanup of an episode that never got one. After 256
        # timeouts every stop and cleanup has to run at once, not 64 at a time.
        self._cleanup_limiter = trio.CapacityLimiter(math.inf)
        self._warm_lock = trio.Lock()
        self._warmed = 0
        self._warmed_at = -math.inf

    def ensure_workers(self, workers: int) -> None:
        """Grow the limiter to at least `workers` tokens (waiters are woken at once)."""
        if workers > self.limiter.total_tokens:
            self.limiter.total_tokens = workers

    async def warm_workers(self, workers: int) -> None:
        """Grow the limiter to `workers` and start that many worker threads now, idle in
        trio's thread cache, so a burst of episodes finds its threads instead of creating
        them one by one on the trio thread inside `run()` (the whole start latency of a
        cold burst: 64 episodes waited 17 ms at p50, 256 waited 39 ms).

        Meant for a setup step just before the burst (harbor's `BaseAgent.setup`): idle
        threads exit after 10 s. Concurrent calls share one warm-up.
        """
        self.ensure_workers(workers)
        async with self._warm_lock:
            fresh = trio.current_time() - self._warmed_at < _WARM_FRESH_S
            if fresh and self._warmed >= workers:
                return
            await _start_idle_threads(workers - self.limiter.borrowed_tokens)
            self._warmed, self._warmed_at = workers, trio.current_time()

    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        """Run `episode` to its end and return its result.

        If the calling task is cancelled meanwhile, the episode is stopped, its worker
        thread waited for, closed and recorded under a shield, and then `trio.Cancelled`
        propagates. An exception from the episode reaches the caller as itself.
        """
        if workers is not None:
            self.ensure_workers(workers)
        finished = await self._run_in_worker(episode)
        if isinstance(finished, trio.Cancelled):
            # Cancelled while waiting for a token: the episode never ran, but it is closed
            # and recorded all the same, on a thread that needs no token.
            result: outcome.Outcome[RunResult] = outcome.Error(finished)
            with trio.CancelScope(shield=True):
                trace_error = await trio.to_thread.run_sync(
                    _finish, episode, result, True, limiter=self._cleanup_limiter
                )
        else:
            result, trace_error = finished
        # The worker's value comes back even when the caller was cancelled meanwhile; this
        # checkpoint is where that cancellation is delivered instead of being lost.
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            if trace_error is not None:  # cancelled during cleanup: log it, as after any cancel
                log.warning("writing the trace of a stopped episode failed", exc_info=trace_error)
            raise
        assert not isinstance(finished, trio.Cancelled), "a cancelled wait implies a cancelled caller"
        if trace_error is not None:
            raise trace_error
        return result.unwrap()

    async def _run_in_worker(
        self, episode: Episode
    ) -> tuple[outcome.Outcome[RunResult], Exception | None] | trio.Cancelled:
        """Run, close and record the episode in one worker thread: its outcome and the
        trace failure to raise; the cancellation that came before it got a token.

        One thread does all three because after 256 simultaneous timeouts every thread hop
        is paid 256 times over on two cores; close and the trace write still run under the
        shield, since the token is taken before it.
        """
        state = _WorkerState()
        calls = EpisodeCalls()

        async def stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                if state.request_stop():
                    # stop() first: it marks the episode cancelled before its call in flight
                    # is interrupted, so the worker cannot take that failure for a reason to
                    # make one more model call. Then the engine's own backstop.
                    if getattr(episode, "stop_is_quick", False):
                        _stop(episode)
                    else:
                        with trio.CancelScope(shield=True):
                            await trio.to_thread.run_sync(
                                _stop, episode, limiter=self._cleanup_limiter
                            )
                    calls.interrupt_all()
                # Swallowed on purpose: this task only observes. Re-raising it here would
                # reach the caller wrapped in an exception group; the caller's own
                # cancellation is re-delivered by the checkpoint in run_episode.

        def worker() -> tuple[outcome.Outcome[RunResult], Exception | None]:
            result = outcome.capture(episode.run)
            return result, _finish(episode, result, state.run_returned())

        finished: tuple[outcome.Outcome[RunResult], Exception | None] | trio.Cancelled
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_cancelled)
            # The episode's token of the process-wide limiter is taken here, not by
            # to_thread, so that waiting for it stays cancellable while the worker (run,
            # close and the trace write) runs under the shield. abandon_on_cancel=False
            # says the same to trio: this thread is always waited for.
            borrower = state
            try:
                await self.limiter.acquire_on_behalf_of(borrower)
            except trio.Cancelled as cancelled:
                finished = cancelled  # the watcher saw it too; the episode never runs
            else:
                token = CURRENT_EPISODE_CALLS.set(calls)
                try:
                    with trio.CancelScope(shield=True):
                        finished = await trio.to_thread.run_sync(
                            worker, limiter=self._cleanup_limiter, abandon_on_cancel=False
                        )
                finally:
                    CURRENT_EPISODE_CALLS.reset(token)
                    self.limiter.release_on_behalf_of(borrower)
            nursery.cancel_scope.cancel()
        return finished


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
    except Exception:
        log.warning("stopping a cancelled episode failed; waiting for it anyway", exc_info=True)


def _finish(episode: Episode, result: outcome.Outcome[RunResult], cancelled: bool) -> Exception | None:
    """Close, then record. Returns the trace failure of a healthy episode, to be raised."""
    try:
        episode.close()
    except Exception:
        log.warning("closing an episode failed; its outcome stands", exc_info=True)
    try:
        episode.record(result, cancelled)
    except Exception as error:
        if not cancelled and isinstance(result, outcome.Value):
            return error
        log.warning("writing the trace of a stopped episode failed", exc_info=True)
    return None
