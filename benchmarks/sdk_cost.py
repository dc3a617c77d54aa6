"""What the model SDKs themselves cost here: the floor for any design's model I/O.

    python -m benchmarks.sdk_cost --base-url URL [--calls N]

prints one JSON object. For the `anthropic` SDK: the CPU time of importing it and of
constructing a client (the first, which finishes the SDK's lazy imports, and then each),
and the process CPU per call of a bare sequential loop of calls (after a warm-up), with
the synchronous client in this thread and with `AsyncAnthropic` under `trio.run`. For the
`openai` SDK (keys prefixed `openai_`): the same loops, `OpenAI` and `AsyncOpenAI`, against
the same server's Chat Completions endpoint. The calls are the benchmark episode's own
request, sent to the benchmark's messages server with no delay (`x-bench-delay-ms: 0`), so
nothing but the SDK, its HTTP stack and the loopback socket is measured. Runs in a process
of its own, one loop after the other.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.traffic_baseline import SYSTEM_PROMPT, TOOLS, request_body

MODEL = "claude-bench"
NO_DELAY = {"x-bench-delay-ms": "0"}
WARM_UP = 20
CLIENTS = 10  # constructed one after the other, for a client's own cost


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


def chat_body() -> dict[str, Any]:
    """The same conversation and tools as a Chat Completions request."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": "Do the task."}]
    for turn in (1, 2):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{turn}", "type": "function", "function": {
                "name": "bash", "arguments": json.dumps({"command": f"echo step {turn}"})}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"step {turn}\n"})
    tools = [{"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                               "parameters": tool["input_schema"]}} for tool in TOOLS]
    return {"model": MODEL, "max_tokens": 4096, "tools": tools, "messages": messages}


def warm_up(calls: int) -> int:
    """Calls before a loop is timed: fewer only in a run of fewer calls (a smoke run)."""
    return min(WARM_UP, calls)


def timed(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """(CPU, wall) seconds of `calls` sequential calls, after a warm-up."""
    for _ in range(warm_up(calls)):
        call()
    before, wall = cpu_s(), time.perf_counter()
    for _ in range(calls):
        call()
    return cpu_s() - before, time.perf_counter() - wall


async def timed_async(call: Callable[[], Awaitable[object]], calls: int) -> tuple[float, float]:
    for _ in range(warm_up(calls)):
        await call()
    before, wall = cpu_s(), time.perf_counter()
    for _ in range(calls):
        await call()
    return cpu_s() - before, time.perf_counter() - wall


def per_call(prefix: str, sync: tuple[float, float], async_trio: tuple[float, float],
             calls: int) -> dict[str, float]:
    return {f"{prefix}sync_cpu_per_call_ms": sync[0] / calls * 1000,
            f"{prefix}sync_wall_per_call_ms": sync[1] / calls * 1000,
            f"{prefix}async_trio_cpu_per_call_ms": async_trio[0] / calls * 1000,
            f"{prefix}async_trio_wall_per_call_ms": async_trio[1] / calls * 1000}


def measure_anthropic(base_url: str, calls: int) -> dict[str, Any]:
    before = cpu_s()
    import anthropic

    import_ms = (cpu_s() - before) * 1000
    before = cpu_s()
    client = anthropic.Anthropic(api_key="bench", base_url=base_url, max_retries=0)
    first_client_ms = (cpu_s() - before) * 1000  # finishes the SDK's lazy imports
    clients = min(CLIENTS, calls)
    before = cpu_s()
    for _ in range(clients):
        anthropic.Anthropic(api_key="bench", base_url=base_url, max_retries=0).close()
    client_ms = (cpu_s() - before) * 1000 / clients
    body = request_body(MODEL, conversation())
    with client:
        sync = timed(lambda: client.messages.create(**body, extra_headers=NO_DELAY), calls)

    import trio

    async def async_loop() -> tuple[float, float]:
        async with anthropic.AsyncAnthropic(api_key="bench", base_url=base_url,
                                            max_retries=0) as aclient:
            return await timed_async(
                lambda: aclient.messages.create(**body, extra_headers=NO_DELAY), calls)

    return {"calls": calls, "import_cpu_ms": import_ms, "first_client_cpu_ms": first_client_ms,
            "client_cpu_ms": client_ms, **per_call("", sync, trio.run(async_loop), calls)}


def measure_openai(base_url: str, calls: int) -> dict[str, Any]:
    import openai
    import trio

    body = chat_body()
    root = base_url + "/v1"
    with openai.OpenAI(api_key="bench", base_url=root, max_retries=0) as client:
        sync = timed(lambda: client.chat.completions.create(**body, extra_headers=NO_DELAY), calls)

    async def async_loop() -> tuple[float, float]:
        async with openai.AsyncOpenAI(api_key="bench", base_url=root, max_retries=0) as aclient:
            return await timed_async(
                lambda: aclient.chat.completions.create(**body, extra_headers=NO_DELAY), calls)

    return per_call("openai_", sync, trio.run(async_loop), calls)


def measure(base_url: str, calls: int) -> dict[str, Any]:
    return {**measure_anthropic(base_url, calls), **measure_openai(base_url, calls)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sdk_cost")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    json.dump(measure(args.base_url, args.calls), sys.stdout)


if __name__ == "__main__":
    main()
