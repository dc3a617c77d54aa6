"""A function run in a forked copy of this process, its result sent back.

What a smoke run (`python -m benchmarks --quick --smoke`) uses where a quick run starts a
fresh interpreter: a copy made after the imports costs none of them (hundreds of
milliseconds to seconds of CPU each: wmo_trio, harbor, the SDKs), and a smoke run's
figures mean nothing. The copy is still a process of its own, so what is process-wide
(trio-asyncio's loop policy, threads, the trio run's hooks) stays in it.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

TRIO_WORKER = "Trio thread "  # how trio names its cached worker threads


class Forked:
    """`target(*args)` in a forked copy of this process, started at once."""

    def __init__(self, name: str, target: Callable[..., Any], *args: Any) -> None:
        # Only the forking thread lives on in the copy: a lock another thread held then
        # stays held there for good. trio's idle cached workers are the exception: trio
        # forgets them in a forked child itself (os.register_at_fork).
        others = [thread.name for thread in threading.enumerate()
                  if thread is not threading.current_thread()
                  and not thread.name.startswith(TRIO_WORKER)]
        if others:
            raise RuntimeError(f"{name}: a fork needs this process to run one thread, and "
                               f"{', '.join(others)} run too; fork before starting them")
        self.name = name
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_run, args=(send, target, args), name=name)
        self._process.start()
        send.close()

    def result(self, timeout_s: float) -> Any:
        """What the target returned; a RuntimeError with its traceback if it raised, or if
        the copy died or ran past `timeout_s`."""
        try:
            if not self._receive.poll(timeout_s):
                self._process.kill()
                raise RuntimeError(f"{self.name}: killed after {timeout_s:.0f} s without a result")
            try:
                ok, value = self._receive.recv()
            except EOFError:
                ok, value = False, "the forked process ended before sending a result"
        finally:
            self._receive.close()
            self._process.join()
        if not ok:
            raise RuntimeError(f"{self.name} failed (exit {self._process.exitcode}):\n{value}")
        return value


def _run(send: Connection, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        outcome: tuple[bool, Any] = (True, target(*args))
    except BaseException:  # sent to the parent, which raises it there
        outcome = (False, traceback.format_exc()[-3000:])
    send.send(outcome)
    send.close()
