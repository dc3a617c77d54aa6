"""Engine scenarios, for one implementation per process.

    python -m benchmarks.engine --impl {baseline,thread,guest,trio-asyncio} [--quick [--smoke]]

prints one JSON object. Every scenario drives real `LocalExecution`s (scripted provider,
set latencies) against a synthetic environment whose commands are asyncio coroutines on the
host loop, from a harbor-shaped asyncio driver: one task per trial, `asyncio.wait_for`
timeouts. The implementations differ only in how an episode is run and how its worker
reaches the loop, so the figures compare exactly that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import outcome

from benchmarks import baseline
from wmo_trio.control import CallControl
from wmo_trio.episode._environment import CommandResult, ShellEnvironment
from wmo_trio.episode._execution import LocalExecution
from wmo_trio.harness import parse_harness
from wmo_trio.models import RunResult, StopReason
from wmo_trio.providers import ProviderConfig
from wmo_trio.providers._scripted import ScriptedProvider, load_script
from wmo_trio.settings import EpisodeSettings
from wmo_trio.trace import CANCELLED_BY_CALLER, TraceIdentity, trace_for, write_trace

IMPLS = ("baseline", "thread", "guest", "trio-asyncio")
DOC = parse_harness({"name": "bench", "surfaces": [
    {"id": "prompt:core", "kind": "prompt", "content": "benchmark"},
    {"id": "param:max-turns", "kind": "param", "content": "100"},
    {"id": "param:max-env-actions", "kind": "param", "content": "100"}]})
SETTINGS = EpisodeSettings(episode_timeout_sec=3600)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# Set usage, so the scripted provider does not estimate it from the whole conversation at
# every turn: that estimate costs as much as the rest of a step and is not what is measured.
USAGE = {"input_tokens": 1000, "output_tokens": 20, "calls": 1}


def script(tool_calls: int, model_latency: float = 0.0) -> ScriptedProvider:
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "bash", "arguments": {"command": "step"}}],
         "latency_s": model_latency, "usage": USAGE} for _ in range(tool_calls)]
    replies.append({"tool_calls": [{"name": "submit", "arguments": {"answer": "ok"}}],
                    "latency_s": 0.0, "usage": USAGE})
    return ScriptedProvider(ProviderConfig(kind="scripted", model="bench"),
                            script=load_script(replies))


async def host_exec(latency: float) -> CommandResult:
    if latency:
        await asyncio.sleep(latency)
    return CommandResult("ok\n", "", 0)


class SyntheticEnvironment(ShellEnvironment):
    """Every command is an asyncio sleep of `latency` seconds on the host loop."""

    def __init__(self, control: CallControl, latency: float) -> None:
        self._control = control
        self._latency = latency

    def run_command(self, command: str) -> CommandResult:
        return self._control.run_host(host_exec, self._latency)

    def write_file_bytes(self, path: str, data: bytes) -> None:
        raise NotImplementedError


class BenchEpisode:
    """One episode of the benchmark, with the marks the scenarios read."""

    def __init__(self, impl: str, provider: ScriptedProvider, exec_latency: float,
                 trace_dir: Path | None, loop: asyncio.AbstractEventLoop) -> None:
        self.impl, self.provider, self.exec_latency = impl, provider, exec_latency
        self.trace_dir, self.loop = trace_dir, loop
        self.cancel = threading.Event()
        self.runtime: LocalExecution | None = None
        self.lock = threading.Lock()
        self.submitted = 0.0
        self.worker_started = 0.0

    stop_is_quick = True  # an event and LocalExecution.abort(): flags only

    def run(self, control: CallControl) -> RunResult:
        self.worker_started = time.perf_counter()
        runtime = LocalExecution(DOC, self.provider, SETTINGS, control=control,
                                 should_cancel=self.cancel.is_set)
        with self.lock:
            self.runtime = runtime
        environment = SyntheticEnvironment(control, self.exec_latency)
        return runtime.run("bench", "go", environment)

    def stop(self) -> None:
        self.cancel.set()
        with self.lock:
            if self.runtime is not None:
                self.runtime.abort()

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        if self.trace_dir is not None:
            log = self.runtime.log if self.runtime else None
            write_trace(self.trace_dir, trace_for(
                TraceIdentity(task_id="bench"), result,
                cancelled=CANCELLED_BY_CALLER if cancelled else None, log=log))


def _host(impl: str) -> Any:
    from wmo_trio.engine import LoopServingHost, TrioAsyncioHost

    if impl == "trio-asyncio":
        return TrioAsyncioHost(asyncio.get_running_loop())
    return LoopServingHost.for_loop(asyncio.get_running_loop(), impl)  # type: ignore[arg-type]


def submitter(impl: str) -> Callable[[Any, int], Awaitable[RunResult]]:
    if impl == "baseline":
        return lambda episode, workers: baseline.run_episode(episode, workers=workers)
    host = _host(impl)
    return lambda episode, workers: host.run_episode(episode, workers=workers)


async def prepare(impl: str, workers: int) -> float:
    """The setup step harbor gives an agent before `run()` (`BaseAgent.setup`); its wall
    time in ms. wmo_trio starts its worker threads there. The original agent did nothing
    in setup: its pool creates each thread inside the `run()` that first needs it."""
    started = time.perf_counter()
    if impl != "baseline":
        await _host(impl).prepare(workers)
    return (time.perf_counter() - started) * 1000


class Sampler:
    """Samples thread count and RSS from a thread, and the host loop's heartbeat lateness."""

    def __init__(self) -> None:
        self.peak_threads = threading.active_count()
        self.peak_rss_mb = rss_mb()
        self.lateness_ms: list[float] = []
        self._running = True

    def _sample(self) -> None:
        while self._running:
            self.peak_threads = max(self.peak_threads, threading.active_count())
            self.peak_rss_mb = max(self.peak_rss_mb, rss_mb())
            time.sleep(0.01)

    async def heartbeat(self) -> None:
        while self._running:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lateness_ms.append((time.perf_counter() - before - 0.001) * 1000)

    def __enter__(self) -> Sampler:
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._running = False


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def start_latency(impl: str, n: int, calls: int, latency: float) -> dict[str, Any]:
    """n concurrent episodes of `calls` tool calls of `latency` s each."""
    loop = asyncio.get_running_loop()
    submit = submitter(impl)
    episodes = [BenchEpisode(impl, script(calls), latency, None, loop) for _ in range(n)]

    async def trial(episode: BenchEpisode) -> None:
        episode.submitted = time.perf_counter()
        await asyncio.wait_for(submit(episode, n), 600)

    setup_ms = await prepare(impl, n)
    with Sampler() as sampler:
        beat = asyncio.ensure_future(sampler.heartbeat())
        started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*(trial(e) for e in episodes))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        sampler._running = False
        await beat
    delays = [(e.worker_started - e.submitted) * 1000 for e in episodes]
    # The same, from the instant every trial was started: a runtime that spawns its thread
    # inside run() (the baseline) delays the *next* trial's run() instead, which the
    # per-call figure does not see and this one does.
    from_batch = [(e.worker_started - started) * 1000 for e in episodes]
    ideal = calls * latency
    return {"n": n, "setup_ms": setup_ms,
            "start_p50_ms": percentile(delays, 50), "start_p99_ms": percentile(delays, 99),
            "batch_start_p99_ms": percentile(from_batch, 99),
            "wall_s": wall, "ideal_s": ideal, "wall_over_ideal": wall / ideal,
            # CPU the process used (all threads) over the ideal wall time: near or above 1,
            # the work itself, not waiting, sets the wall time on a GIL-bound interpreter.
            "cpu_s": cpu, "cpu_over_ideal": cpu / ideal,
            "heartbeat_p99_ms": percentile(sampler.lateness_ms, 99),
            "peak_threads": sampler.peak_threads, "peak_rss_mb": sampler.peak_rss_mb}


async def overhead(impl: str, episodes: int) -> dict[str, Any]:
    """Sequential tiny episodes: one model call that submits, nothing else."""
    loop = asyncio.get_running_loop()
    submit = submitter(impl)
    provider = script(0)
    started = time.perf_counter()
    for _ in range(episodes):
        await submit(BenchEpisode(impl, provider, 0.0, None, loop), 64)
    wall = time.perf_counter() - started
    return {"episodes": episodes, "per_episode_us": wall / episodes * 1e6}


class RoundTrips(BenchEpisode):
    """An episode whose worker makes `count` no-op calls into the host loop."""

    def __init__(self, impl: str, loop: asyncio.AbstractEventLoop, count: int) -> None:
        super().__init__(impl, script(0), 0.0, None, loop)
        self.count = count
        self.per_call_us = 0.0

    def run(self, control: CallControl) -> RunResult:
        started = time.perf_counter()
        for _ in range(self.count):
            control.run_host(host_exec, 0.0)
        self.per_call_us = (time.perf_counter() - started) / self.count * 1e6
        return super().run(control)


async def round_trip(impl: str, count: int) -> dict[str, Any]:
    episode = RoundTrips(impl, asyncio.get_running_loop(), count)
    await submitter(impl)(episode, 4)
    return {"calls": count, "per_call_us": episode.per_call_us,
            "bare_loop_per_call_us": await bare_round_trip(count)}


async def bare_round_trip(count: int) -> float:
    """The same round trip with no episode and no wmo_trio: a plain thread blocking on
    `asyncio.run_coroutine_threadsafe` into the running loop. Under trio-asyncio this is
    the bridge's own cost, the floor for any design that keeps harbor's loop inside trio."""
    loop = asyncio.get_running_loop()
    per_call: list[float] = []
    done = asyncio.Event()

    def worker() -> None:
        started = time.perf_counter()
        for _ in range(count):
            asyncio.run_coroutine_threadsafe(host_exec(0.0), loop).result()
        per_call.append((time.perf_counter() - started) / count * 1e6)
        loop.call_soon_threadsafe(done.set)

    thread = threading.Thread(target=worker, name="bare-round-trip")
    thread.start()
    await done.wait()
    thread.join()
    return per_call[0]


async def cancellation(impl: str, n: int, long_s: float, during: str,
                       trial_timeout: float) -> dict[str, Any]:
    """n episodes timed out while a long command or model call is in flight."""
    loop = asyncio.get_running_loop()
    submit = submitter(impl)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for i in range(n):  # harbor creates each trial's logs directory before the agent runs
            (root / str(i)).mkdir()
        episodes = [
            BenchEpisode(impl, script(1, long_s if during == "model" else 0.0),
                         long_s if during == "command" else 0.0, root / str(i), loop)
            for i in range(n)]

        async def trial(episode: BenchEpisode) -> float:
            deadline = time.perf_counter() + trial_timeout
            try:
                await asyncio.wait_for(submit(episode, n), trial_timeout)
            except TimeoutError:
                return (time.perf_counter() - deadline) * 1000
            return float("nan")

        delays = await asyncio.gather(*(trial(e) for e in episodes))
        traces = sum(1 for i in range(n) if (root / str(i) / "wmo-run.json").is_file())
    timed_out = [d for d in delays if d == d]
    return {"n": n, "during": during, "in_flight_s": long_s, "timed_out": len(timed_out),
            "cancel_p50_ms": percentile(timed_out, 50), "cancel_p99_ms": percentile(timed_out, 99),
            "traces": traces}


class BridgeOnly:
    """An episode that only waits to be stopped and records nothing: its cancellation
    costs exactly the bridge's own work (host, engine, threads), none of an episode's."""

    stop_is_quick = True

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def run(self, control: CallControl) -> RunResult:
        self.stopped.wait()
        return RunResult(task_id="bridge", steps=[], stop_reason=StopReason.CANCELLED, turns=0)

    def stop(self) -> None:
        self.stopped.set()

    def close(self) -> None:
        pass

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        pass


async def cancel_bridge_only(impl: str, n: int, trial_timeout: float) -> dict[str, Any]:
    """n episodes with nothing in flight and no trace, timed out at once."""
    submit = submitter(impl)

    async def trial() -> float:
        deadline = time.perf_counter() + trial_timeout
        try:
            await asyncio.wait_for(submit(BridgeOnly(), n), trial_timeout)
        except TimeoutError:
            return (time.perf_counter() - deadline) * 1000
        return float("nan")

    delays = [d for d in await asyncio.gather(*(trial() for _ in range(n))) if d == d]
    return {"n": n, "timed_out": len(delays), "cancel_p50_ms": percentile(delays, 50),
            "cancel_p99_ms": percentile(delays, 99)}


async def scenarios(impl: str, quick: bool, smoke: bool = False) -> dict[str, Any]:
    """Every scenario; `smoke` (with `quick`) runs each at the smallest sizes."""
    sizes = [4, 8] if smoke else [16, 64] if quick else [64, 256, 1024]
    calls = 50 if smoke else 500 if quick else 5000
    cancelled = 4 if smoke else 32 if quick else 256
    results: dict[str, Any] = {"impl": impl, "start": []}
    for n in sizes:
        results["start"].append(await start_latency(impl, n, 10, 0.05))
    results["overhead"] = await overhead(impl, calls)
    results["round_trip"] = await round_trip(impl, calls)
    long_s = 2.0 if quick else 30.0
    results["cancel"] = [await cancellation(impl, cancelled, long_s, during, 0.5)
                         for during in ("command", "model")]
    # The pool the baseline stops episodes with must have room beside the running ones:
    # it is sized by the largest start scenario, which ran first.
    results["cancel_bridge_only"] = await cancel_bridge_only(impl, cancelled, 0.5)
    # the same at every size, for the cancellation plot
    results["cancel_by_n"] = [await cancellation(impl, n, long_s, during, 0.5)
                              for n in sizes for during in ("command", "model")]
    return results


def threads_after_idle(before: int, idle_s: float) -> int:
    time.sleep(idle_s)
    return threading.active_count() - before


def measure(impl: str, quick: bool, smoke: bool = False) -> dict[str, Any]:
    """Every scenario for `impl`, in this process (one implementation a process)."""
    before = threading.active_count()
    if impl == "trio-asyncio":
        from wmo_trio.engine import run

        results: dict[str, Any] = run(scenarios, impl, quick, smoke)
    else:
        results = asyncio.run(scenarios(impl, quick, smoke))
    if impl == "baseline":
        # The original never shut its executor down; its threads stay until exit.
        results["threads_left_after_idle"] = threads_after_idle(before, 11.0)
        baseline.shutdown_executor()
    else:
        # trio's worker threads exit after 10 s idle; the engine thread with its loop.
        results["threads_left_after_idle"] = threads_after_idle(before, 11.0)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="with --quick: the smallest sizes")
    args = parser.parse_args()
    json.dump(measure(args.impl, args.quick, args.smoke), sys.stdout)


if __name__ == "__main__":
    main()
