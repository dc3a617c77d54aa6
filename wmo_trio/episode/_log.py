"""An episode's transcript, recorded as it happens."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from wmo_trio.models import Action, Observation, Step, TokenUsage


@dataclass(frozen=True)
class Reply:
    """One model reply: the index of the first step it produced, its text and usage, and
    when it arrived (UTC)."""

    first_step: int
    text: str
    usage: TokenUsage
    at: datetime | None = None


class EpisodeLog:
    """The steps, replies and usage of an episode. Thread-safe: the host reads it while the
    worker writes, so a cancelled episode keeps its partial transcript. `on_change` is
    called (in the writing thread) after every change."""

    def __init__(self, on_change: Callable[[EpisodeLog], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._steps: list[Step] = []
        self._usage = TokenUsage()
        self._replies: list[Reply] = []
        self._on_change = on_change
        # When the last step or reply was recorded: the next step's action began then.
        self._mark = time.monotonic()
        self._wall_mark = datetime.now(UTC)

    def record(self, action: Action, observation: Observation) -> None:
        with self._lock:
            now = time.monotonic()
            started_at, duration = self._wall_mark, now - self._mark
            self._steps.append(Step(action=action, observation=observation,
                                    started_at=started_at, duration_s=duration))
            self._mark, self._wall_mark = now, started_at + timedelta(seconds=duration)
        self._changed()

    def add_usage(self, usage: TokenUsage | None) -> None:
        if usage is None:
            return
        with self._lock:
            self._usage = self._usage + usage
        self._changed()

    def begin_reply(self, text: str, usage: TokenUsage) -> None:
        """A model reply arrived; the steps recorded next are its actions."""
        with self._lock:
            now = time.monotonic()
            at = self._wall_mark + timedelta(seconds=now - self._mark)
            self._replies.append(Reply(len(self._steps), text, usage, at))
            self._usage = self._usage + usage
            self._mark, self._wall_mark = now, at
        self._changed()

    def steps(self) -> list[Step]:
        with self._lock:
            return list(self._steps)

    def replies(self) -> list[Reply]:
        with self._lock:
            return list(self._replies)

    def usage(self) -> TokenUsage:
        with self._lock:
            return self._usage

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)
