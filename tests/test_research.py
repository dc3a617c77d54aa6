"""The trio-native research API: episode pools, fan-out, trio environments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
from processes import running

import wmo_trio
from wmo_trio import DirectoryEnvironment, EpisodeSpec
from wmo_trio.episode._environment import CommandResult
from wmo_trio.harness import HarnessError, parse_harness
from wmo_trio.models import Action, ActionKind, Observation, Step, StopReason
from wmo_trio.trace import CUT, FinishedTrace, parse_trace, trace_text, write_trace

ROOT = Path(__file__).resolve().parent.parent
DOC = {"name": "r", "surfaces": [{"id": "prompt:core", "kind": "prompt", "content": "go"}]}
OFFLINE = {"kind": "scripted", "model": "offline"}
HELLO = "Create the file `out/hi.txt` whose whole content is the line `hi`"


def bash_then_submit(command: str) -> dict[str, Any]:
    return {"kind": "scripted", "model": "s", "script": [
        {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"answer": "ok"}}]}]}


async def test_a_pool_runs_an_episode_and_writes_its_trace(tmp_path: Path) -> None:
    async with wmo_trio.open_episode_pool(limit=4) as pool:
        result = await pool.run(DOC, OFFLINE, HELLO, DirectoryEnvironment(tmp_path),
                                task_id="hello", trace_path=tmp_path / "trace.json")
    assert result.stop_reason is StopReason.SUBMITTED and result.task_id == "hello"
    assert (tmp_path / "out/hi.txt").read_text() == "hi\n"
    trace = parse_trace((tmp_path / "trace.json").read_text())
    assert (trace.steps, trace.stop_reason, trace.answer, trace.turns, trace.worker_usage) == (
        result.steps, result.stop_reason, result.answer, result.turns, result.worker_usage)
    # The trace says which episode it is: the caller's id, the document, the model, when.
    expected = ("hello", parse_harness(DOC).doc_hash, "scripted/offline")
    assert (trace.task_id, trace.doc_hash, trace.model) == expected
    assert trace.started_at is not None and trace.ended_at is not None
    assert trace.started_at <= trace.steps[0].started_at <= trace.ended_at  # type: ignore[operator]


def test_a_trace_too_deep_to_serialise_whole_is_written_reduced_and_says_so(
        tmp_path: Path) -> None:
    """Arguments 300 levels deep (past pydantic-core's 255) once left a trial without its
    wmo-run.json; now what lies deeper than the trace keeps is cut, and the trace says so."""
    deep: dict[str, Any] = {}
    for _ in range(300):
        deep = {"a": deep}
    step = Step(action=Action(kind=ActionKind.TOOL_CALL, name="bash",
                              arguments={"command": "true", "deep": deep}),
                observation=Observation(content="done", metadata={"deep": deep}))
    trace = FinishedTrace(task_id="t", steps=[step], stop_reason=StopReason.ERROR, turns=1)

    written = parse_trace(write_trace(tmp_path, trace).read_text())

    assert written.reduced is not None and "nested deeper than 32 levels" in written.reduced
    arguments = written.steps[0].action.arguments
    assert arguments is not None and arguments["command"] == "true"
    kept, levels = arguments["deep"], 2  # the arguments, then "deep"
    while kept != CUT:
        kept, levels = kept["a"], levels + 1
    assert levels == 33
    assert written.steps[0].observation.content == "done"
    whole = json.loads(trace_text(trace.model_copy(update={"steps": []})))
    assert "reduced" not in whole  # only a reduced trace says so


async def test_fan_out_delivers_every_result_and_errors_as_outcomes(tmp_path: Path) -> None:
    specs = [EpisodeSpec(DOC, OFFLINE, HELLO, DirectoryEnvironment(tmp_path / str(i)),
                         task_id=str(i)) for i in range(6)]
    for spec in specs:
        Path(spec.environment.workdir).mkdir()  # type: ignore[attr-defined]
    specs.append(EpisodeSpec({"name": "bad", "surfaces": []}, OFFLINE, HELLO,
                             DirectoryEnvironment(tmp_path), task_id="bad"))
    seen: dict[str, Any] = {}
    async with wmo_trio.open_episode_pool(limit=3) as pool:
        async with pool.fan_out(specs) as results:
            async for spec, outcome in results:
                seen[spec.task_id] = outcome
    assert set(seen) == {*map(str, range(6)), "bad"}
    assert all(seen[str(i)].unwrap().stop_reason is StopReason.SUBMITTED for i in range(6))
    with pytest.raises(HarnessError):
        seen["bad"].unwrap()


class _Started(DirectoryEnvironment):
    """Releases `started` as each of its commands begins."""

    def __init__(self, workdir: Path, started: trio.Semaphore) -> None:
        super().__init__(workdir)
        self.started = started

    async def exec(self, command: str) -> Any:
        self.started.release()
        return await super().exec(command)


async def test_cancelling_the_caller_stops_the_episode_and_keeps_a_partial_trace(
        tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    started = trio.Semaphore(0)

    async def cancel_once_the_command_runs(scope: trio.CancelScope) -> None:
        await started.acquire()
        while not running("sleep 30.417"):  # noqa: ASYNC110 (a process, not an event)
            await trio.sleep(0.01)
        scope.cancel()

    with trio.fail_after(20):  # far below the 30 s command
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:
                nursery.start_soon(cancel_once_the_command_runs, scope)
                async with wmo_trio.open_episode_pool(limit=2) as pool:
                    await pool.run(DOC, bash_then_submit("sleep 30.417"), "go",
                                   _Started(tmp_path, started), trace_path=trace)
    assert scope.cancelled_caught
    assert not running("sleep 30.417")
    record = json.loads(trace.read_text())
    assert record["partial"] is True and record["stop_reason"] == "cancelled-by-caller"
    assert record["steps"][0]["action"]["name"] == "bash"


async def test_leaving_fan_out_early_cancels_what_is_still_running(tmp_path: Path) -> None:
    started = trio.Semaphore(0)
    specs = [EpisodeSpec(DOC, bash_then_submit(f"sleep 31.{i}2"), "go",
                         _Started(tmp_path, started), trace_path=tmp_path / f"{i}.json")
             for i in range(4)]
    with trio.fail_after(20):  # far below the 31 s commands
        async with wmo_trio.open_episode_pool(limit=4) as pool:
            async with pool.fan_out(specs) as results:
                for _ in range(4):  # every episode is in its command
                    await started.acquire()
                del results
        while any(running(f"sleep 31.{i}2") for i in range(4)):  # noqa: ASYNC110 (processes)
            await trio.sleep(0.05)
    assert all((tmp_path / f"{i}.json").is_file() for i in range(4))


async def test_the_pool_limit_bounds_concurrency(tmp_path: Path) -> None:
    # The first two episodes' commands wait for each other, so two are in flight at once
    # whatever the machine's speed; a third at any moment would show in the peak.
    active = {"now": 0, "peak": 0}
    full = trio.Event()

    class Counting:
        async def exec(self, command: str) -> CommandResult:
            active["now"] += 1
            active["peak"] = max(active["peak"], active["now"])
            if active["now"] == 2:
                full.set()
            await full.wait()
            active["now"] -= 1
            return CommandResult("", "", 0)

        async def write_file(self, path: str, data: bytes) -> None:
            pass

    specs = [EpisodeSpec(DOC, bash_then_submit("x"), "go", Counting()) for _ in range(6)]
    with trio.fail_after(60):  # a pool running one episode at a time would wait here for ever
        async with wmo_trio.open_episode_pool(limit=2) as pool:
            async with pool.fan_out(specs) as results:
                outcomes = [outcome async for _, outcome in results]
    assert len(outcomes) == 6 and active["peak"] == 2
    assert all(o.unwrap().stop_reason is StopReason.SUBMITTED for o in outcomes)


async def test_local_process_environment_kills_a_timed_out_command_group(tmp_path: Path) -> None:
    environment = DirectoryEnvironment(tmp_path, command_timeout_sec=0.5)
    with pytest.raises(TimeoutError):
        await environment.exec("(sleep 32.51; touch late) & sleep 32.52")
    # Killed at once; the kernel may take a moment to take them off a loaded machine.
    with trio.fail_after(20):  # far below the 32 s the commands would live
        while running("sleep 32.51") or running("sleep 32.52"):  # noqa: ASYNC110 (processes, not events)
            await trio.sleep(0.05)
    assert not (tmp_path / "late").exists()


async def test_a_pool_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        async with wmo_trio.open_episode_pool(limit=0):
            pass


@pytest.mark.slow  # its own interpreter
def test_the_harbor_environment_adapter_runs_under_trio_asyncio(tmp_path: Path) -> None:
    # An asyncio environment with harbor's exec signature, driven from trio through
    # trio-asyncio (in its own interpreter: trio-asyncio changes asyncio's policy). Its
    # write_file is the harbor adapter's algorithm: a parent directory whose name ends in a
    # newline (issue 15.6: "$(dirname ...)" lost it) and content large enough to upload.
    code = textwrap.dedent(f"""
        import asyncio, json, trio
        import wmo_trio
        from wmo_trio.engine import run_asyncio

        class AsyncioEnvironment:
            def __init__(self):
                self.files = {{}}
            async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None):
                asyncio.get_running_loop()  # proves we are on the asyncio side
                process = await asyncio.create_subprocess_shell(
                    command, cwd={str(tmp_path)!r}, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE)
                out, err = await process.communicate()
                class Result: pass
                result = Result()
                result.stdout, result.stderr, result.return_code = (
                    out.decode(), err.decode(), process.returncode)
                return result
            async def upload_file(self, source_path, target_path):
                import shutil
                shutil.copyfile(source_path, target_path)

        async def main():
            import trio_asyncio
            async with trio_asyncio.open_loop():
                environment = wmo_trio.HarborEnvironment(AsyncioEnvironment())
                async with wmo_trio.open_episode_pool(limit=2) as pool:
                    result = await pool.run({DOC!r}, {OFFLINE!r}, {HELLO!r}, environment)
                await environment.write_file("nldir\\n/f.txt", b"one\\n")
                await environment.write_file("big/data.bin", bytes(range(256)) * 400)
            print(json.dumps({{"stop": result.stop_reason.value}}))

        trio.run(main)
    """)
    completed = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                               text=True, timeout=120, cwd=ROOT, env=dict(os.environ))
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout.splitlines()[-1]) == {"stop": "submitted"}
    assert (tmp_path / "out/hi.txt").read_text() == "hi\n"
    assert (tmp_path / "nldir\n" / "f.txt").read_bytes() == b"one\n"
    assert not (tmp_path / "nldir").exists()
    assert (tmp_path / "big" / "data.bin").read_bytes() == bytes(range(256)) * 400


@pytest.mark.slow  # a subprocess of 100 episodes
def test_the_research_example_runs_its_hundred_episodes() -> None:
    # Run as from the activated venv: a quarter of the episodes start `python3` twice, which
    # on a machine with a version manager first on PATH (pyenv's shims, bash scripts) costs
    # several times the interpreter's own start, most of the example's CPU.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    completed = subprocess.run([sys.executable, "examples/research.py"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300,
                               env={**os.environ, "PATH": path})
    assert completed.returncode == 0, completed.stderr
    assert "checked correct: 100/100; traces written: 100/100" in completed.stdout


async def test_a_pool_names_a_document_by_the_harness_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JSON text is the document, not a file's name; a Path of the same characters is that
    # file (here an invalid document), never the text's document remembered for it.
    text = json.dumps(DOC)
    (tmp_path / text).write_text(json.dumps({"name": "file", "surfaces": []}))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    async with wmo_trio.open_episode_pool(limit=1) as pool:
        result = await pool.run(text, OFFLINE, HELLO, DirectoryEnvironment(tmp_path / "work"))
        assert result.stop_reason is StopReason.SUBMITTED
        with pytest.raises(HarnessError, match="needs at least one prompt surface"):
            await pool.run(Path(text), OFFLINE, HELLO, DirectoryEnvironment(tmp_path / "work"))
