"""What `harness_backend='sandbox'` costs per episode, against `local` in the same run.

- ``start``: sequential episodes of a `code:runtime` program, the time from `run()` to
  the program's first model call, on `local`, on `sandbox` with its pool of ready runners,
  and on `sandbox` without one (every runner started for its episode); each figure's
  median and p90, and the added median over `local`. Episodes are spaced as real ones
  are (a real episode lasts seconds), so the pool has refilled when the next one starts.
- ``burst``: N episodes at once through the research API (two model calls of a fixed
  latency each), on `local` then on `sandbox`: wall time over the ideal, the first model
  call's p50/p99 from the burst's start, and how many submitted. A burst larger than the
  pool starts most of its runners itself, all at once: that is what it measures.

Run ``python -m benchmarks.sandbox_backend [--quick]``; it prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROGRAM = """
def run(kit):
    for _ in range(2):
        kit.complete(kit.task_id, [{"role": "user", "content": kit.instruction}])
    kit.execute("submit", {"answer": "done"})
"""
# The spacing of sequential episodes: what a pool needs to refill, far below a real
# episode's length.
SPACING_S = 0.3


def _document() -> Any:
    from wmo_trio.harness import parse_harness

    return parse_harness({"name": "bench", "surfaces": [
        {"id": "prompt:core", "kind": "prompt", "content": "Benchmark."},
        {"id": "code:runtime", "kind": "code", "content": PROGRAM}]})


class _Timed:
    """A scripted provider that notes when each episode (by task id, the request's system
    text) made its first model call."""

    def __init__(self, latency_s: float) -> None:
        from wmo_trio.providers import ProviderConfig
        from wmo_trio.providers.script import load_script
        from wmo_trio.providers.scripted import ScriptedProvider

        self.inner = ScriptedProvider(ProviderConfig(kind="scripted", model="bench"),
                                      script=load_script([{"text": "ok"}]), latency_s=latency_s)
        self.config = self.inner.config
        self.first: dict[str, float] = {}
        self._lock = threading.Lock()

    def complete(self, request: Any, control: Any) -> Any:
        with self._lock:
            self.first.setdefault(request.system, time.perf_counter())
        return self.inner.complete(request, control)

    def prepare(self) -> None:
        pass

    def close(self) -> None:
        pass


def _summary(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {"median_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] * 1000, 2),
            "min_ms": round(ordered[0] * 1000, 2), "max_ms": round(ordered[-1] * 1000, 2)}


def _start(n: int, workdir: Path) -> dict[str, Any]:
    from wmo_trio.backends import SandboxSettings, build_runtime, sandbox_problem
    from wmo_trio.episode import LocalDirEnvironment

    problem = sandbox_problem()
    if problem is not None:
        raise SystemExit(f"the sandbox backend cannot run here: {problem}")
    doc = _document()
    variants = {"local": ("local", None), "sandbox_pool": ("sandbox", SandboxSettings()),
                "sandbox_cold": ("sandbox", SandboxSettings(pool_size=0))}
    starts: dict[str, list[float]] = {name: [] for name in variants}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(n + 1):  # the first round warms each variant (imports, the pool)
        for name, (backend, settings) in variants.items():
            provider = _Timed(0.0)
            runtime = build_runtime(doc, provider, backend=backend, backend_settings=settings)
            began = time.perf_counter()
            result = runtime.run(f"{name}-{index}", "go", LocalDirEnvironment(workdir))
            ended = time.perf_counter()
            runtime.close()
            if result.answer != "done":
                raise RuntimeError(f"{name}: the episode ended {result.stop_reason}: {result.steps}")
            if index:
                starts[name].append(provider.first[f"{name}-{index}"] - began)
                walls[name].append(ended - began)
            time.sleep(SPACING_S)
    summary = {name: {"start": _summary(starts[name]), "episode": _summary(walls[name])}
               for name in variants}
    local = summary["local"]["start"]["median_ms"]
    return {"n": n, **summary,
            "added_start_median_ms": {name: round(summary[name]["start"]["median_ms"] - local, 2)
                                      for name in ("sandbox_pool", "sandbox_cold")}}


def _burst(n: int, latency_s: float, workdir: Path) -> dict[str, Any]:
    import trio

    import wmo_trio
    from wmo_trio.research import EpisodeSpec, LocalProcessEnvironment

    doc = _document()
    out: dict[str, Any] = {"n": n, "latency_s": latency_s, "ideal_s": 2 * latency_s}
    for backend in ("local", "sandbox"):
        provider = _Timed(latency_s)
        submitted = 0

        async def main(backend: str = backend, provider: _Timed = provider) -> float:
            nonlocal submitted
            specs = [EpisodeSpec(doc, provider, "go", LocalProcessEnvironment(workdir),
                                 task_id=f"{backend}-{i}", backend=backend) for i in range(n)]
            async with wmo_trio.open_episode_pool(limit=n) as pool:
                began = time.perf_counter()
                async with pool.fan_out(specs) as results:
                    async for _, outcome in results:
                        submitted += outcome.unwrap().answer == "done"
            return began

        began = trio.run(main)
        wall = time.perf_counter() - began
        firsts = sorted(t - began for t in provider.first.values())
        out[backend] = {
            "wall_s": round(wall, 3), "wall_over_ideal": round(wall / (2 * latency_s), 3),
            "first_call_p50_ms": round(statistics.median(firsts) * 1000, 1),
            "first_call_p99_ms": round(firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))]
                                       * 1000, 1),
            "submitted": submitted,
        }
    out["wall_ratio"] = round(out["sandbox"]["wall_s"] / out["local"]["wall_s"], 2)
    return out


def run(quick: bool, smoke: bool = False) -> dict[str, Any]:
    """Measure and return the figures; ``quick`` shrinks every sample, ``smoke`` (with it)
    to the fewest that still produce every figure."""
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-backend-") as tmp:
        start = _start(2 if smoke else 5 if quick else 50, Path(tmp))
        burst = _burst(4 if smoke else 16 if quick else 256, 2.0, Path(tmp))
    return {
        # Flat headline figures first (what a summary table shows), details after.
        "added_start_median_ms_pool": start["added_start_median_ms"]["sandbox_pool"],
        "added_start_median_ms_cold": start["added_start_median_ms"]["sandbox_cold"],
        "start_median_ms_local": start["local"]["start"]["median_ms"],
        "burst_episodes": burst["n"],
        "burst_wall_s_local": burst["local"]["wall_s"],
        "burst_wall_s_sandbox": burst["sandbox"]["wall_s"],
        "burst_wall_ratio": burst["wall_ratio"],
        "burst_submitted_sandbox": burst["sandbox"]["submitted"],
        "details": {"mode": "quick" if quick else "full", "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "start": start, "burst": burst},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small samples")
    arguments = parser.parse_args()
    print(json.dumps(run(arguments.quick), indent=2))


if __name__ == "__main__":
    main()
