"""What wmo_trio relies on in harbor beyond its public API, each checked against the harbor
installed, so that a harbor release that moves it fails here, loudly, before a trial is
misreported: the agent timeout read from the call stack (`wmo_trio.harbor._timeout`), and
the job configuration the docker-free environment reads through harbor's own model.
(The identity hooks have theirs in `test_harbor_identity.py`.)"""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from pathlib import Path

import pytest
from harbor.models.job.config import DatasetConfig, JobConfig
from harbor.models.trial.config import TaskConfig

from wmo_trio.harbor._timeout import harbor_agent_timeout
from wmo_trio.sandbox._environment import _job_sources

# -- harbor's agent timeout, read from the call that awaits the agent's run() ------------


def test_harbor_runs_the_agent_under_wait_for() -> None:
    # If a harbor release awaits the agent's run() otherwise, this fails before any timed-out
    # trial is reported as another cancellation.
    from harbor.trial.trial import Trial

    source = textwrap.dedent(inspect.getsource(Trial._run_agent_phase))
    awaited = [node.value for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Await) and isinstance(node.value, ast.Call)]
    assert any(ast.unparse(call.func) == "asyncio.wait_for"
               and isinstance(call.args[0], ast.Call) and ast.unparse(call.args[0].func) == "run"
               and [k.arg for k in call.keywords] == ["timeout"] for call in awaited), source


def _timeout_seen(wrap: str) -> tuple[bool | None, bool | None]:
    """What `harbor_agent_timeout` tells a run() awaited as `wrap` says: whether it found a
    timeout, and whether that had expired when asked."""
    async def run() -> tuple[bool | None, bool | None]:
        timed_out = harbor_agent_timeout()
        return (None, None) if timed_out is None else (True, timed_out())

    async def main() -> tuple[bool | None, bool | None]:
        if wrap == "wait_for":
            return await asyncio.wait_for(run(), timeout=3600)
        if wrap == "wait_for spent":
            return await asyncio.wait_for(run(), timeout=0.01)
        if wrap == "timeout":
            async with asyncio.timeout(3600) as scope:
                assert scope is not None
                return await run()
        return await run()

    return asyncio.run(main())


@pytest.mark.parametrize(("wrap", "seen"), [
    ("wait_for", (True, False)), ("wait_for spent", (True, True)), ("timeout", (True, False)),
    ("bare", (None, None)),
])
def test_the_agent_reads_harbors_timeout_from_the_call_that_awaits_it(
        wrap: str, seen: tuple[bool | None, bool | None]) -> None:
    assert _timeout_seen(wrap) == seen


@pytest.mark.parametrize("loop", ["asyncio", "trio-asyncio"])
def test_a_run_that_starts_late_still_reads_harbors_timeout_as_harbor_set_it(loop: str) -> None:
    # On a loaded machine run() can start well after wait_for started its clock. Its
    # deadline counted from run()'s start would then be late, and harbor's timeout read as
    # another cancellation; wait_for's own Timeout, found once the task waits, is not.
    import time

    read: list[bool] = []

    async def run() -> None:
        time.sleep(0.5)  # a late start: the interpreter busy elsewhere, as under load
        timed_out = harbor_agent_timeout()
        assert timed_out is not None
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            read.append(timed_out())
            raise

    async def trial() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run(), timeout=1.0)

    if loop == "asyncio":
        asyncio.run(trial())
    else:
        import trio
        import trio_asyncio

        async def main() -> None:
            async with trio_asyncio.open_loop():
                await trio_asyncio.aio_as_trio(trial)()

        trio.run(main)
    assert read == [True]


# -- the job's configuration, as the docker-free environment reads it -----------------------


def test_the_environment_finds_the_jobs_datasets_and_tasks_in_the_config_harbor_writes(
        tmp_path: Path) -> None:
    config = JobConfig(datasets=[DatasetConfig(path=tmp_path / "dataset")],
                       tasks=[TaskConfig(path=tmp_path / "task"),
                              TaskConfig(path=tmp_path / "git-task", download_dir=tmp_path / "dl")])
    (tmp_path / "config.json").write_text(config.model_dump_json(indent=4))
    assert _job_sources(tmp_path / "config.json") == [
        tmp_path / "dataset", tmp_path / "task", tmp_path / "git-task", tmp_path / "dl"]


def test_a_job_config_that_is_not_harbors_hides_nothing_more_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "config.json").write_text('{"tasks": [{"path": 1}]}')
    assert _job_sources(tmp_path / "config.json") == []
    assert "cannot be read" in caplog.text
    assert _job_sources(tmp_path / "absent.json") == []
