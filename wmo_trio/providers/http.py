"""What the HTTP providers share: their async SDK clients, one per trio run and
configuration, and how a server's `retry-after` is read."""

from __future__ import annotations

import datetime
import email.utils
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import trio


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """The wait a response asks for: `retry-after-ms` (milliseconds), else `retry-after`
    (seconds, or an HTTP date). None when absent or unreadable; never negative."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            seconds = _seconds_until(value) if name == "retry-after" else math.nan
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


def _seconds_until(http_date: str) -> float:
    try:
        when = email.utils.parsedate_to_datetime(http_date)
    except (TypeError, ValueError, IndexError):
        return math.nan
    if when.tzinfo is None:  # "-0000" dates: UTC, by RFC 5322
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp() - time.time()


class _RunClients:
    """The clients of one trio run, one per configuration, closed when the run ends."""

    def __init__(self) -> None:
        self._clients: dict[object, Any] = {}
        self._lock = trio.Lock()

    async def get(self, key: object, build: Callable[[], Any]) -> Any:
        client = self._clients.get(key)
        if client is None:
            async with self._lock:
                client = self._clients.get(key)
                if client is None:
                    client = self._clients[key] = await trio.to_thread.run_sync(build)
        return client

    async def close_when_the_run_ends(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                for client in self._clients.values():
                    await client.close()


_CLIENTS: trio.lowlevel.RunVar[_RunClients] = trio.lowlevel.RunVar("wmo_trio_provider_clients")


def run_clients() -> _RunClients:
    """The current trio run's clients (created, with their closer, on first use)."""
    try:
        return _CLIENTS.get()
    except LookupError:
        clients = _RunClients()
        _CLIENTS.set(clients)
        trio.lowlevel.spawn_system_task(clients.close_when_the_run_ends)
        return clients
