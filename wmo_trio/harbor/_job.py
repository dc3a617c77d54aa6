"""Running a harbor `Job` with trio owning the process (trio-asyncio hosts harbor)."""

from __future__ import annotations

from typing import Any

from wmo_trio.engine import run_asyncio


async def run_job(config: Any) -> Any:
    """From trio: create and run a harbor `Job` for `config` (a `JobConfig`), and return its
    `JobResult`.

    Harbor's asyncio code runs on trio-asyncio's loop (opened here unless one is already
    open in this context), and every wmo_trio agent in the job reaches the engine through
    it. Cancelling the calling trio scope cancels the job and waits for harbor to finish
    its own cleanup.
    """
    from harbor.job import Job

    async def create_and_run() -> Any:
        job = await Job.create(config)
        return await job.run()

    return await run_asyncio(create_and_run)
