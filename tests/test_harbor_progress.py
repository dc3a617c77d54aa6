"""harbor's own progress bar, kept off the output of a process that runs a job itself."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from wmo_trio.harbor._job import harbor_progress_hidden

pytestmark = [pytest.mark.slow, pytest.mark.harbor]

TASK = Path(__file__).resolve().parent.parent / "examples" / "tasks" / "hello-file"


def _quiet_job(where: Path, name: str) -> None:
    """One trial of the oracle agent, harbor on its own asyncio loop as its CLI runs it."""
    from harbor.job import Job
    from harbor.models.job.config import JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    config = JobConfig(
        job_name=name, jobs_dir=where / "jobs", quiet=True, agents=[AgentConfig(name="oracle")],
        environment=EnvironmentConfig(import_path="wmo_trio.harbor:LocalEnvironment",
                                      kwargs={"state_dir": str(where / "state")}),
        tasks=[TaskConfig(path=TASK)],
    )

    async def run() -> None:
        await (await Job.create(config)).run()

    asyncio.run(run())


def test_harbor_draws_a_bar_when_quiet_and_hiding_it_leaves_no_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import rich

    # The premise, checked on this harbor release: `quiet=True` still draws its bar, on
    # rich's process-wide console (when this fails, harbor changed how it reports).
    _quiet_job(tmp_path, "shown")
    shown = capsys.readouterr()
    assert "1/1" in shown.out + shown.err

    with harbor_progress_hidden():
        _quiet_job(tmp_path, "hidden")
    hidden = capsys.readouterr()
    assert hidden.out == "" and "1/1" not in hidden.err, hidden
    assert not rich.get_console().quiet  # the console speaks again after the block
