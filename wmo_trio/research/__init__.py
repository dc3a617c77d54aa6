"""A trio-native API for research harnesses: thousands of episodes, no harbor job needed.

    async with wmo_trio.open_episode_pool(limit=32) as pool:
        result = await pool.run(doc, {"kind": "scripted", "model": "offline"},
                                "Create the file `a.txt` ...", DirectoryEnvironment(workdir))
        async with pool.fan_out(specs) as results:
            async for spec, outcome in results:
                ...

Episodes run on the same engine as the harbor agent, with the same guarantees: when the
caller's scope is cancelled, the episode is stopped, its worker waited for, and its
cleanup and trace run shielded before the cancellation propagates. With `workers=` or
`ray_address=` the pool's episodes run on worker processes (`_fan_out`), each with its
own engine and pool, their specs sent as data and their traces written here.

Environments here are trio-native (`TrioEnvironment`: async `exec` and `write_file`):
`DirectoryEnvironment` runs commands with `trio.run_process` in a directory of this
host, and `HarborEnvironment` wraps a harbor task environment for trio programs that run
harbor's asyncio code under trio-asyncio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from wmo_trio.research._pool import (
    DirectoryEnvironment,
    EpisodePool,
    EpisodeSpec,
    HarborEnvironment,
    Pool,
    TrioEnvironment,
    open_local_pool,
)

__all__ = [
    "DirectoryEnvironment",
    "EpisodePool",
    "EpisodeSpec",
    "HarborEnvironment",
    "Pool",
    "TrioEnvironment",
    "open_episode_pool",
    "run_harbor_job",
]


def __getattr__(name: str) -> Any:
    # The documented name before `DirectoryEnvironment` (three `Local*Environment`
    # classes had three interfaces); kept for code written against it.
    if name == "LocalProcessEnvironment":
        import warnings

        warnings.warn("wmo_trio.LocalProcessEnvironment is now DirectoryEnvironment",
                      DeprecationWarning, stacklevel=2)
        return DirectoryEnvironment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@asynccontextmanager
async def open_episode_pool(limit: int = 64, *, workers: int | str | None = None,
                            ray_address: str | None = None) -> AsyncIterator[Pool]:
    """A pool of at most `limit` concurrent episodes for this block; cancelling the
    enclosing scope cancels its episodes with the engine's guarantees. Opening it starts
    the engine's worker threads for `limit` episodes, so a fan-out starts at once.

    With `workers` (a number, or `auto`: one per core) the episodes run on that many
    worker processes of an embedded local Ray started for the block; with `ray_address`
    on a running Ray cluster (one worker per node unless `workers` says otherwise). Each
    worker has its own engine and a pool of its share of `limit`; `fan_out` yields
    `(spec, outcome)` pairs as episodes finish, as in one process. A spec's document,
    provider configuration and environment are sent to the worker as data (an
    environment that cannot be, such as `HarborEnvironment`, is refused before anything
    runs); its trace is written here at its `trace_path`. A
    `wmo_trio.cluster.ClusterError` says in one line why the workers cannot start."""
    from wmo_trio.cluster import ClusterOptions

    options = ClusterOptions.of(workers, ray_address)
    if options is None:
        async with open_local_pool(limit) as pool:
            yield pool
        return
    from wmo_trio.research._fan_out import open_remote_pool

    async with open_remote_pool(limit, options) as remote:
        yield remote


async def run_harbor_job(config: Any, *, workers: int | str | None = None,
                         ray_address: str | None = None) -> Any:
    """From trio: run a harbor `Job` for `config` (a `JobConfig`) and return its result,
    opening trio-asyncio's loop unless one is already open; with `workers` or
    `ray_address`, its trials on Ray worker processes, into this one job directory (see
    `wmo_trio.harbor.run_job`)."""
    from wmo_trio.harbor import run_job

    return await run_job(config, workers=workers, ray_address=ray_address)
