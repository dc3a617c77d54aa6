"""Harbor's own `Job`, run in the pytest process as harbor's CLI runs it.

For the tests whose subject is the trials, not harbor's command line: a pytest process
that has imported harbor and wmo_trio already runs a job without an interpreter start and
those imports, which cost more than a small job's trials (`harbor run` of one trivial
trial is mostly imports). Tests of the command line itself (its flags, exit codes,
messages, signals) run `harbor run`.
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from wmo_trio.sandbox import wait_for_removals

if TYPE_CHECKING:
    from harbor.models.job.config import JobConfig

# How long a job may take before the test gives up on it: a hang, not a slow machine.
JOB_TIMEOUT_S = 240


def run_job_here(config: JobConfig) -> None:
    """Run a harbor job for `config` in this process: harbor's preflight of its environment
    and agents first, then the job under `asyncio.run`, as `harbor run` does; the
    environment a test run of `harbor run` gets (no `WMO_TRIO_HOST`, so the default host;
    litellm's local cost map), restored after; and, as at the end of harbor's process, the
    stopped trials' directories gone. Fails the test when the job takes longer than
    `JOB_TIMEOUT_S` (harbor cancels its trials first)."""
    from harbor.agents.factory import AgentFactory
    from harbor.environments.factory import EnvironmentFactory
    from harbor.job import Job

    from wmo_trio.harbor._job import harbor_progress_hidden

    async def run() -> None:
        job = await Job.create(config)
        try:
            await asyncio.wait_for(job.run(), JOB_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"harbor job {config.jobs_dir / config.job_name} did not finish "
                        f"in {JOB_TIMEOUT_S} s")

    with (pytest.MonkeyPatch.context() as patch, harbor_progress_hidden(),
          warnings.catch_warnings()):
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        patch.delenv("WMO_TRIO_HOST", raising=False)
        # harbor's notice of an API it will change, once a trial; its CLI does not show it
        warnings.filterwarnings("ignore", "Task.checksum", DeprecationWarning)
        EnvironmentFactory.run_preflight(type=config.environment.type,
                                         import_path=config.environment.import_path)
        for agent in config.agents:
            AgentFactory.run_preflight(agent, skip_credential_checks=config.skip_credential_checks)
        asyncio.run(run())
    wait_for_removals()


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
    """harbor's `oracle` agent on the docker-free environment, as `harbor run -a oracle
    -e wmo_trio.harbor:LocalEnvironment -p PATH` runs it, in this process: the job
    `jobs_dir/job` over `path` (one task, or a directory of tasks as a dataset), from
    `cwd`, with `environment` as the environment's kwargs (`--ek`). Each trial's
    result.json by trial name; whatever harbor raises reaches the caller."""
    from harbor.models.job.config import DatasetConfig
    from harbor.models.job.config import JobConfig as Config
    from harbor.models.task.task import Task
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    source: dict[str, Any] = (
        {"tasks": [TaskConfig(path=path)]} if Task.is_valid_dir(path)
        else {"datasets": [DatasetConfig(path=path)]})
    with _working_directory(cwd):
        run_job_here(Config(
            job_name="job", jobs_dir=jobs_dir, quiet=True, n_attempts=attempts,
            n_concurrent_trials=concurrency, agents=[AgentConfig(name="oracle")],
            environment=EnvironmentConfig(import_path="wmo_trio.harbor:LocalEnvironment",
                                          kwargs=environment),
            **source))
    return {path.parent.name: json.loads(path.read_text())
            for path in sorted((jobs_dir / "job").glob("*/result.json"))}
