"""Ctrl-C in `wmo-trio run`: the first cancels the job in order, a second leaves at once."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import trio

INTERRUPTED = 130  # 128 + SIGINT, as shells and harbor's command line report it


@dataclass
class Interrupt:
    """Whether the body was cancelled by a signal (`SIGINT`, or `SIGTERM` as harbor's own
    command line treats it)."""

    received: bool = False


@asynccontextmanager
async def cancelled_on_interrupt(
    on_first: Callable[[], None], leave: Callable[[], NoReturn],
) -> AsyncIterator[Interrupt]:
    """Run the body with Ctrl-C (SIGINT) and SIGTERM made a cancellation of it.

    trio's default turns SIGINT into a `KeyboardInterrupt` raised in whichever task runs
    when it arrives; inside trio-asyncio's loop shutdown that was seen to leave the
    process waiting for good, and inside harbor's trials it ends as an exception group.
    A cancellation is what every layer below unwinds in order: harbor cancels its
    trials, each agent stops its episode and writes its trace, the loop closes. The first
    signal calls `on_first()` and cancels the body; a second one, while that cleanup
    runs, calls `leave()`, which must end the process.
    """
    interrupt = Interrupt()
    body = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    if interrupt.received:
                        leave()
                    interrupt.received = True
                    _quiet_cleanup()
                    on_first()
                    body.cancel()

            nursery.start_soon(watch)
            with body:
                yield interrupt
            nursery.cancel_scope.cancel()


def _quiet_cleanup() -> None:
    """After a Ctrl-C, each trial's cleanup warns of what a cancelled trial lacks (nothing
    to copy out of an environment that did not start, logs not downloaded), a line a
    trial; the command's one line says it all. Every handler that shows records on the
    terminal (harbor's job adds one; logging's last resort shows the rest) shows errors
    only from here on; the job's and trials' log files keep everything."""
    named = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(one for one in named if isinstance(one, logging.Logger))]
    consoles: list[logging.Handler] = [
        handler for logger in loggers for handler in logger.handlers
        if type(handler) is logging.StreamHandler]  # a FileHandler is a subclass: kept
    if logging.lastResort is not None:
        consoles.append(logging.lastResort)
    for handler in consoles:
        handler.setLevel(max(handler.level, logging.ERROR))


def only_interrupts(error: BaseException) -> bool:
    """Whether `error` is a `KeyboardInterrupt`, alone or with cancellations in a group (as
    trio delivers one that arrives outside `cancelled_on_interrupt`)."""
    if isinstance(error, BaseExceptionGroup):
        return all(only_interrupts(e) or isinstance(e, trio.Cancelled) for e in error.exceptions)
    return isinstance(error, KeyboardInterrupt)


def leave_now(job_dir: Path) -> NoReturn:
    """End the process at once, without waiting for the trials' cleanup (a second Ctrl-C)."""
    sys.stdout.flush()
    sys.stderr.write("wmo-trio: interrupted again: left without waiting for the trials' "
                     f"cleanup (traces may be missing); job directory: {job_dir.resolve()}\n")
    sys.stderr.flush()
    os._exit(INTERRUPTED)
