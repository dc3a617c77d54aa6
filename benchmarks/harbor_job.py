"""Scenario 7: a real harbor job on the docker-free environment, per agent and host.

`n` attempts of the `hello-file` example task at `-n n`, the scripted offline policy with a
set latency per model call, run three ways: harbor's own CLI with the wmo_trio agent
(plain asyncio loop, the engine's thread host), `wmo-trio run` (trio owns the loop), and
harbor's CLI with the baseline agent. Figures come from harbor's own result files.

A smoke run (the test suite's check of the outputs) runs each job through its CLI's own
typer app with the same arguments, in one process and one after the other: a fresh
interpreter's harbor imports cost more than a job's two trials.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "examples" / "tasks" / "hello-file"
HARNESS = ROOT / "examples" / "harness.json"
LATENCY_S = 0.2
CALLS = 3  # the offline policy's plan for hello-file


def _seconds(start: str, end: str) -> float:
    return (datetime.fromisoformat(end.replace("Z", "+00:00"))
            - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()


def _summarise(job_dir: Path, wall: float) -> dict[str, Any]:
    results = [json.loads(p.read_text()) for p in job_dir.glob("*/result.json")]
    agent = [_seconds(r["agent_execution"]["started_at"], r["agent_execution"]["finished_at"])
             for r in results if r.get("agent_execution")]
    rewards = [((r.get("verifier_result") or {}).get("rewards") or {}).get("reward", 0.0)
               for r in results]
    ideal = CALLS * LATENCY_S
    return {
        "trials": len(results), "wall_s": wall,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "errors": sum(1 for r in results if r.get("exception_info")),
        "agent_mean_s": sum(agent) / len(agent) if agent else float("nan"),
        "agent_overhead_ms": (sum(agent) / len(agent) - ideal) * 1000 if agent else float("nan"),
    }


def _jobs(quick: bool, jobs: Path, n: int) -> dict[str, list[str]]:
    provider = json.dumps({"kind": "scripted", "model": "offline", "latency_s": LATENCY_S})
    bin_dir = Path(sys.executable).parent
    harbor = [str(bin_dir / "harbor"), "run", "-p", str(TASK), "-k", str(n), "-n", str(n),
              "-o", str(jobs), "-y", "-q", "-m", "scripted/offline",
              "--skip-model-parsing-and-provider-mapping", "--ak", f"harness={HARNESS}",
              "--ak", f"provider_config={provider}", "--ak", f"episode_workers={n}",
              "-e", "wmo_trio.harbor:LocalEnvironment"]
    return {
        "baseline": [*harbor, "--job-name", "baseline",
                     "-a", "benchmarks.baseline_agent:BaselineHarborAgent"],
        "wmo_trio": [*harbor, "--job-name", "wmo_trio", "-a", "wmo_trio.harbor:WmoTrioHarborAgent"],
        "wmo_trio_trio_host": [
            str(bin_dir / "wmo-trio"), "run", "-p", str(TASK), "-k", str(n), "-n", str(n),
            "-o", str(jobs), "--job-name", "wmo_trio_trio_host",
            "-e", "wmo_trio.harbor:LocalEnvironment",
            "--provider-config", json.dumps({"latency_s": LATENCY_S})],
    }


def _run_side_by_side(commands: list[tuple[str, list[str]]], env: dict[str, str],
                      finished: dict[str, float]) -> None:
    """Start `commands` together; `finished[name]` is each one's own wall time, from the
    common start to its own exit (a wait per job, so one job's end never waits on another's)."""
    started = time.perf_counter()
    running = {name: subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for name, command in commands}
    failures: dict[str, str] = {}

    def wait(name: str, process: subprocess.Popen[str]) -> None:
        _, err = process.communicate(timeout=900)
        finished[name] = time.perf_counter() - started
        if process.returncode != 0:
            failures[name] = err[-2000:]

    waiters = [threading.Thread(target=wait, args=item) for item in running.items()]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    for name, err in failures.items():
        raise RuntimeError(f"harbor job {name} failed: {err}")


def _run_cli_here(name: str, command: list[str]) -> None:
    """`command` (harbor's or wmo-trio's command line) through that CLI's own typer app in
    this process; what it prints is kept, and shown only if the job fails."""
    if Path(command[0]).name == "harbor":
        from harbor.cli.main import app
    else:
        from wmo_trio.cli import app
    from wmo_trio.harbor._job import harbor_progress_hidden

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm goes online
    printed = io.StringIO()
    on_sigterm = signal.getsignal(signal.SIGTERM)  # harbor's CLI sets its own
    try:
        with (contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed),
              harbor_progress_hidden()):
            code = app(args=command[1:], prog_name=Path(command[0]).name, standalone_mode=False)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)
    if code:
        raise RuntimeError(f"harbor job {name} failed (exit {code}): {printed.getvalue()[-2000:]}")


def import_clis() -> None:
    """What `run(quick=True, smoke=True)` imports, for a process that forks to run it."""
    from harbor.cli.main import app  # noqa: F401

    from wmo_trio.cli import app as wmo_trio_app  # noqa: F401
    from wmo_trio.harbor import WmoTrioHarborAgent  # noqa: F401


def run(quick: bool, smoke: bool = False) -> dict[str, Any]:
    """The three jobs one after the other (side by side in a quick run, shape only); each
    job's wall time is its own, from its start to its own exit. `smoke`: 2 trials each,
    every job through its CLI in this process, one after the other, `wmo-trio run` last:
    trio-asyncio, which it imports, changes asyncio's loop policy for the whole process,
    so nothing may run an asyncio loop in it afterwards (a smoke run runs this in a
    forked copy of its process)."""
    n = 2 if smoke else 8 if quick else 64
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(ROOT)}
    results: dict[str, Any] = {"n": n, "latency_s": LATENCY_S, "side_by_side": quick and not smoke,
                               "in_process": smoke}
    with tempfile.TemporaryDirectory() as scratch:
        jobs = Path(scratch)
        commands = list(_jobs(quick, jobs, n).items())
        walls: dict[str, float] = {}
        if smoke:
            for name, command in commands:  # `_jobs` lists `wmo-trio run` last
                began = time.perf_counter()
                _run_cli_here(name, command)
                walls[name] = time.perf_counter() - began
        else:
            for batch in [commands] if quick else [[command] for command in commands]:
                _run_side_by_side(batch, env, walls)
        for name, _ in commands:
            results[name] = _summarise(jobs / name, walls[name])
    return results


if __name__ == "__main__":
    json.dump(run("--quick" in sys.argv), sys.stdout, indent=2)
