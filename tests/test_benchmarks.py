"""`make bench-quick` runs every scenario and produces its outputs (shape, not timings).

The suite runs it as `--quick --smoke`: the same scenarios, implementations, providers and
layouts, each at the fewest episodes that still give every figure, in the fewest
interpreters (forked copies of the suite's process where bench-quick starts one; its own
sizes and processes cost over a hundred CPU-seconds, nearly all of it the same code at
larger sizes and the imports of the SDKs and harbor)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # runs the quick benchmark suite in subprocesses

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.harbor
def test_bench_quick_writes_results_table_and_plots(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["engine"]) == {"baseline", "thread", "guest", "trio-asyncio"}
    for impl, engine in results["engine"].items():
        assert [s["n"] for s in engine["start"]] == [4, 8], impl
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
    check_traffic(results["traffic"])
    job = results["harbor_job"]
    for agent in ("baseline", "wmo_trio", "wmo_trio_trio_host"):
        assert job[agent]["trials"] == job["n"] and job[agent]["mean_reward"] == 1.0, agent
    assert results["local_environment"]
    sandboxed = results["sandbox_backend"]["details"]
    assert sandboxed["burst"]["local"]["submitted"] == sandboxed["burst"]["sandbox"]["submitted"] \
        == sandboxed["burst"]["n"]
    assert all(sandboxed["start"][name]["start"]["median_ms"] > 0
               for name in ("local", "sandbox_pool", "sandbox_cold"))
    check_scale_out(results["scale_out"])
    table = (tmp_path / "results.md").read_text()
    assert "| scenario | baseline (asyncio) |" in table and "cancel p99" in table
    assert "Real harbor job" in table and "process CPU time / ideal wall time" in table
    assert "| real traffic | baseline (original design) |" in table
    cores = max(2, os.cpu_count() or 1)
    assert f"CPU per step / SDK's own per call (sync client) @ {cores} (anthropic)" in table
    assert "CPU per step / SDK's own per call (AsyncOpenAI on trio) @ 1 (openai)" in table
    assert "Beyond one process" in table and f"| wmo_trio thread | {cores} x 1 |" in table
    assert "No figures for" not in table
    assert "| added start latency, median | - |" in table
    assert "| research API, 2 worker processes (Ray) |" in table
    assert "| `wmo-trio run`, 2 workers |" in table
    for plot in ("start_latency.png", "cancel_latency.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("arguments", [["--smoke"], ["--quick", "--smoke", "--docs"]])
def test_a_smoke_run_is_only_a_smaller_quick_run(arguments: list[str], tmp_path: Path) -> None:
    # refused before anything runs: a smoke run's figures must never reach the docs
    completed = subprocess.run([sys.executable, "-m", "benchmarks", *arguments, "--out", str(tmp_path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and "--smoke is a smaller --quick run" in completed.stderr
    assert list(tmp_path.iterdir()) == []


def check_scale_out(scale_out: dict[str, Any]) -> None:
    """Each layout of the scale-out ran every episode to its submit through the real SDK
    (the workers' traces all written here), and both harbor jobs ran every trial."""
    runs = {run["impl"]: run for run in scale_out["traffic"]}
    assert set(runs) == {"research-workers", "research", "sdk-alone"}
    n = scale_out["episodes"]
    for impl, run in runs.items():
        assert "failed" not in run, (impl, run.get("failed"))
        assert run["submitted"] == n and run["timed_out"] == 0 and run["errors"] == {}, impl
        assert run["steps"] == 5 * n and run["cpu_per_step_ms"] > 0, impl
        assert run["traces"] == (0 if impl == "sdk-alone" else n), impl
        assert run["server"]["requests"] == 5 * n, impl  # the workers' warm-up not counted
    # every process of the workers' layout, each part apart
    roles = runs["research-workers"]["cpu_by_role_s"]
    assert set(roles) == {"driver", "workers", "ray"} and roles["workers"] > 0 < roles["driver"]
    jobs = scale_out["harbor"]
    for layout in ("one process", "2 workers"):
        assert "failed" not in jobs[layout], jobs[layout]
        assert jobs[layout]["trials"] == jobs["trials"] and jobs[layout]["mean_reward"] == 1.0


def check_traffic(traffic: dict[str, Any]) -> None:
    """Every implementation ran every episode of every burst to its submit, through the
    real SDK and the benchmark's server, and every figure the table shows is there."""
    sdk = traffic["sdk"]
    for prefix in ("", "openai_"):
        assert sdk[f"{prefix}sync_cpu_per_call_ms"] > 0 < sdk[f"{prefix}async_trio_cpu_per_call_ms"]
    assert sdk["client_cpu_ms"] > 0
    impls = {"baseline", "thread", "guest", "trio-asyncio", "research", "sdk-alone"}
    cores = max(2, os.cpu_count() or 1)  # the split's processes, one episode each
    expected = {(impl, provider, n) for impl in impls
                for provider, n in (("anthropic", cores), ("openai", 1), ("scripted", 2))
                if (impl, provider) not in (("baseline", "openai"), ("sdk-alone", "scripted"))}
    assert {(r["impl"], r["provider"], r["n"]) for r in traffic["runs"]} == expected
    # Beyond one process: each layout of the same episodes ran them all to their submit.
    split = traffic["split"]
    assert {(entry["impl"], entry["processes"]) for entry in split} == {
        (impl, count) for impl in ("thread", "research") for count in (1, cores)}
    for entry in split:
        assert len(entry["runs"]) == entry["processes"], entry
        assert sum(run["submitted"] for run in entry["runs"]) == entry["episodes"], entry
    # Every model call of the anthropic and openai runs, and of the split's per-core layout's
    # (its single interpreter is those runs), reached the server: 5 per episode.
    episodes = sum(r["n"] for r in traffic["runs"] if r["provider"] != "scripted") + sum(
        run["n"] for entry in split if entry["processes"] > 1 for run in entry["runs"])
    assert traffic["server"]["requests"] == 5 * episodes
    assert traffic["server"]["tool_uses"] == {"bash": 4 * episodes, "submit": episodes}
    for run in traffic["runs"]:
        where = (run["impl"], run["provider"], run["n"])
        assert "failed" not in run, (where, run.get("failed"))
        n = run["n"]
        traces = 0 if run["impl"] == "sdk-alone" else n  # the SDK alone has no agent
        assert run["submitted"] == n and run["traces"] == traces and run["timed_out"] == 0, where
        assert run["errors"] == {}, where
        assert run["steps"] == 5 * n, where  # 4 bash calls and a submit per episode
        assert run["wall_over_ideal"] > 0.9 and run["cpu_per_step_ms"] > 0, where
        assert run["all_started_s"] >= run["model_s"], where  # the first command follows a call
        assert run["peak_threads"] > 1 and run["peak_rss_mb"] > 0, where
        assert run["machine"]["busy_cores"] > 0 <= run["machine"]["others_cores"], where
        loops = {"host_heartbeat": run["impl"] not in ("research", "sdk-alone"),
                 "trio_heartbeat": run["impl"] != "baseline"}
        for which, present in loops.items():
            if not present:
                assert run[which] is None, where
                continue
            beat = run[which]
            assert beat["samples"] > 0, (where, which)
            assert beat["with_start_max_ms"] >= beat["with_start_p99_ms"], (where, which)
            assert beat["max_ms"] >= beat["p99_ms"] and not math.isnan(beat["p99_ms"]), (where, which)


# -- the benchmark's Messages API server (reused by tests that need real model traffic) ------


def test_messages_server_scripts_a_whole_episode_for_the_real_sdk() -> None:
    import anthropic

    from benchmarks.messages_server import serve

    with serve(delay_s=0.05, tool_calls=2) as server:
        client = anthropic.Anthropic(api_key="any", base_url=server.base_url, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "go"}]
        names = []
        for _ in range(4):
            reply = client.messages.create(model="claude-bench", max_tokens=64, messages=messages)
            [block] = reply.content
            assert block.type == "tool_use" and reply.stop_reason == "tool_use"
            names.append(block.name)
            messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                       "content": "ok"}]}]
        client.close()
        stats = server.stats()
    # the turn comes from the request: bash while fewer than tool_calls assistant turns
    assert names == ["bash", "bash", "submit", "submit"]
    assert stats["requests"] == 4 and stats["tool_uses"] == {"bash": 2, "submit": 2}
    assert stats["connections_opened"] == 2  # one kept alive for every call, one for stats


def test_messages_server_scripts_a_whole_episode_for_the_real_openai_sdk() -> None:
    import openai

    from benchmarks.messages_server import serve

    with serve(delay_s=0.05, tool_calls=2) as server:
        client = openai.OpenAI(api_key="any", base_url=server.base_url + "/v1", max_retries=0)
        assert [model.id for model in client.models.list()] == ["claude-bench"]  # what it is run with
        messages: list[Any] = [{"role": "user", "content": "go"}]
        calls = []
        for _ in range(3):
            reply = client.chat.completions.create(model="bench", messages=messages)
            [choice] = reply.choices
            [call] = choice.message.tool_calls or []
            assert choice.finish_reason == "tool_calls" and reply.usage is not None
            calls.append((call.function.name, json.loads(call.function.arguments)))
            messages += [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
        client.close()
        stats = server.stats()
    assert calls == [("bash", {"command": "echo step 1"}), ("bash", {"command": "echo step 2"}),
                     ("submit", {"answer": "done"})]
    assert stats["requests"] == 3 and stats["tool_uses"] == {"bash": 2, "submit": 1}


def test_messages_server_answers_pipelined_requests_in_order_after_the_delay() -> None:
    import socket
    import time

    from benchmarks.messages_server import serve

    def request(turns: int, key: bool = True) -> bytes:
        body = json.dumps({"model": "m", "messages": [{"role": "assistant", "content": "x"}] * turns})
        head = f"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
        return (head + ("x-api-key: k\r\n" if key else "") + "\r\n" + body).encode()

    with serve(delay_s=0.2) as server:
        host, port = server.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as connection:
            started = time.monotonic()
            connection.sendall(request(4) + request(0) + request(0, key=False))
            received = b""
            while received.count(b"HTTP/1.1 ") < 3 or not received.endswith(b"}"):
                chunk = connection.recv(65536)
                assert chunk, received
                received += chunk
            elapsed = time.monotonic() - started
    replies = received.split(b"HTTP/1.1 ")[1:]
    assert [reply[:3] for reply in replies] == [b"200", b"200", b"401"]
    assert b'"name":"submit"' in replies[0] and b'"name":"bash"' in replies[1]
    assert elapsed >= 0.2  # no reply comes before its delay


def test_jobs_side_by_side_each_get_their_own_wall_time(tmp_path: Path) -> None:
    """A quick run starts the real-harbor-job scenario's three jobs together; each row shows
    its own job's time, not the time the last of them took (every row read the same, ratio
    1.00). Here `late` exits only after `early` is gone, and half a second later."""
    from benchmarks.harbor_job import _run_side_by_side

    pid_file = tmp_path / "early.pid"
    early = [sys.executable, "-c", f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))"]
    late = [sys.executable, "-c", (
        "import os, time\n"
        f"while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read():\n"
        "    time.sleep(0.01)\n"
        f"pid = open({str(pid_file)!r}).read()\n"
        "while os.path.exists(f'/proc/{pid}'):\n"
        "    time.sleep(0.01)\n"
        "time.sleep(0.5)\n")]
    walls: dict[str, float] = {}
    _run_side_by_side([("late", late), ("early", early)], dict(os.environ), walls)
    assert 0 < walls["early"] < walls["late"], walls
