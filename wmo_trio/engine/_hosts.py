"""How harbor's asyncio code reaches the trio engine, and how worker threads reach back.

Two hosting situations, one small interface (`Host.run_episode` and `Host.prepare`,
awaited from asyncio):

- **trio owns the loop** (`TrioAsyncioHost`): a trio program opened
  `trio_asyncio.open_loop()` and runs harbor inside it. asyncio code starts the episode's
  trio task on that loop, and an asyncio cancellation cancels the task's own scope, then
  waits for it.
- **harbor owns a plain asyncio loop** (its own CLI): trio-asyncio cannot bridge there
  (python-trio/trio-asyncio#133), so one trio run per asyncio loop is started lazily and
  serves every agent on that loop (`LoopServingHost`), either in a dedicated thread or as
  a guest run on the loop itself. Work crosses with `TrioToken.run_sync_soon` one way and
  `loop.call_soon_threadsafe` the other.

Worker threads call asyncio coroutine functions (harbor's `environment.exec`) through
`HostCaller`, which submits them straight to the host loop; the engine cancels them when
their episode is cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal

import outcome
import trio

from wmo_trio.engine._engine import CURRENT_EPISODE_CALLS, Episode, EpisodeEngine
from wmo_trio.models import RunResult

log = logging.getLogger("wmo_trio.engine")

HostMode = Literal["thread", "guest"]

# Default for loops harbor owns: a dedicated thread. Measured side by side (`make bench`,
# 2 cores, worker threads started in setup): the thread host costs less per episode
# (514 us against 775 us over 5,000 tiny episodes), cancels sooner (p99 144 ms against
# 156 ms for 256 at once) and starts bursts sooner (p99 37 ms against 115 ms at 256, 241 ms
# against 631 ms at 1,024), because a guest run does all of trio's scheduling on harbor's
# own thread, between harbor's callbacks. At harbor's usual concurrency the two keep the
# loop about equally responsive (1 ms heartbeat p99 2.6 ms against 2.2 ms at 64, 21 ms
# against 25 ms at 256); at 1,024 both are late (323 ms and 511 ms), because the loop
# thread waits for the GIL behind the workers. WMO_TRIO_HOST=guest selects the guest run.
DEFAULT_HOST_MODE: HostMode = "thread"

_ENGINE: trio.lowlevel.RunVar[EpisodeEngine] = trio.lowlevel.RunVar("wmo_trio_engine")
_BRIDGE: trio.lowlevel.RunVar[_AsyncioBridge] = trio.lowlevel.RunVar("wmo_trio_asyncio_bridge")


def current_engine() -> EpisodeEngine:
    """The engine of the current trio run, created on first use."""
    try:
        return _ENGINE.get()
    except LookupError:
        engine = EpisodeEngine()
        _ENGINE.set(engine)
        return engine


# -- worker -> asyncio ------------------------------------------------------------------


class _AsyncioBridge(ABC):
    @abstractmethod
    async def call(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run an asyncio coroutine function to completion from trio; cancellable."""


class _TrioAsyncioBridge(_AsyncioBridge):
    async def call(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        import trio_asyncio

        return await trio_asyncio.aio_as_trio(afn)(*args)


class _ThreadsafeBridge(_AsyncioBridge):
    """Calls into an asyncio loop that runs in another thread (or hosts us as a guest)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._token = trio.lowlevel.current_trio_token()

    async def call(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        done = trio.Event()

        async def invoke() -> Any:
            return await afn(*args)

        future = asyncio.run_coroutine_threadsafe(invoke(), self._loop)
        future.add_done_callback(lambda _: _soon(self._token, done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            # Let the coroutine run its own cancellation handling (harbor's exec kills its
            # process there) before the episode goes on, but never hang on it.
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await done.wait()
            raise
        return future.result()


def _soon(token: trio.lowlevel.TrioToken, fn: Callable[[], object]) -> None:
    try:
        token.run_sync_soon(fn)
    except trio.RunFinishedError:
        pass


async def call_asyncio(afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """From trio: run `afn(*args)` on the asyncio loop this trio run serves."""
    try:
        bridge = _BRIDGE.get()
    except LookupError:
        # A trio program that opened trio-asyncio's loop itself.
        module = sys.modules.get("trio_asyncio")
        if module is None or module.current_loop.get() is None:
            raise RuntimeError(
                "this trio run has no asyncio loop to call into; open one with "
                "trio_asyncio.open_loop() or run through wmo_trio.engine.run_asyncio()"
            ) from None
        bridge = _TrioAsyncioBridge()
    return await bridge.call(afn, *args)


class HostInterrupted(Exception):
    """A host call was cancelled because its episode is stopping."""


# The asyncio loop an episode's worker calls straight into: set by both hosts for each
# episode task and copied by trio into the worker thread. Unset for an episode a trio
# program runs on the engine itself, whose calls then go through the episode's trio task.
_EPISODE_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "wmo_trio_episode_loop", default=None
)

# How long an interrupted call may take to finish its own cancellation handling (harbor's
# exec kills its process there) before the worker gives up waiting for it.
_CANCEL_GRACE_S = 10.0


class HostCaller:
    """The one way an episode's worker thread calls back into the host loop.

    Create it in the worker thread. `call(afn, *args)` runs an asyncio coroutine function on
    the host loop and returns its result. The call is cancelled when its episode is (the
    engine interrupts every caller of a cancelled episode) and by `interrupt()` (any thread;
    the budget watcher uses it); either way the worker sees `HostInterrupted`, after the
    coroutine has run its own cancellation handling, or after a 10 s grace period.

    The worker submits straight to the host loop with `call_soon_threadsafe`: one thread
    hop each way, as cheap as the original bridge (under trio-asyncio that loop's own
    dispatch costs about twice asyncio's; the benchmark's bare round trip shows it). An
    episode run on the engine with no host loop calls through its trio task instead.
    """

    def __init__(self) -> None:
        self._loop = _EPISODE_LOOP.get()
        self._lock = threading.Lock()
        self._interrupted = False
        self._task: asyncio.Task[Any] | None = None
        self._done: concurrent.futures.Future[Any] | None = None
        self._scope: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        calls = CURRENT_EPISODE_CALLS.get()
        if calls is not None:
            calls.add(self)

    def call(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        if self._loop is not None:
            return self._call_loop(self._loop, afn, args)
        return self._from_trio(afn, args, via_asyncio=True)

    def _call_loop(self, loop: asyncio.AbstractEventLoop,
                   afn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> Any:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def finish(task: asyncio.Task[Any]) -> None:
            with self._lock:
                self._task = None
            if task.cancelled():
                _settle(done, error=HostInterrupted("the episode is stopping; the call was cancelled"))
            elif task.exception() is not None:
                _settle(done, error=task.exception())
            else:
                _settle(done, value=task.result())

        async def invoke() -> Any:
            return await afn(*args)

        def start() -> None:  # on the host loop
            with self._lock:
                if self._interrupted:
                    _settle(done, error=HostInterrupted("the episode is stopping; call not started"))
                    return
                task = loop.create_task(invoke())
                self._task, self._done = task, done
            task.add_done_callback(finish)

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:
            raise HostInterrupted("the host loop is closed") from None
        return done.result()

    def call_trio(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run a *trio* async function inside the episode's task (a trio-native
        environment), with the same cancellation as `call`."""
        return self._from_trio(afn, args, via_asyncio=False)

    def _from_trio(self, afn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], *,
                   via_asyncio: bool) -> Any:
        try:
            return trio.from_thread.run(self._call_in_trio, afn, args, via_asyncio)
        except trio.Cancelled:
            raise HostInterrupted("the episode was cancelled while this call ran") from None
        except BaseExceptionGroup as group:
            # A call that ran a nursery of its own (trio.run_process does) is cancelled as a
            # group of Cancelled: still just "the episode was cancelled".
            _, rest = group.split(trio.Cancelled)
            if rest is None:
                raise HostInterrupted("the episode was cancelled while this call ran") from None
            raise

    async def _call_in_trio(self, afn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                            via_asyncio: bool) -> Any:
        with trio.CancelScope() as scope:
            with self._lock:
                if self._interrupted:
                    scope.cancel()
                self._scope = scope
                self._token = trio.lowlevel.current_trio_token()
            try:
                if via_asyncio:
                    return await call_asyncio(afn, *args)
                return await afn(*args)
            finally:
                with self._lock:
                    self._scope = None
        raise HostInterrupted("the episode is stopping; the call was cancelled")

    def interrupt(self) -> None:
        with self._lock:
            if self._interrupted:  # the call in flight was cancelled by the first interrupt
                return
            self._interrupted = True
            task, done, scope, token = self._task, self._done, self._scope, self._token
        if task is not None and done is not None and self._loop is not None:
            loop = self._loop

            def cancel() -> None:  # on the host loop
                task.cancel()
                # Release the worker if the coroutine ignores its cancellation.
                loop.call_later(_CANCEL_GRACE_S, _settle, done, None,
                                HostInterrupted("the call ignored its cancellation"))

            try:
                loop.call_soon_threadsafe(cancel)
            except RuntimeError:
                _settle(done, error=HostInterrupted("the host loop is closed"))
        if scope is not None and token is not None:
            _soon(token, scope.cancel)


def _settle(future: concurrent.futures.Future[Any], value: Any = None,
            error: BaseException | None = None) -> None:
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:  # settled by another thread meanwhile
        pass


# -- asyncio -> engine --------------------------------------------------------------------


class Host(ABC):
    """Where the trio engine runs relative to the caller's asyncio loop."""

    name: str

    @abstractmethod
    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        """Run `episode` on the engine; awaited from asyncio.

        If the awaiting asyncio task is cancelled, the episode is cancelled on the trio
        side, waited for (cleanup and trace included), and `asyncio.CancelledError` is then
        raised. The episode's own exception is raised as itself.
        """

    @abstractmethod
    async def prepare(self, workers: int) -> None:
        """Get ready for up to `workers` episodes starting at once: grow the engine's
        limiter and start its worker threads now (`EpisodeEngine.warm_workers`)."""


class TrioAsyncioHost(Host):
    """trio owns the process; asyncio runs inside `trio_asyncio.open_loop()`.

    The episode's trio task is always started, and cancelled through its own scope: a
    task that trio-asyncio dropped before it started (an asyncio cancellation arriving
    that early) would never reach the engine, and so never write its trace.
    """

    name = "trio-asyncio"

    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        loop: Any = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        submission = _Submission()

        async def in_trio() -> None:
            try:
                _BRIDGE.get()
            except LookupError:
                _BRIDGE.set(_TrioAsyncioBridge())
            _EPISODE_LOOP.set(loop)  # this task's own context, copied into its worker
            result = await _run_submission(current_engine(), episode, workers, submission)
            _settle_outcome(future, result)  # this thread runs the asyncio loop too

        loop.run_trio_task(in_trio)
        return await _await_episode(future, submission.cancel)

    async def prepare(self, workers: int) -> None:
        async def warm() -> None:
            await current_engine().warm_workers(workers)

        loop: Any = asyncio.get_running_loop()
        await loop.trio_as_future(warm)


class _Submission:
    """The trio side of one episode submitted from asyncio; cancellable from asyncio."""

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.cancel_requested = False

    def cancel(self) -> None:  # trio thread
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()


_CANCELLED = object()


async def _run_submission(engine: EpisodeEngine, episode: Episode, workers: int | None,
                          submission: _Submission) -> outcome.Outcome[RunResult]:
    """Run a submitted episode in the engine under the submission's cancel scope."""
    result: outcome.Outcome[RunResult] | None = None
    with trio.CancelScope() as scope:
        submission.scope = scope
        if submission.cancel_requested:
            scope.cancel()
        # acapture keeps even this scope's Cancelled, so the outcome is always set
        result = await outcome.acapture(engine.run_episode, episode, workers=workers)
    assert result is not None
    return result


def _settle_outcome(future: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
    """On the asyncio loop: hand a trio task's outcome (an episode's) to its waiting
    caller; a trio cancellation becomes `_CANCELLED`."""
    if future.done():
        return
    if isinstance(result, outcome.Value):
        future.set_result(result.value)
    elif isinstance(result, outcome.Error) and isinstance(result.error, trio.Cancelled):
        future.set_result(_CANCELLED)
    elif isinstance(result, outcome.Error):
        future.set_exception(result.error)


async def _await_episode(future: asyncio.Future[Any], cancel: Callable[[], None], *,
                         cancelled: bool = False) -> RunResult:
    """Wait for an episode submitted to trio. If the waiting task is cancelled (or
    `cancelled` says it already was), `cancel` it on the trio side, wait until it has
    finished, trace included, and then raise the cancellation."""
    try:
        if cancelled:
            raise asyncio.CancelledError
        value = await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel()
        await _wait_ignoring_cancellation(future)
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller gets
        raise
    return _episode_result(value)


def _episode_result(value: Any) -> RunResult:
    if value is _CANCELLED:
        # The trio run was shut down under the episode (its loop is closing).
        raise asyncio.CancelledError("the wmo_trio host shut down")
    result: RunResult = value
    return result


class LoopServingHost(Host):
    """One trio run serving one plain asyncio loop, in a thread or as a guest.

    Started by the first episode on the loop. A keeper task on the loop ends the trio run
    when the loop shuts down (`asyncio.run` cancels it), so no trio run or thread outlives
    the loop that started it.
    """

    _hosts: ClassVar[dict[asyncio.AbstractEventLoop, LoopServingHost]] = {}
    _hosts_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop, mode: HostMode) -> None:
        self.name = f"asyncio+trio-{mode}"
        self.mode = mode
        self._loop = loop
        self._ready: asyncio.Future[None] = loop.create_future()
        self._finished: asyncio.Future[None] = loop.create_future()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None
        self._keeper: asyncio.Task[None] | None = None

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop, mode: HostMode | None = None) -> LoopServingHost:
        with cls._hosts_lock:
            host = cls._hosts.get(loop)
            if host is None or host._finished.done():
                host = cls(loop, mode or default_host_mode())
                cls._hosts[loop] = host
                host._start()
            return host

    # -- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        self._keeper = self._loop.create_task(self._keep(), name="wmo-trio-host-keeper")
        if self.mode == "thread":
            self._thread = threading.Thread(
                target=self._thread_main, name="wmo-trio-engine", daemon=True
            )
            self._thread.start()
        else:
            trio.lowlevel.start_guest_run(
                self._main,
                run_sync_soon_threadsafe=self._loop.call_soon_threadsafe,
                done_callback=self._guest_done,
                host_uses_signal_set_wakeup_fd=True,
            )

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        finally:
            self._settle_from_trio(self._ready, outcome.Value(None))
            self._settle_from_trio(self._finished, outcome.Value(None))

    def _guest_done(self, result: outcome.Outcome[None]) -> None:
        for future in (self._ready, self._finished):
            if not future.done():
                future.set_result(None)

    async def _main(self) -> None:
        self._stop = trio.Event()
        _ENGINE.set(EpisodeEngine())
        _BRIDGE.set(_ThreadsafeBridge(self._loop))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._settle_from_trio(self._ready, outcome.Value(None))
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _settle_from_trio(self, future: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
        """From the trio side (either mode): settle `future` on the loop with `result`."""
        try:
            self._loop.call_soon_threadsafe(_settle_outcome, future, result)
        except RuntimeError:  # the loop is already closed
            pass

    async def _keep(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            # The loop is shutting down: end the trio run and wait for it to finish.
            with self._hosts_lock:
                if self._hosts.get(self._loop) is self:
                    del self._hosts[self._loop]
            await asyncio.shield(self._ready)
            if self._token is not None and self._stop is not None:
                _soon(self._token, self._stop.set)
            await asyncio.shield(self._finished)
            if self._thread is not None:
                self._thread.join(timeout=5)

    # -- episodes -----------------------------------------------------------------------

    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        submission = _Submission()
        try:
            await asyncio.shield(self._ready)
        except asyncio.CancelledError:
            # Cancelled while the trio run starts: submit the episode already cancelled, so
            # it is recorded like any other, then let the cancellation propagate.
            await _wait_ignoring_cancellation(self._ready)
            submission.cancel_requested = True
        if self._token is None or self._finished.done():
            raise RuntimeError("the wmo_trio engine's trio run is not running")
        future: asyncio.Future[Any] = self._loop.create_future()
        token = self._token
        token.run_sync_soon(self._spawn, episode, workers, future, submission)
        return await _await_episode(future, lambda: _soon(token, submission.cancel),
                                    cancelled=submission.cancel_requested)

    async def prepare(self, workers: int) -> None:
        await asyncio.shield(self._ready)
        if self._token is None or self._finished.done():
            raise RuntimeError("the wmo_trio engine's trio run is not running")
        done: asyncio.Future[Any] = self._loop.create_future()

        async def warm() -> None:
            result = await outcome.acapture(current_engine().warm_workers, workers)
            self._settle_from_trio(done, result)

        def spawn() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(warm)

        self._token.run_sync_soon(spawn)
        if await done is _CANCELLED:
            raise RuntimeError("the wmo_trio engine's trio run shut down")

    def _spawn(self, episode: Episode, workers: int | None, future: asyncio.Future[Any],
               submission: _Submission) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._episode_task, episode, workers, future, submission)

    async def _episode_task(self, episode: Episode, workers: int | None,
                            future: asyncio.Future[Any], submission: _Submission) -> None:
        _EPISODE_LOOP.set(self._loop)  # this task's own context, copied into its worker
        result = await _run_submission(current_engine(), episode, workers, submission)
        self._settle_from_trio(future, result)


async def _wait_ignoring_cancellation(future: asyncio.Future[Any]) -> None:
    """Wait for `future` even if the waiting task is cancelled again meanwhile."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue


def default_host_mode() -> HostMode:
    mode = os.environ.get("WMO_TRIO_HOST", DEFAULT_HOST_MODE)
    if mode not in ("thread", "guest"):
        raise ValueError(f"WMO_TRIO_HOST must be 'thread' or 'guest', got {mode!r}")
    return mode  # type: ignore[return-value]


def _running_trio_asyncio_loop(loop: asyncio.AbstractEventLoop) -> bool:
    # Never import trio_asyncio here: importing it replaces asyncio's loop policy for the
    # whole process. If the running loop is one of its loops, it is already imported.
    module = sys.modules.get("trio_asyncio")
    return module is not None and isinstance(loop, module.BaseTrioEventLoop)


def host_for_running_loop() -> Host:
    """The host for the asyncio loop running in this thread."""
    loop = asyncio.get_running_loop()
    if _running_trio_asyncio_loop(loop):
        return TrioAsyncioHost()
    return LoopServingHost.for_loop(loop)

