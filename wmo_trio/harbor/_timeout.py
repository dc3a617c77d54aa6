"""harbor's agent timeout as the agent's `run()` can know it: the one reach into harbor's
call stack for it.

harbor 0.25 tells an agent nothing of its timeout (only its own oracle agent gets
`agent_timeout_sec`), yet a trace must say whether harbor's timeout or another
cancellation (Ctrl-C, a failed sibling trial) stopped an episode. harbor's trial awaits
the agent's `run()` as `asyncio.wait_for(run(...), timeout=...)` in the same task, so the
timeout stands in the frames just above `run()`. `tests/test_harbor_internals.py` checks
on harbor's own trial code that it still does, and `tests/test_harbor_agent.py` on a real
harbor job that a timed-out trial says so.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable, Coroutine
from types import FrameType

# harbor read its clock a little before the agent's run() starts.
_DEADLINE_SLACK_S = 0.05
# The frames between the agent's run() and harbor's wait_for (a task step, harbor's own).
_FRAMES_SEARCHED = 8
# The awaits from the task's outermost coroutine (harbor's job, queue, trial) to wait_for.
_AWAITS_SEARCHED = 32


def harbor_agent_timeout() -> Callable[[], bool] | None:
    """Called by an agent's `run()` itself, first: a way to tell, when the run is
    cancelled, whether harbor's agent timeout did it; None when harbor set no timeout (or
    `run()` was not awaited by harbor).

    The caller's awaiting frames are searched for an `asyncio.Timeout` bound to a name
    (asked whether it `expired()`), or for `wait_for`'s own frame: then its `Timeout`
    itself once the task first waits (`_WaitForTimeout`), and until then its `timeout` read
    as a deadline on the monotonic clock from now, less a little slack.
    """
    frame = sys._getframe(2)  # the frame that awaits the caller's run()
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return None
        for value in frame.f_locals.values():
            if isinstance(value, asyncio.Timeout):
                return value.expired
        if frame.f_code is asyncio.wait_for.__code__:
            timeout = frame.f_locals.get("timeout")
            if isinstance(timeout, int | float) and not isinstance(timeout, bool):
                return _WaitForTimeout(frame, timeout).expired
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _WaitForTimeout:
    """The `asyncio.Timeout` of a running `wait_for`, which its coroutine holds on its
    stack (`async with timeouts.timeout(timeout)`), not under a name. While the awaited
    run() runs, that stack is not readable; so a callback on the loop finds it once the
    task waits, by walking the task's chain of awaited coroutines down to `wait_for`'s
    (the frame seen) and looking among what that coroutine holds. Until then, or if it is
    not found, the timeout is read as a deadline from when run() started, which a loaded
    machine can make late: harbor's clock started before run() did."""

    def __init__(self, frame: FrameType, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout - _DEADLINE_SLACK_S
        self._timeout: asyncio.Timeout | None = None
        task = asyncio.current_task()
        if task is not None:
            asyncio.get_running_loop().call_soon(self._find, task, frame)

    def _find(self, task: asyncio.Task[object], frame: FrameType) -> None:
        awaited: object = task.get_coro()
        for _ in range(_AWAITS_SEARCHED):
            if not isinstance(awaited, Coroutine):
                return
            if getattr(awaited, "cr_frame", None) is frame:
                for held in gc.get_referents(awaited):
                    owner = getattr(held, "__self__", held)  # `__aexit__`, bound to it
                    if isinstance(owner, asyncio.Timeout):
                        self._timeout = owner
                        return
                return
            awaited = getattr(awaited, "cr_await", None)

    def expired(self) -> bool:
        if self._timeout is not None:
            return self._timeout.expired()
        return time.monotonic() >= self._deadline
