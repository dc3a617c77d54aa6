"""The `sandbox` backend's tests' kit: a cold runner pool per test, a scripted program
traced to its answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from doubles import Spy

import wmo_trio
from support.programs import INSTRUCTION, code_doc
from wmo_trio.backends import SandboxExecution, sandbox_problem
from wmo_trio.models import RunResult, StopReason
from wmo_trio.research import DirectoryEnvironment

PROBLEM = sandbox_problem()


class Runners:
    """Every runner the runtimes of a test start, to check they are gone afterwards."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def gone(self) -> None:
        for runner in self.started:
            assert runner.process.returncode is not None, "a runner was not reaped"
            for directory in runner.cgroup.directories if runner.cgroup else ():
                assert not directory.exists(), f"cgroup {directory} left behind"


@pytest.fixture
def runners(monkeypatch: pytest.MonkeyPatch) -> Iterator[Runners]:
    """The runners the test's episodes ran on (from the pool or started for them)."""
    seen = Runners()
    original = SandboxExecution._start

    def start(runtime: SandboxExecution) -> Any:
        runner = original(runtime)
        seen.started.append(runner)
        return runner

    monkeypatch.setattr(SandboxExecution, "_start", start)
    yield seen
    seen.gone()


class Scripted(Spy):
    """A `Spy` the research API can take as a caller's own provider."""

    def prepare(self) -> None:
        pass


def traced(source: str, workdir: Path, script: list[dict[str, Any]] | None = None,
           **kwargs: Any) -> tuple[RunResult, dict[str, Any]]:
    """The episode through the research API on `sandbox`, and the trace it wrote."""
    trace = workdir / "trace.json"

    async def main() -> RunResult:
        async with wmo_trio.open_episode_pool(limit=2) as pool:
            return await pool.run(code_doc(source), Scripted(script or [{"text": "unused"}]), INSTRUCTION,
                                  DirectoryEnvironment(workdir), trace_path=trace,
                                  backend="sandbox", **kwargs)

    result = trio.run(main)
    return result, json.loads(trace.read_text())


def answer_of(result: RunResult) -> Any:
    assert result.stop_reason is StopReason.SUBMITTED, result.steps
    return json.loads(result.answer)

