"""Harbor jobs of the ``oracle`` agent on the docker-free environment, run in this
process: harbor's own ``Job``, configured as ``harbor run -e
wmo_trio.harbor:LocalEnvironment -a oracle -p PATH`` configures it, for the tests that
are about the sandbox rather than harbor's CLI. A CLI run pays a process and harbor's
imports (seconds of CPU); the test process has them already."""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from test_local_environment import trial_results

from wmo_trio.sandbox._namespace import wait_for_removals

__all__ = ["run_oracle_job"]


@contextmanager
def _working_directory(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_oracle_job(jobs_dir: Path, path: Path, *, concurrency: int = 1, attempts: int = 1,
                   cwd: Path | None = None, **environment: Any) -> dict[str, dict[str, Any]]:
    """Run the job ``jobs_dir/job`` over ``path`` (one task, or a directory of tasks as a
    dataset) from ``cwd``, with ``environment`` as the environment's kwargs (``--ek``);
    each trial's result.json by trial name. Whatever harbor raises, the CLI's failure,
    reaches the caller."""
    from harbor.job import Job
    from harbor.models.job.config import DatasetConfig, JobConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    source: dict[str, Any] = (
        {"tasks": [TaskConfig(path=path)]} if Task.is_valid_dir(path)
        else {"datasets": [DatasetConfig(path=path)]})
    config = JobConfig(
        job_name="job", jobs_dir=jobs_dir, quiet=True, n_attempts=attempts,
        n_concurrent_trials=concurrency, agents=[AgentConfig(name="oracle")],
        environment=EnvironmentConfig(import_path="wmo_trio.harbor:LocalEnvironment",
                                      kwargs=environment),
        **source,
    )

    async def run() -> None:
        await (await Job.create(config)).run()

    with _working_directory(cwd), warnings.catch_warnings():
        # harbor's own trial code calls what it deprecates; nothing a test can change.
        warnings.filterwarnings("ignore", "Task.checksum will be deprecated", DeprecationWarning)
        asyncio.run(run())
    # As at the end of harbor's process: the stopped trials' directories are gone.
    wait_for_removals()
    return trial_results(jobs_dir)
