"""Scenario: beyond one process, on Ray (`wmo_trio.cluster`).

Two parts, each measured side by side in the same run, one layout after the other, each
in an interpreter of its own:

- real model traffic (`benchmarks/traffic.py`'s episode: the real `anthropic` SDK against
  the loopback Messages API server, 2 s model calls, 0.5 s commands, 5 steps): the
  research API on `traffic.WORKERS` Ray worker processes of an embedded local Ray
  (`research-workers`), the research API in one process (`research`), and the SDK alone in
  one process (`sdk-alone`). CPU per step counts every process of a layout: with workers,
  the driver, its Ray daemons and its workers (`traffic.tree_cpu_s`), each reported apart,
  and the loopback server's beside them (the same work in every layout).
- a real harbor job: `hello-file` trials on the docker-free environment (the scripted
  offline model, 0.2 s a call), `wmo-trio run` in one process against
  `wmo-trio run --workers 2`; each job's wall time is its command's, Ray's start included,
  and its CPU that of the command and every process below it that it reaped.

With each layout, the load average before it and how many cores the machine's other
processes used meanwhile (`traffic.MachineShare`): the machine is shared.

    python -m benchmarks.scale_out [--quick]
"""

from __future__ import annotations

import functools
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
        "date": time.strftime("%Y-%m-%d"), "mode": mode, "workers": traffic.WORKERS,
        "episodes": episodes, "profile": asdict(profile),
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
            layout_cpu = sum(measured.get("cpu_by_role_s", {}).values()) or measured.get("cpu_s", 0.0)
            results["traffic"].append({**measured, "load_before": load, "server": stats,
                                       "machine": with_unreaped(share.figures(stats["cpu_s"]),
                                                                layout_cpu)})
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
            load = os.getloadavg()
            log(f"harbor job, {trials} trials at -n {concurrency}: {name} (load {load[0]:.2f}) ...")
            job = name.replace(" ", "-")
            share = traffic.MachineShare()
            began = time.perf_counter()
            process = subprocess.Popen([*command, "-o", scratch, "--job-name", job, *extra], cwd=ROOT,
                                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True)
            cpu = _sampled_cpu_s(process)
            wall = time.perf_counter() - began
            if process.returncode != 0:
                assert process.stderr is not None
                jobs[name] = {"failed": f"exit {process.returncode}: {process.stderr.read()[-1500:]}"}
                continue
            jobs[name] = {**harbor_job._summarise(Path(scratch) / job, wall), "cpu_by_role_s": cpu,
                          "load_before": load,
                          "machine": with_unreaped(share.figures(0.0), sum(cpu.values()))}
    return jobs


def with_unreaped(figures: dict[str, float], layout_cpu_s: float) -> dict[str, float]:
    """`traffic.MachineShare`'s figures with the layout's processes that no process of ours
    reaps (Ray's workers and daemons, and what they start) counted as ours, not as the
    other processes'."""
    wall = figures["wall_s"]
    unreaped = max(0.0, layout_cpu_s - figures["runs_cores"] * wall) / wall
    return {**figures, "runs_cores": figures["runs_cores"] + unreaped,
            "others_cores": max(0.0, figures["others_cores"] - unreaped)}


SAMPLE_S = 0.25
ROLES = ("driver", "workers", "ray", "sandboxes")


def _sampled_cpu_s(process: subprocess.Popen[str]) -> dict[str, float]:
    """CPU time of `process` and every process below it, by role, sampled every `SAMPLE_S`
    until it exits (each process counted at the last sample that saw it: a process that
    lived less than that, such as most of a sandbox's, is missed in both layouts)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seen: dict[int, tuple[str, float]] = {}
    deadline = time.monotonic() + 3600
    while process.poll() is None and time.monotonic() < deadline:
        pending = [process.pid]
        while pending:
            current = pending.pop()
            try:
                fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
                line = Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                for listing in Path(f"/proc/{current}/task").glob("*/children"):
                    pending.extend(int(child) for child in listing.read_text().split())
            except (OSError, IndexError, ValueError):
                continue
            # A worker starts as Ray's worker program and is named for its actor once it is one.
            known = seen[current][0] if current in seen else None
            role = ("driver" if current == process.pid
                    else "workers" if line.startswith(("ray::TrialWorker", "ray::EpisodeWorker"))
                    else known or ("ray" if "ray" in line else "sandboxes"))
            seen[current] = (role, (int(fields[11]) + int(fields[12])) / ticks)
        time.sleep(SAMPLE_S)
    process.wait(timeout=60)
    return {role: sum(cpu for kind, cpu in seen.values() if kind == role) for role in ROLES}


NAMES = {"research-workers": "research API, {workers} worker processes (Ray)",
         "research": "research API, one process", "sdk-alone": "SDK alone, one process"}


def markdown(result: dict[str, Any]) -> list[str]:
    """The scenario's tables (docs/benchmarks.md)."""
    profile, workers = result["profile"], result["workers"]
    runs = {run["impl"]: run for run in result["traffic"]}
    one, alone = runs.get("research", {}), runs.get("sdk-alone", {})
    before, after = result["load_before"], result["load_after"]
    lines = [
        f"Measured {result.get('date', '')} ({result['mode']} run): {result['episodes']:,} episodes "
        f"of the real-traffic scenario ({profile['tool_calls']} bash calls then submit, "
        f"{profile['model_s']:g} s a model call, {profile['command_s']:g} s a command: "
        f"{result['ideal_s']:g} s ideal), each layout in turn. CPU per step is the layout's "
        "own (with workers: the driver, its Ray daemons and its workers), then each part of "
        "it and the loopback server's, per step. Load average (1 min) "
        f"{before[0]:.2f} before, {after[0]:.2f} after; the other processes' cores are the "
        "machine's busy CPU less ours and the server's.", "",
        "| layout | wall / ideal | against one process / the SDK alone | CPU per step | "
        "driver | workers | Ray daemons | server | traces | submitted | load before | other "
        "processes (cores) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["traffic"]:
        label = NAMES.get(run["impl"], run["impl"]).format(workers=workers)
        if "failed" in run:
            lines.append(f"| {label} | failed: {run['failed'][:200]} |" + " |" * 10)
            continue
        roles = run.get("cpu_by_role_s", {"driver": run["cpu_s"]})
        per_step = functools.partial(_per_step, steps=run["steps"] or 1)
        lines.append(
            f"| {label} | {run['wall_over_ideal']:.2f}x | {_ratio(run, one)} / {_ratio(run, alone)} | "
            f"{run['cpu_per_step_ms']:.2f} ms | {per_step(roles.get('driver'))} | "
            f"{per_step(roles.get('workers'))} | {per_step(roles.get('ray'))} | "
            f"{per_step(run['server']['cpu_s'])} | {run['traces']:,} | {run['submitted']:,} | "
            f"{run['load_before'][0]:.1f} | {run['machine']['others_cores']:.2f} |")
    jobs = result["harbor"]
    lines += ["", f"A harbor job on Ray: {jobs['trials']} trials of `hello-file` at "
              f"`-n {jobs['concurrency']}`, docker-free environment, {jobs['latency_s']:g} s per "
              "model call; each wall time is its `wmo-trio run` command's, Ray's start included, "
              "and its CPU that of the command and every process below it, sampled every "
              f"{SAMPLE_S:g} s (the sandboxes' processes mostly live less than that).", "",
              "| layout | wall | CPU: driver | workers | Ray daemons | sandboxes | trials | mean "
              "reward | errors | load before | other processes (cores) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, job in jobs.items():
        if not isinstance(job, dict):
            continue
        if "failed" in job:
            lines.append(f"| `wmo-trio run`, {name} | failed: {job['failed'][:200]} |" + " |" * 9)
            continue
        cpu = " | ".join(f"{job['cpu_by_role_s'][role]:.1f} s" for role in ROLES)
        lines.append(f"| `wmo-trio run`, {name} | {job['wall_s']:.1f} s | {cpu} | "
                     f"{job['trials']} | {job['mean_reward']:.2f} | {job['errors']} | "
                     f"{job['load_before'][0]:.1f} | {job['machine']['others_cores']:.2f} |")
    return lines


def headline(result: dict[str, Any]) -> list[str]:
    """The front page's rows (README): 2 workers against one process."""
    runs = {run["impl"]: run for run in result["traffic"]}
    ours, one = runs.get("research-workers", {}), runs.get("research", {})
    loads = [run["load_before"][0] for run in result["traffic"] if "load_before" in run]
    others = [run["machine"]["others_cores"] for run in result["traffic"] if "machine" in run]
    lines = [f"Measured {result.get('date', '')} ({result['mode']} run), the layouts one after the "
             f"other; load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f} "
             f"before each, other processes using {min(others, default=0):.2f}-"
             f"{max(others, default=0):.2f} of the 2 cores meanwhile.", "",
             "| scale-out (Ray) | figure | one process | "
             f"{result['workers']} worker processes | ratio |", "|---|---|---:|---:|---:|"]
    if "wall_over_ideal" in ours and "wall_over_ideal" in one:
        for key, label, unit in (("wall_over_ideal", "wall time / ideal", "x"),
                                 ("cpu_per_step_ms", "CPU per step, every process of the layout",
                                  " ms")):
            lines.append(f"| research API | {label} @ {result['episodes']:,} (anthropic) | "
                         f"{one[key]:.2f}{unit} | {ours[key]:.2f}{unit} | {ours[key] / one[key]:.2f} |")
    jobs = result["harbor"]
    alone, spread = jobs.get("one process", {}), jobs.get(f"{result['workers']} workers", {})
    if "wall_s" in alone and "wall_s" in spread:
        lines.append(f"| harbor job | wall time, {jobs['trials']} trials of `hello-file` at "
                     f"`-n {jobs['concurrency']}` | {alone['wall_s']:.1f} s | {spread['wall_s']:.1f} s "
                     f"| {spread['wall_s'] / alone['wall_s']:.2f} |")
    return lines


def _per_step(seconds: float | None, *, steps: int) -> str:
    return "-" if seconds is None else f"{seconds / steps * 1000:.2f} ms"


def _ratio(run: dict[str, Any], base: dict[str, Any]) -> str:
    if "wall_over_ideal" not in base or "wall_over_ideal" not in run:
        return "-"
    return f"{run['wall_over_ideal'] / base['wall_over_ideal']:.2f}"


if __name__ == "__main__":
    json.dump(run("--quick" in sys.argv, log=lambda line: print(line, file=sys.stderr, flush=True)),
              sys.stdout, indent=2)
