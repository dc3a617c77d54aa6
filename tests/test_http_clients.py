"""The SDK clients a trio run shares: a new client once every one has `CALLS_PER_CLIENT`
calls in flight, the least busy one otherwise, and all of them closed when the run ends.
The client here is a stand-in with the one method the engine calls on it (`close`); the
real SDKs' clients are exercised by the provider contract tests."""

from __future__ import annotations

import trio

from wmo_trio.providers._http import CALLS_PER_CLIENT, run_clients


class Client:
    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def test_clients_are_added_as_calls_fill_them_and_closed_with_the_run() -> None:
    built: list[Client] = []

    def build() -> Client:
        built.append(Client(len(built)))
        return built[-1]

    used: list[int] = []

    async def main() -> None:
        clients = run_clients()
        release, all_in = trio.Event(), trio.Event()
        calls = 2 * CALLS_PER_CLIENT + 1

        async def call() -> None:
            async with clients.lease("config", build) as client:
                used.append(client.number)
                if len(used) == calls:
                    all_in.set()
                await release.wait()

        async with trio.open_nursery() as nursery:
            for _ in range(calls):
                nursery.start_soon(call)
            await all_in.wait()
            assert len(built) == 3
            assert [used.count(n) for n in range(3)] == [CALLS_PER_CLIENT, CALLS_PER_CLIENT, 1]
            release.set()
        # every call done: the next goes to the least busy (all idle: the first), no new one
        async with clients.lease("config", build) as client:
            assert client is built[0]
        async with clients.lease("other config", build) as client:
            assert client is built[3]
        assert not any(client.closed for client in built)

    trio.run(main)
    assert len(built) == 4 and all(client.closed for client in built)
