"""`make bench-quick` runs every scenario and produces its outputs (shape, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the quick benchmark suite in subprocesses

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.harbor
def test_bench_quick_writes_results_table_and_plots(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["engine"]) == {"baseline", "thread", "guest", "trio-asyncio"}
    for impl, engine in results["engine"].items():
        assert [s["n"] for s in engine["start"]] == [16, 64], impl
        for size in engine["start"]:
            assert size["start_p99_ms"] >= size["start_p50_ms"] >= 0
            assert size["wall_over_ideal"] > 0.9 and size["peak_threads"] > size["n"]
            assert size["cpu_s"] > 0
        assert engine["overhead"]["per_episode_us"] > 0
        assert engine["round_trip"]["per_call_us"] > 0 < engine["round_trip"]["bare_loop_per_call_us"]
        bridge = engine["cancel_bridge_only"]
        assert bridge["timed_out"] == bridge["n"] and bridge["cancel_p99_ms"] >= 0, impl
        for case in engine["cancel"] + engine["cancel_by_n"]:
            assert case["timed_out"] == case["n"] and case["traces"] == case["n"], (impl, case)
        assert isinstance(engine["threads_left_after_idle"], int)
    job = results["harbor_job"]
    for agent in ("baseline", "wmo_trio", "wmo_trio_trio_host"):
        assert job[agent]["trials"] == job["n"] and job[agent]["mean_reward"] == 1.0, agent
    assert results["local_environment"]
    table = (tmp_path / "results.md").read_text()
    assert "| scenario | baseline (asyncio) |" in table and "cancel p99" in table
    assert "Real harbor job" in table and "process CPU time / ideal wall time" in table
    for plot in ("start_latency.png", "cancel_latency.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")
