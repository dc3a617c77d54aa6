"""What the `anthropic` SDK itself costs here: the floor for any design's model I/O.

    python -m benchmarks.sdk_cost --base-url URL [--calls N]

prints one JSON object: the CPU time of importing the SDK and of constructing a client (the
first, which finishes the SDK's lazy imports, and then each),
and the process CPU per call of a bare sequential loop of calls (after a warm-up), with
the synchronous client in this thread and with `AsyncAnthropic` under `trio.run`. The
calls are the benchmark episode's own request, sent to the benchmark's messages server
with no delay (`x-bench-delay-ms: 0`), so nothing but the SDK, its HTTP stack and the
loopback socket is measured. Runs in a process of its own, one loop after the other.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from benchmarks.traffic_baseline import request_body

MODEL = "claude-bench"
NO_DELAY = {"x-bench-delay-ms": "0"}
WARM_UP = 20


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def conversation() -> list[dict[str, Any]]:
    """A mid-episode conversation: the task, then two bash calls with their results."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Do the task."}]
    for turn in (1, 2):
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{turn}", "name": "bash",
             "input": {"command": f"echo step {turn}"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"step {turn}\n",
             "is_error": False}]})
    return messages


def measure(base_url: str, calls: int) -> dict[str, Any]:
    before = cpu_s()
    import anthropic

    import_ms = (cpu_s() - before) * 1000
    before = cpu_s()
    client = anthropic.Anthropic(api_key="bench", base_url=base_url, max_retries=0)
    first_client_ms = (cpu_s() - before) * 1000  # finishes the SDK's lazy imports
    before = cpu_s()
    for _ in range(10):
        anthropic.Anthropic(api_key="bench", base_url=base_url, max_retries=0).close()
    client_ms = (cpu_s() - before) * 1000 / 10
    body = request_body(MODEL, conversation())
    for _ in range(WARM_UP):
        client.messages.create(**body, extra_headers=NO_DELAY)
    before, wall = cpu_s(), time.perf_counter()
    for _ in range(calls):
        client.messages.create(**body, extra_headers=NO_DELAY)
    sync_cpu, sync_wall = cpu_s() - before, time.perf_counter() - wall
    client.close()

    import trio

    async def async_loop() -> tuple[float, float]:
        async with anthropic.AsyncAnthropic(api_key="bench", base_url=base_url,
                                            max_retries=0) as aclient:
            for _ in range(WARM_UP):
                await aclient.messages.create(**body, extra_headers=NO_DELAY)
            start, start_wall = cpu_s(), time.perf_counter()
            for _ in range(calls):
                await aclient.messages.create(**body, extra_headers=NO_DELAY)
            return cpu_s() - start, time.perf_counter() - start_wall

    async_cpu, async_wall = trio.run(async_loop)
    return {
        "calls": calls,
        "import_cpu_ms": import_ms,
        "first_client_cpu_ms": first_client_ms,
        "client_cpu_ms": client_ms,
        "sync_cpu_per_call_ms": sync_cpu / calls * 1000,
        "sync_wall_per_call_ms": sync_wall / calls * 1000,
        "async_trio_cpu_per_call_ms": async_cpu / calls * 1000,
        "async_trio_wall_per_call_ms": async_wall / calls * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sdk_cost")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    json.dump(measure(args.base_url, args.calls), sys.stdout)


if __name__ == "__main__":
    main()
