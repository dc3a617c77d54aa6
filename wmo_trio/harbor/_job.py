"""Running a harbor `Job` with trio owning the process (trio-asyncio hosts harbor)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from wmo_trio.engine import run_asyncio


async def run_job(config: Any, *, on_create: Callable[[Any], None] | None = None) -> Any:
    """From trio: create and run a harbor `Job` for `config` (a `JobConfig`), and return its
    `JobResult`. `on_create`, when given, is called with the `Job` once it is created and
    before it runs (to add trial hooks with `job.add_hook`; they run on harbor's loop, in
    the trio thread).

    Harbor's asyncio code runs on trio-asyncio's loop (opened here unless one is already
    open in this context), and every wmo_trio agent in the job reaches the engine through
    it. Cancelling the calling trio scope cancels the job and waits for harbor to finish
    its own cleanup.
    """
    from harbor.job import Job

    async def create_and_run() -> Any:
        job = await Job.create(config)
        if on_create is not None:
            on_create(job)
        return await job.run()

    return await run_asyncio(create_and_run)


@contextmanager
def harbor_progress_hidden() -> Iterator[None]:
    """Keep harbor's own progress bar off the terminal while a job runs in this process.

    harbor 0.25's `Job.run` draws a bar even with `quiet=True` (quiet only drops the
    per-trial lines), on rich's process-wide console and with nothing to turn it off. Under
    a display of the caller's own, two live displays redraw the same lines and the bar
    flickers through; piped, its last frame lands in the output. That console is muted for
    the block (harbor prints nothing else through it) and restored after.
    """
    import rich

    console = rich.get_console()
    was_quiet = console.quiet
    console.quiet = True
    try:
        yield
    finally:
        console.quiet = was_quiet


def record_interrupted_end(job_dir: Path) -> None:
    """Give a job that was cancelled as a whole (Ctrl-C) its `finished_at` in result.json.

    harbor 0.25 leaves it unset after an interruption, so that its viewer does not show
    the job as complete; wmo_trio's job ended all the same, every trial cancelled and
    scored or not as harbor records it (`stats.n_cancelled_trials`), and a reader of the
    directory should not take it for a job still running. A job cancelled before harbor
    wrote its result has none to change.
    """
    from harbor.models.job.result import JobResult

    path = job_dir / "result.json"
    if path.is_symlink() or not path.is_file():
        return
    result = JobResult.model_validate_json(path.read_bytes())
    if result.finished_at is None:
        result.finished_at = datetime.now()  # naive local time, as harbor writes it
        path.write_text(result.model_dump_json(indent=4, exclude={"trial_results"}))
