"""What ``LocalEnvironment`` costs per trial, next to harbor's own per-trial work.

Two measurements:

- ``start_stop``: environment ``start`` + ``stop(delete=True)`` for N sequential trials
  of the hello-file task (no exec in between), median and p90, with the task's image
  already built; the first trial, which builds the image into an empty cache, is
  reported on its own. Interleaved with them, the same task's trials with
  ``storage_mb = 10240`` (the figure harbor's task template sets), whose writes go to a
  filesystem of that size made at their start (``wmo_trio.sandbox._storage``). Beside
  it, the floor under a start on this machine: bubblewrap with nothing to set up
  (``bwrap --ro-bind / / true``), bubblewrap making a sandbox's namespaces around
  ``true``, and the sandbox's ``python3 -I -S`` starting and exiting, with the load
  average (the machine is shared).
- ``job``: the wall time of an oracle job of hello-file trials run through harbor's own
  ``Job`` API, with the phase durations harbor records in each trial's result
  (environment setup, agent execution, verifier, and the remainder, which includes
  stopping the environment and harbor's own bookkeeping).

Run ``python benchmarks/local_environment.py [--quick]``; it prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "examples" / "tasks" / "hello-file"


def _summary(samples_sec: list[float]) -> dict[str, float]:
    ordered = sorted(samples_sec)
    p90_index = min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(ordered[p90_index] * 1000, 2),
        "min_ms": round(ordered[0] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


STORAGE_MB = 10240


async def _start_stop(n_trials: int, scratch: Path) -> dict[str, Any]:
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    from wmo_trio.harbor import LocalEnvironment
    from wmo_trio.sandbox import wait_for_removals

    variants: dict[str, int | None] = {"plain": None, "storage": STORAGE_MB}
    samples = {name: {"start": [], "stop": [], "total": []} for name in variants}
    first_build_sec = 0.0
    # The first storage trial also finds out, once per process, whether the machine can
    # make such filesystems: like the first build, it is not a sample.
    for index in range(n_trials + 1):
        for name, storage_mb in variants.items():
            trial_paths = TrialPaths(scratch / f"trial-{name}-{index}")
            trial_paths.mkdir()
            environment = LocalEnvironment(
                environment_dir=TASK / "environment",
                environment_name=TASK.name,
                session_id=f"bench-{name}-{index}__env",
                trial_paths=trial_paths,
                task_env_config=EnvironmentConfig(storage_mb=storage_mb),
                state_dir=scratch / "state",
                cache_dir=scratch / "cache",
            )
            began = time.perf_counter()
            await environment.start(force_build=False)
            started = time.perf_counter()
            await environment.stop(delete=True)
            stopped = time.perf_counter()
            if index == 0:
                if name == "plain":  # built the image into the empty cache
                    first_build_sec = stopped - began
                continue
            samples[name]["start"].append(started - began)
            samples[name]["stop"].append(stopped - started)
            samples[name]["total"].append(stopped - began)
    # A stop leaves the trial's files to a thread of their own: the last ones still go.
    began = time.perf_counter()
    await asyncio.to_thread(wait_for_removals)
    plain, storage = samples["plain"], samples["storage"]
    return {
        "n_trials": n_trials,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "first_build_start_plus_stop_ms": round(first_build_sec * 1000, 1),
        "start_plus_stop": _summary(plain["total"]),
        "start": _summary(plain["start"]),
        "stop": _summary(plain["stop"]),
        "with_storage_mb": {
            "storage_mb": STORAGE_MB,
            "start_plus_stop": _summary(storage["total"]),
            "start": _summary(storage["start"]),
            "stop": _summary(storage["stop"]),
        },
        "last_removal_wait_ms": round((time.perf_counter() - began) * 1000, 1),
    }


def _floor(n_runs: int) -> dict[str, Any]:
    """What a start costs on this machine before any of this project's work."""
    namespaces = ["--proc", "/proc", "--dev", "/dev", "--unshare-pid", "--unshare-ipc",
                  "--unshare-uts", "--unshare-net", "--unshare-cgroup", "--die-with-parent",
                  "--as-pid-1"]
    commands = {
        "bwrap_true": ["bwrap", "--ro-bind", "/", "/", "true"],
        "bwrap_namespaces_true": ["bwrap", "--ro-bind", "/", "/", *namespaces, "true"],
        "python3_I_S_pass": ["python3", "-I", "-S", "-c", "pass"],
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(n_runs):  # interleaved, so a burst of load hits each alike
        for name, argv in commands.items():
            began = time.perf_counter()
            subprocess.run(argv, check=True, env={"PATH": "/usr/bin:/bin"})
            samples[name].append(time.perf_counter() - began)
    return {"load_average_1min": round(os.getloadavg()[0], 2),
            **{name: _summary(values) for name, values in samples.items()}}


def _duration(timing: dict[str, Any] | None) -> float | None:
    if not timing or not timing.get("started_at") or not timing.get("finished_at"):
        return None
    began = datetime.fromisoformat(timing["started_at"])
    ended = datetime.fromisoformat(timing["finished_at"])
    return (ended - began).total_seconds()


async def _job(n_trials: int, n_concurrent: int, scratch: Path) -> dict[str, Any]:
    from harbor.job import Job
    from harbor.models.job.config import JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    config = JobConfig(
        job_name="bench",
        jobs_dir=scratch / "jobs",
        n_attempts=n_trials,
        n_concurrent_trials=n_concurrent,
        quiet=True,
        agents=[AgentConfig(name="oracle")],
        environment=EnvironmentConfig(
            import_path="wmo_trio.harbor:LocalEnvironment",
            kwargs={"state_dir": str(scratch / "state")},
        ),
        tasks=[TaskConfig(path=TASK)],
    )
    from wmo_trio.sandbox import wait_for_removals

    began = time.perf_counter()
    job = await Job.create(config)
    await job.run()
    wall_sec = time.perf_counter() - began
    # The trials' stops leave their state directories to threads of their own: the
    # scratch directory goes only once they are done, or both remove the same tree.
    await asyncio.to_thread(wait_for_removals)

    phases: dict[str, list[float]] = {
        "trial": [], "environment_setup": [], "agent_execution": [], "verifier": [],
        "remainder": [],
    }
    rewards: list[float | None] = []
    for path in sorted((scratch / "jobs" / "bench").glob("*/result.json")):
        result = json.loads(path.read_text())
        rewards.append(((result.get("verifier_result") or {}).get("rewards") or {}).get("reward"))
        trial = _duration({"started_at": result["started_at"],
                           "finished_at": result["finished_at"]})
        parts = {name: _duration(result.get(name))
                 for name in ("environment_setup", "agent_execution", "verifier")}
        if trial is None or any(value is None for value in parts.values()):
            continue
        phases["trial"].append(trial)
        for name, value in parts.items():
            assert value is not None
            phases[name].append(value)
        phases["remainder"].append(trial - sum(v for v in parts.values() if v is not None))
    return {
        "n_trials": n_trials,
        "n_concurrent": n_concurrent,
        "wall_sec": round(wall_sec, 3),
        "trials_per_sec": round(n_trials / wall_sec, 2),
        "passed": sum(1 for reward in rewards if reward == 1.0),
        "per_trial_phases": {name: _summary(values) for name, values in phases.items() if values},
    }


def run(quick: bool, smoke: bool = False) -> dict[str, Any]:
    """Measure and return the figures; ``quick`` shrinks every sample, ``smoke`` (with it)
    to the fewest that still produce every figure."""
    samples = 3 if smoke else 10 if quick else 50
    trials, concurrency = (2, 2) if smoke else (8, 4) if quick else (64, 16)
    from wmo_trio.harbor._job import harbor_progress_hidden

    with tempfile.TemporaryDirectory(prefix=f"bench-local-env-{uuid.uuid4().hex[:6]}-") as tmp:
        scratch = Path(tmp)
        (scratch / "start-stop").mkdir()
        (scratch / "job").mkdir()
        start_stop = asyncio.run(_start_stop(samples, scratch / "start-stop"))
        floor = _floor(samples)
        # harbor draws its progress bar even when quiet: off, so no output carries it.
        with harbor_progress_hidden():
            job = asyncio.run(_job(trials, concurrency, scratch / "job"))
    phases = job["per_trial_phases"]
    return {
        # Flat headline figures first (what a summary table shows), details after.
        "start_stop_median_ms": start_stop["start_plus_stop"]["median_ms"],
        "start_stop_p90_ms": start_stop["start_plus_stop"]["p90_ms"],
        "start_median_ms": start_stop["start"]["median_ms"],
        "stop_median_ms": start_stop["stop"]["median_ms"],
        "storage_mb_start_stop_median_ms":
            start_stop["with_storage_mb"]["start_plus_stop"]["median_ms"],
        "floor_bwrap_namespaces_median_ms": floor["bwrap_namespaces_true"]["median_ms"],
        "floor_python3_median_ms": floor["python3_I_S_pass"]["median_ms"],
        "first_build_start_stop_ms": start_stop["first_build_start_plus_stop_ms"],
        "job_trials": job["n_trials"],
        "job_concurrency": job["n_concurrent"],
        "job_wall_s": job["wall_sec"],
        "job_passed": job["passed"],
        "trial_median_ms": phases["trial"]["median_ms"],
        "environment_setup_median_ms": phases["environment_setup"]["median_ms"],
        "agent_execution_median_ms": phases["agent_execution"]["median_ms"],
        "verifier_median_ms": phases["verifier"]["median_ms"],
        "details": {
            "mode": "quick" if quick else "full",
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "environment_start_stop": start_stop,
            "start_floor": floor,
            "oracle_job": job,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small samples")
    arguments = parser.parse_args()
    print(json.dumps(run(arguments.quick), indent=2))


if __name__ == "__main__":
    main()
