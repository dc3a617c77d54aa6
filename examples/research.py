"""100 episodes of the example harness document, 32 at a time, from a trio program.

Each episode gets its own working directory and a small task the scripted offline policy
knows; the program checks every result itself and prints a summary. No API key, no Docker,
no harbor job: this is the research API (`wmo_trio.open_episode_pool`).

    .venv/bin/python examples/research.py
"""

from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import wmo_trio
from wmo_trio import DirectoryEnvironment, EpisodeSpec

EXAMPLE = Path(__file__).resolve().parent / "harness.json"
PROVIDER = {"kind": "scripted", "model": "offline"}


def task(index: int) -> tuple[str, str, str]:
    """(instruction, file to check, expected content) for episode `index`."""
    if index % 4 == 3:
        return ("Create a small Python package named `calc` in `.`, with `calc/__init__.py`, "
                "`calc/ops.py` and `calc/__main__.py`.", "calc/ops.py", "def add(a, b):")
    line = f"hello from episode {index}"
    return (f"Create the file `out/greeting-{index}.txt` whose whole content is the line "
            f"`{line}`", f"out/greeting-{index}.txt", line + "\n")


async def run_all(specs: list[EpisodeSpec], concurrency: int) -> list[tuple[EpisodeSpec, Any]]:
    """Every episode through one pool, collected as they finish."""
    finished = []
    async with wmo_trio.open_episode_pool(limit=concurrency) as pool:
        async with pool.fan_out(specs) as results:
            async for spec, outcome in results:
                finished.append((spec, outcome.unwrap()))
    return finished


def main(episodes: int = 100, concurrency: int = 32) -> None:
    doc = wmo_trio.load_harness(EXAMPLE)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        specs, checks = [], {}
        for index in range(episodes):
            workdir = root / f"episode-{index}"
            workdir.mkdir()
            instruction, path, expected = task(index)
            spec = EpisodeSpec(doc, PROVIDER, instruction, DirectoryEnvironment(workdir),
                               task_id=f"episode-{index}", trace_path=workdir / "wmo-run.json")
            specs.append(spec)
            checks[spec.task_id] = (workdir / path, expected)
        finished = trio.run(run_all, specs, concurrency)
        elapsed = time.perf_counter() - started
        reasons = collections.Counter(result.stop_reason.value for _, result in finished)
        passed = sum(1 for spec, _ in finished
                     if checks[spec.task_id][0].is_file()
                     and checks[spec.task_id][1] in checks[spec.task_id][0].read_text())
        tokens = sum(r.worker_usage.input_tokens for _, r in finished if r.worker_usage)
        traces = sum(1 for spec in specs if Path(str(spec.trace_path)).is_file())
    print(f"{episodes} episodes at concurrency {concurrency} in {elapsed:.2f} s")
    print(f"stop reasons: {dict(reasons)}")
    print(f"checked correct: {passed}/{episodes}; traces written: {traces}/{episodes}; "
          f"input tokens (estimated): {tokens:,}")


if __name__ == "__main__":
    main()
