"""The host when harbor owns a plain asyncio loop: one trio run serving that loop.

The trio run runs in a dedicated thread (`thread` mode) or as a guest on the loop itself
(`guest` mode). Work crosses with `TrioToken.run_sync_soon` one way and
`loop.call_soon_threadsafe` the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import outcome
import trio

from wmo_trio.engine._bridge import Submission, await_finished, settle, wait_ignoring_cancellation
from wmo_trio.engine._engine import Episode, EpisodeEngine, Finished
from wmo_trio.engine._host import (
    Host,
    HostMode,
    current_engine,
    default_host_mode,
    set_current_engine,
)
from wmo_trio.models import RunResult


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
        self.loop = loop
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
        self._keeper = self.loop.create_task(self._keep(), name="wmo-trio-host-keeper")
        if self.mode == "thread":
            self._thread = threading.Thread(
                target=self._thread_main, name="wmo-trio-engine", daemon=True
            )
            self._thread.start()
        else:
            trio.lowlevel.start_guest_run(
                self._main,
                run_sync_soon_threadsafe=self.loop.call_soon_threadsafe,
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
        set_current_engine(EpisodeEngine())
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._settle_from_trio(self._ready, outcome.Value(None))
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _settle_from_trio(self, future: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
        """From the trio side (either mode): settle `future` on the loop with `result`."""
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(settle, future, result)

    async def _keep(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            # The loop is shutting down: end the trio run and wait for it to finish.
            with self._hosts_lock:
                if self._hosts.get(self.loop) is self:
                    del self._hosts[self.loop]
            await asyncio.shield(self._ready)
            if self._token is not None and self._stop is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(self._stop.set)
            await asyncio.shield(self._finished)
            if self._thread is not None:
                self._thread.join(timeout=5)

    def _running_token(self) -> trio.lowlevel.TrioToken:
        if self._token is None or self._finished.done():
            raise RuntimeError("the wmo_trio engine's trio run is not running")
        return self._token

    def _spawn(self, afn: Any, *args: Any) -> None:
        """Start a task in the trio run's nursery; from any thread."""
        def start() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(afn, *args)

        self._running_token().run_sync_soon(start)

    # -- episodes -----------------------------------------------------------------------

    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        submission = Submission()
        cancelled = False
        try:
            await asyncio.shield(self._ready)
        except asyncio.CancelledError:
            # Cancelled while the trio run starts: submit the episode already cancelled, so
            # it is recorded like any other, then let the cancellation propagate.
            await wait_ignoring_cancellation(self._ready)
            submission.cancel()
            cancelled = True
        token = self._running_token()
        future: asyncio.Future[Finished] = self.loop.create_future()

        async def in_trio() -> None:
            result = await outcome.acapture(
                submission.run, current_engine(), episode, workers, self.loop)
            self._settle_from_trio(future, result)

        def cancel() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(submission.cancel)

        self._spawn(in_trio)
        return await await_finished(future, cancel, cancelled=cancelled)

    async def prepare(self, workers: int, *, load: Callable[[], object] | None = None) -> None:
        await asyncio.shield(self._ready)
        done: asyncio.Future[None] = self.loop.create_future()

        async def warm() -> None:
            result = await outcome.acapture(current_engine().prepare, workers, load=load)
            self._settle_from_trio(done, result)

        self._spawn(warm)
        await done
