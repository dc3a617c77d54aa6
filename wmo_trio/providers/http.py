"""What the HTTP providers share: their async SDK clients, one per trio run and
configuration, and how a server's `retry-after` is read."""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
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


# Calls in flight per client. The HTTP client's connection pool looks at every connection
# it holds to place a request and again to release it, so a pool with a thousand
# connections costs a thousand checks a call (at 1,024 episodes, a fifth of the process's
# CPU); clients of a configuration are added so that none carries more than this.
CALLS_PER_CLIENT = 64


class _Clients:
    """The clients of one configuration, and how many calls each has in flight."""

    def __init__(self) -> None:
        self.clients: list[Any] = []
        self.in_flight: list[int] = []


class _RunClients:
    """The SDK clients of one trio run, per configuration (enough of them that each pool
    stays small), closed when the run ends. All of it runs on the trio thread."""

    def __init__(self) -> None:
        self._by_key: dict[object, _Clients] = {}
        self._lock = trio.Lock()

    @contextlib.asynccontextmanager
    async def lease(self, key: object, build: Callable[[], Any]) -> AsyncIterator[Any]:
        """A client of configuration `key` for one call: the least busy one, or a new one
        (`build`, run in a worker thread) when all have `CALLS_PER_CLIENT` in flight."""
        clients = self._by_key.setdefault(key, _Clients())
        index = _least_busy(clients)
        if index is None:
            async with self._lock:
                index = _least_busy(clients)
                if index is None:
                    client = await trio.to_thread.run_sync(build)
                    clients.clients.append(client)
                    clients.in_flight.append(0)
                    index = len(clients.clients) - 1
        clients.in_flight[index] += 1
        try:
            yield clients.clients[index]
        finally:
            clients.in_flight[index] -= 1

    async def close_when_the_run_ends(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                for clients in self._by_key.values():
                    for client in clients.clients:
                        await client.close()


def _least_busy(clients: _Clients) -> int | None:
    if not clients.in_flight:
        return None
    index = min(range(len(clients.in_flight)), key=clients.in_flight.__getitem__)
    return index if clients.in_flight[index] < CALLS_PER_CLIENT else None


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
