"""How harbor's asyncio code reaches the trio engine, and how episodes reach back.

A `Host` serves one asyncio loop and owns both directions between it and the engine:

- asyncio -> trio: `run_episode` (and `prepare`), awaited from asyncio code;
- worker -> asyncio: every episode it submits gets the host's loop for its
  `CallControl.run_host` calls (harbor's `environment.exec`).

Two hosting situations, two hosts (the same interface, in the manner of anyio's backends):

- **trio owns the loop** (`TrioAsyncioHost`, `_trio_asyncio.py`): a trio program opened
  `trio_asyncio.open_loop()` and runs harbor inside it;
- **harbor owns a plain asyncio loop** (its own CLI; `LoopServingHost`, `_loop_host.py`):
  trio-asyncio cannot bridge there (python-trio/trio-asyncio#133), so one trio run per
  asyncio loop is started lazily, in a dedicated thread or as a guest run on the loop.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

import trio

from wmo_trio.engine._engine import Episode, EpisodeEngine
from wmo_trio.models import RunResult

HostMode = Literal["thread", "guest"]

# For loops harbor owns: a dedicated thread, unless WMO_TRIO_HOST=guest. The thread host
# costs less per episode, cancels sooner and starts bursts sooner, because a guest run does
# all of trio's scheduling on harbor's own thread between harbor's callbacks; at harbor's
# usual concurrency both keep the loop equally responsive. `make bench` measures both
# ("per-episode overhead", "cancel", "start latency", "host heartbeat").
DEFAULT_HOST_MODE: HostMode = "thread"

_ENGINE: trio.lowlevel.RunVar[EpisodeEngine] = trio.lowlevel.RunVar("wmo_trio_engine")


def current_engine() -> EpisodeEngine:
    """The engine of the current trio run, created on first use."""
    try:
        return _ENGINE.get()
    except LookupError:
        engine = EpisodeEngine()
        _ENGINE.set(engine)
        return engine


def set_current_engine(engine: EpisodeEngine) -> None:
    """Make `engine` the current trio run's (a host that starts the run makes its own)."""
    _ENGINE.set(engine)


class Host(ABC):
    """Where the trio engine runs relative to one asyncio loop (`loop`)."""

    name: str
    loop: asyncio.AbstractEventLoop

    @abstractmethod
    async def run_episode(self, episode: Episode, *, workers: int | None = None) -> RunResult:
        """Run `episode` on the engine; awaited from asyncio on `loop`.

        The episode's `CallControl.run_host` calls go to `loop`. If the awaiting task is
        cancelled, the episode is cancelled on the trio side and waited for (cleanup and
        trace included), and `asyncio.CancelledError` is then raised. The episode's own
        exception is raised as itself.
        """

    @abstractmethod
    async def prepare(self, workers: int, *, load: Callable[[], object] | None = None) -> None:
        """Get ready for up to `workers` episodes starting at once (`EpisodeEngine.prepare`:
        `load` run in a worker thread, the heap settled, the worker threads started)."""


def default_host_mode() -> HostMode:
    mode = os.environ.get("WMO_TRIO_HOST", DEFAULT_HOST_MODE)
    if mode == "thread":
        return "thread"
    if mode == "guest":
        return "guest"
    raise ValueError(f"WMO_TRIO_HOST must be 'thread' or 'guest', got {mode!r}")
