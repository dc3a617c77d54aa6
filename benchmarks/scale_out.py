"""Scenario: beyond one process, on Ray (`wmo_trio.cluster`).

Two parts, each measured side by side in the same run, one layout after the other, each
in an interpreter of its own:

- real model traffic (`benchmarks/traffic.py`'s episode: the real `anthropic` SDK against
  the loopback Messages API server, 2 s model calls, 0.5 s commands, 5 steps): the
  research API on `traffic.WORKERS` Ray worker processes of an embedded local Ray
  (`research-workers`), the research API in one process (`research`), and the SDK alone in
  one process (`sdk-alone`). CPU per step counts every process of a layout: with workers,
  the driver, its Ray and its workers (`traffic.tree_cpu_s`).
- a real harbor job: `hello-file` trials on the docker-free environment (the scripted
  offline model, 0.2 s a call), `wmo-trio run` in one process against
  `wmo-trio run --workers 2`; each job's wall time is its command's, Ray's start included.

    python -m benchmarks.scale_out [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import harbor_job, traffic

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("research-workers", "research", "sdk-alone")
# episodes; harbor trials and their -n
SIZES = {"full": (4096, 256, 64), "quick": (32, 8, 4), "smoke": (2, 2, 2)}


def run(quick: bool, smoke: bool = False, log: Any = lambda line: None) -> dict[str, Any]:
    """Both parts; see the module docstring."""
    mode = "smoke" if smoke else "quick" if quick else "full"
    episodes, trials, concurrency = SIZES[mode]
    profile = traffic.QUICK if quick else traffic.FULL
    cap = max(profile.ideal_s * 30, 120.0 if quick else 0.0)
    results: dict[str, Any] = {
        "mode": mode, "workers": traffic.WORKERS, "episodes": episodes, "profile": asdict(profile),
        "ideal_s": profile.ideal_s, "cap_s": cap, "load_before": os.getloadavg(), "traffic": []}
    from benchmarks import messages_server

    messages_server.raise_open_files_limit()
    burst = [("anthropic", episodes)]
    with messages_server.serve(delay_s=profile.model_s, tool_calls=profile.tool_calls) as server:
        for impl in IMPLS:
            load = os.getloadavg()
            log(f"anthropic x {episodes:,}: {impl} (load {load[0]:.2f}) ...")
            server.stats(reset=True)
            share = traffic.MachineShare()
            process = subprocess.Popen(
                traffic._command((impl,), burst, profile, server.base_url, cap), cwd=ROOT,
                env=traffic._environ(impl), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            [measured] = traffic._finish(process, 2 * cap + 600, (impl,), burst)
            stats = server.stats()
            results["traffic"].append({**measured, "load_before": load, "server": stats,
                                       "machine": share.figures(stats["cpu_s"])})
    results["harbor"] = harbor_jobs(trials, concurrency, log)
    results["load_after"] = os.getloadavg()
    return results


def harbor_jobs(trials: int, concurrency: int, log: Any) -> dict[str, Any]:
    """`hello-file` x `trials` at `-n concurrency`: `wmo-trio run` in one process, then with
    `--workers`; each job's wall time from its command's start to its exit."""
    jobs: dict[str, Any] = {"trials": trials, "concurrency": concurrency,
                            "latency_s": harbor_job.LATENCY_S}
    command = [str(Path(sys.executable).parent / "wmo-trio"), "run", "-p", str(harbor_job.TASK),
               "-k", str(trials), "-n", str(concurrency), "-e", "wmo_trio.harbor:LocalEnvironment",
               "--provider-config", json.dumps({"latency_s": harbor_job.LATENCY_S})]
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="wmo-bench-scale-out-") as scratch:
        for name, extra in (("one process", []), (f"{traffic.WORKERS} workers",
                                                  ["--workers", str(traffic.WORKERS)])):
            log(f"harbor job, {trials} trials at -n {concurrency}: {name} (load "
                f"{os.getloadavg()[0]:.2f}) ...")
            job = name.replace(" ", "-")
            began = time.perf_counter()
            completed = subprocess.run([*command, "-o", scratch, "--job-name", job, *extra], cwd=ROOT,
                                       env=env, capture_output=True, text=True, timeout=3600)
            wall = time.perf_counter() - began
            if completed.returncode != 0:
                jobs[name] = {"failed": f"exit {completed.returncode}: {completed.stderr[-1500:]}"}
                continue
            jobs[name] = harbor_job._summarise(Path(scratch) / job, wall)
    return jobs


def markdown(result: dict[str, Any]) -> list[str]:
    """The scenario's tables, for the suite's results."""
    profile, workers = result["profile"], result["workers"]
    names = {"research-workers": f"research API on {workers} worker processes (Ray)",
             "research": "research API, one process", "sdk-alone": "SDK alone, one process"}
    before, after = result["load_before"], result["load_after"]
    lines = [
        "", f"Beyond one process, on Ray: {result['episodes']:,} episodes of the real-traffic "
        f"scenario ({profile['tool_calls']} bash calls then submit, {profile['model_s']:g} s a "
        f"model call, {profile['command_s']:g} s a command: {result['ideal_s']:g} s ideal), each "
        "layout in turn; CPU per step counts every process of the layout (with workers: the "
        f"driver, its Ray and its workers). Load average (1 min) {before[0]:.2f} before, "
        f"{after[0]:.2f} after.", "",
        "| layout | wall time / ideal | CPU per step | traces written | submitted | other "
        "processes' CPU during the run (cores) |", "|---|---:|---:|---:|---:|---:|"]
    for run in result["traffic"]:
        label = names.get(run["impl"], run["impl"])
        if "failed" in run:
            lines.append(f"| {label} | failed: {run['failed'][:200]} | | | | |")
            continue
        lines.append(f"| {label} | {run['wall_over_ideal']:.3f}x | {run['cpu_per_step_ms']:.1f} ms | "
                     f"{run['traces']:,} | {run['submitted']:,} | "
                     f"{run['machine']['others_cores']:.2f} |")
    jobs = result["harbor"]
    lines += ["", f"A harbor job on Ray: {jobs['trials']} trials of `hello-file` at "
              f"`-n {jobs['concurrency']}`, docker-free environment, {jobs['latency_s']:g} s per "
              "model call; each wall time is its `wmo-trio run` command's, Ray's start included.",
              "", "| layout | wall | trials | mean reward | errors |", "|---|---:|---:|---:|---:|"]
    for name, job in jobs.items():
        if not isinstance(job, dict):
            continue
        if "failed" in job:
            lines.append(f"| `wmo-trio run`, {name} | failed: {job['failed'][:200]} | | | |")
            continue
        lines.append(f"| `wmo-trio run`, {name} | {job['wall_s']:.1f} s | {job['trials']} | "
                     f"{job['mean_reward']:.2f} | {job['errors']} |")
    return lines


if __name__ == "__main__":
    json.dump(run("--quick" in sys.argv, log=lambda line: print(line, file=sys.stderr, flush=True)),
              sys.stdout, indent=2)
