"""Real model traffic: many episodes at once, the real SDK, seconds per model call.

    python -m benchmarks.traffic suite [--quick] [--sizes N ...] [--impls I ...]
    python -m benchmarks.traffic run --impl I --burst PROVIDER:N --base-url URL ...

Every episode is the same: 4 `bash` calls then `submit`, each model call answered after
2 s by the benchmark's own Messages API server (`benchmarks/messages_server.py`, its own
process), each command a 0.5 s sleep on the environment's loop: 12 s ideal. The `suite`
starts the server, measures the SDK's own cost (`benchmarks/sdk_cost.py`), then runs
every implementation at every size, each in an interpreter of its own, one after the
other (side by side in a quick run, which checks shape only):

- `baseline`: a harbor agent of the original's design (`benchmarks/traffic_baseline.py`):
  a thread pool sized to the concurrency, the synchronous SDK called in the episode's
  thread;
- `thread`, `guest`, `trio-asyncio`: wmo_trio's harbor agent;

the harbor agents driven the way harbor's trial drives one (construct, `setup`,
`asyncio.wait_for(agent.run(...))`) from `asyncio.run` (thread and guest hosts, the
baseline) or from `trio.run` + `trio_asyncio.open_loop()`;
- `research`: `wmo_trio.open_episode_pool` + `fan_out` under `trio.run`, with a trio
  environment;
- `sdk-alone`: no agent, no wmo_trio, no harbor: the same episodes as one trio program
  would write them with the SDK's async client (a task per episode, `trio.sleep` for a
  command, one client per 16 episodes as the engine shares them), so the floor of any
  design in one process at this traffic, measured in the same run (no traces, no
  worker threads; `anthropic` and `openai` only).

The same scenario runs with the `openai` provider (the real `openai` SDK against the same
server's Chat Completions endpoint; the original design has no such agent, so no baseline)
and with the scripted provider at the same latencies (no network); `--providers` picks.
wmo_trio is driven only through its public entry points (the harbor agent class, the
research API), so the scenario measures the code of any later design unchanged.

The burst is everything from launching the trials to the last one finishing: agent
construction and setup (harbor does both inside each trial) included. One agent is
constructed before it, which does the one-off imports (the SDK; litellm, through harbor's
`BaseAgent`), as in a process that has run a trial already. Figures per run: wall
time over the ideal, process CPU per step (a model call with its tool call), heartbeat
lateness of the host asyncio loop and of the trio loop (a task sleeping 5 ms in a loop),
counted from the moment every episode has run its first command and, separately, from
the launch; peak OS threads, peak RSS, traces written; and how much CPU the rest of the
machine used meanwhile (it is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
import warnings
from collections.abc import Awaitable, Callable, Collection, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.forked import Forked

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("baseline", "thread", "guest", "trio-asyncio", "research", "sdk-alone")
# Beyond one process (benchmarks/scale_out.py): the research API on WORKERS Ray worker
# processes of an embedded local Ray; run only when asked for, never in the suite's table.
SCALE_OUT_IMPLS = ("research-workers",)
WORKERS = 2
PROVIDERS = ("anthropic", "openai", "scripted")
SDK_PROVIDERS = ("anthropic", "openai")  # each its SDK, of the same name
API_KEY_ENV = "WMO_BENCH_ANTHROPIC_KEY"
OPENAI_KEY_ENV = "WMO_BENCH_OPENAI_KEY"
MODEL = "claude-bench"
INSTRUCTION = "Run the four steps of the task with bash, one call each, then submit."
HARNESS: dict[str, Any] = {"name": "traffic", "surfaces": [
    {"id": "prompt:core", "kind": "prompt",
     "content": "You are an agent working in a Linux task environment. Use the tools to do the "
                "task, then call submit with your answer."}]}
HEARTBEAT_S = 0.005
COMMAND_TIMEOUT_SEC = 240


@dataclass(frozen=True)
class Profile:
    """The episode's latencies: `tool_calls` bash calls, then submit."""

    model_s: float
    command_s: float
    tool_calls: int = 4

    @property
    def model_calls(self) -> int:
        return self.tool_calls + 1

    @property
    def ideal_s(self) -> float:
        return self.model_calls * self.model_s + self.tool_calls * self.command_s


FULL = Profile(model_s=2.0, command_s=0.5)
QUICK = Profile(model_s=0.2, command_s=0.05)
FULL_SIZES = {"anthropic": [256, 1024, 4096], "openai": [1024], "scripted": [1024, 4096]}
QUICK_SIZES = {"anthropic": [8, 32], "openai": [8], "scripted": [32]}


def smoke_sizes() -> dict[str, list[int]]:
    """A smoke run (`python -m benchmarks --quick --smoke`): every implementation, provider
    and layout once, at the fewest episodes that still give every figure (the test suite's
    check of the outputs, where figures mean nothing). Its `anthropic` runs are the split's
    single-interpreter layout too: one episode for each interpreter of the other."""
    return {"anthropic": [split_processes()], "openai": [1], "scripted": [2]}


def runs_provider(impl: str, provider: str) -> bool:
    """The original design's agent speaks only the Messages API: no `openai` baseline; the
    SDK alone has no scripted provider."""
    return not ((impl == "baseline" and provider == "openai")
                or (impl == "sdk-alone" and provider == "scripted"))


def writes_traces(impl: str) -> bool:
    return impl != "sdk-alone"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cpu_times() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def proc_status(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise LookupError(field_name)


# -- what is measured ---------------------------------------------------------------------


class Heartbeat:
    """How late one loop wakes a task that sleeps `HEARTBEAT_S` again and again."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (went to sleep at, lateness in ms)
        self.running = True

    async def asyncio_task(self) -> None:
        while self.running:
            before = time.perf_counter()
            await asyncio.sleep(HEARTBEAT_S)
            self.samples.append((before, (time.perf_counter() - before - HEARTBEAT_S) * 1000))

    async def trio_task(self) -> None:
        import trio

        while self.running:
            before = time.perf_counter()
            await trio.sleep(HEARTBEAT_S)
            self.samples.append((before, (time.perf_counter() - before - HEARTBEAT_S) * 1000))

    def figures(self, launched: float, all_started: float | None, ended: float) -> dict[str, float]:
        burst = [late for at, late in self.samples if launched <= at <= ended]
        after = [late for at, late in self.samples
                 if all_started is not None and all_started <= at <= ended]
        return {"p99_ms": percentile(after, 99), "max_ms": max(after, default=float("nan")),
                "with_start_p99_ms": percentile(burst, 99),
                "with_start_max_ms": max(burst, default=float("nan")), "samples": len(burst)}


_ENGINE_BEAT: list[Heartbeat] = []  # the heartbeat for trio runs the engine starts
_watching_trio_runs = False


def heartbeat_in_engine_trio_runs(beat: Heartbeat) -> None:
    """Run `beat` in each trio run this process starts from now on (the engine starts its
    own, in a thread or as a guest of harbor's loop, out of our reach). Instrumentation
    only: the run's entry function is wrapped, nothing else changes."""
    global _watching_trio_runs
    _ENGINE_BEAT[:] = [beat]
    if _watching_trio_runs:
        return
    _watching_trio_runs = True
    import trio

    real_run, real_guest_run = trio.run, trio.lowlevel.start_guest_run

    def with_beat(afn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def entry(*args: Any) -> Any:
            trio.lowlevel.spawn_system_task(_ENGINE_BEAT[0].trio_task, name="bench-heartbeat")
            return await afn(*args)

        return entry

    def run(afn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        return real_run(with_beat(afn), *args, **kwargs)

    def start_guest_run(afn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        return real_guest_run(with_beat(afn), *args, **kwargs)

    trio.run = run  # type: ignore[assignment]
    trio.lowlevel.start_guest_run = start_guest_run  # type: ignore[assignment]


class ThreadSampler:
    """Peak OS threads of this process, sampled every 20 ms from a thread of its own."""

    def __init__(self) -> None:
        self.peak = proc_status("Threads")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-thread-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, proc_status("Threads"))

    @contextmanager
    def sampling(self) -> Iterator[None]:
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()


class Progress:
    """Commands as the environments see them, and when every episode had run its first:
    the moment the burst has started (each episode past its first model call)."""

    def __init__(self, episodes: int) -> None:
        self.episodes = episodes
        self.commands = 0
        self.started = 0
        self.all_started_at: float | None = None

    def command(self, environment: Any) -> None:  # on the loop that runs the command
        self.commands += 1
        if not environment.bench_started:
            environment.bench_started = True
            self.started += 1
            if self.started == self.episodes:
                self.all_started_at = time.perf_counter()


@dataclass
class Tally:
    submitted: int = 0
    timed_out: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    construct_s: float = 0.0  # agent constructors, on the loop (harbor builds one per trial)


class Window:
    """The burst: launch to the last trial's end, wall and process CPU."""

    def __init__(self) -> None:
        self.launched = self.ended = 0.0
        self.cpu = (0.0, 0.0)

    def open(self) -> None:
        try:  # restart the kernel's peak-RSS mark (VmHWM), so the peak is this burst's
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass
        self.cpu = cpu_times()
        self.launched = time.perf_counter()

    def close(self) -> None:
        self.ended = time.perf_counter()
        user, system = cpu_times()
        self.cpu = (user - self.cpu[0], system - self.cpu[1])


# -- environments ---------------------------------------------------------------------------


def harbor_environment_class() -> type[Any]:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    class SleepingEnvironment(BaseEnvironment):  # type: ignore[misc]
        """harbor's task environment as a test double: each command sleeps on harbor's
        loop and succeeds. Nothing else is called by the agents under test."""

        def __init__(self, trial_dir: Path, progress: Progress, command_s: float) -> None:
            super().__init__(environment_dir=trial_dir, environment_name="bench",
                             session_id=f"{trial_dir.name}__env",
                             trial_paths=TrialPaths(trial_dir=trial_dir),
                             task_env_config=EnvironmentConfig())
            self.bench_started = False
            self._progress = progress
            self._command_s = command_s

        @staticmethod
        def type() -> str:
            return "wmo-bench-sleeping"

        def _validate_definition(self) -> None:
            pass

        async def start(self, force_build: bool) -> None:
            pass

        async def stop(self, delete: bool) -> None:
            pass

        async def upload_file(self, source_path: Path | str, target_path: str) -> None:
            raise NotImplementedError("the benchmark's environment only runs commands")

        async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
            raise NotImplementedError("the benchmark's environment only runs commands")

        async def download_file(self, source_path: str, target_path: Path | str) -> None:
            raise NotImplementedError("the benchmark's environment only runs commands")

        async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
            raise NotImplementedError("the benchmark's environment only runs commands")

        async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                       timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
            self._progress.command(self)
            await asyncio.sleep(self._command_s)
            return ExecResult(stdout=f"ran {command}\n", stderr="", return_code=0)

    return SleepingEnvironment


class SleepingTrioEnvironment:
    """A trio environment (`wmo_trio.TrioEnvironment`) whose commands sleep and succeed."""

    def __init__(self, progress: Progress, command_s: float) -> None:
        self.bench_started = False
        self._progress = progress
        self._command_s = command_s

    async def exec(self, command: str) -> Any:
        import trio

        # The type `TrioEnvironment.exec` returns; not re-exported by `wmo_trio` today.
        from wmo_trio.episode._environment import CommandResult

        self._progress.command(self)
        await trio.sleep(self._command_s)
        return CommandResult(f"ran {command}\n", "", 0)

    async def write_file(self, path: str, data: bytes) -> None:
        raise NotImplementedError("the benchmark's environment only runs commands")


class SendableSleepingEnvironment:
    """`SleepingTrioEnvironment` for worker processes: sent to them as data (pickled), so it
    counts nothing here; the steps are counted from the episodes' results."""

    def __init__(self, command_s: float) -> None:
        self._command_s = command_s

    async def exec(self, command: str) -> Any:
        import trio

        from wmo_trio.episode._environment import CommandResult

        await trio.sleep(self._command_s)
        return CommandResult(f"ran {command}\n", "", 0)

    async def write_file(self, path: str, data: bytes) -> None:
        raise NotImplementedError("the benchmark's environment only runs commands")


def tree_cpu_s(pid: int, workers: Collection[int] = ()) -> dict[str, float]:
    """CPU time (user and system) of `pid` and every process below it, as the kernel counts
    it now, by role: `driver` (`pid` itself), `workers` (the pids in `workers`: a pool's
    worker processes) and `ray` (every other process below it: the Ray daemons the driver
    started, GCS, raylet and their helpers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = {"driver": 0.0, "workers": 0.0, "ray": 0.0}
    pending, seen = [pid], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            role = "driver" if current == pid else "workers" if current in workers else "ray"
            total[role] += (int(fields[11]) + int(fields[12])) / ticks
            for listing in Path(f"/proc/{current}/task").glob("*/children"):
                pending.extend(int(child) for child in listing.read_text().split())
        except (OSError, IndexError, ValueError):
            continue
    return total


# -- drivers ------------------------------------------------------------------------------


@dataclass
class Burst:
    """One implementation at one size: what its driver needs."""

    impl: str
    provider: str
    n: int
    profile: Profile
    base_url: str
    cap_s: float
    root: Path
    progress: Progress
    tally: Tally = field(default_factory=Tally)
    # as harbor's job with `--skip-model-parsing-and-provider-mapping` constructs the agent:
    # no litellm lookup of the model name (a smoke run, where litellm's import is waste)
    skip_model_parsing: bool = False
    window: Window = field(default_factory=Window)
    sampler: ThreadSampler = field(default_factory=ThreadSampler)
    tree_cpu_s: dict[str, float] | None = None  # by role (`tree_cpu_s`), for a layout of processes

    def trial_dir(self, index: int) -> Path:
        return self.root / f"trial-{index}"

    def provider_config(self) -> dict[str, Any]:
        if self.provider == "anthropic":
            return {"kind": "anthropic", "model": MODEL, "base_url": self.base_url,
                    "api_key_env": API_KEY_ENV}
        if self.provider == "openai":
            return {"kind": "openai", "model": MODEL, "base_url": self.base_url + "/v1",
                    "api_key_env": OPENAI_KEY_ENV}
        # Set usage, so the scripted provider does not estimate it from the conversation at
        # every call: the real provider reads it from the reply, as this one then does.
        usage = {"input_tokens": 1000, "output_tokens": 20, "calls": 1}
        script = [{"tool_calls": [{"name": "bash", "arguments": {"command": f"echo step {k}"}}],
                   "latency_s": self.profile.model_s, "usage": usage}
                  for k in range(1, self.profile.tool_calls + 1)]
        script.append({"tool_calls": [{"name": "submit", "arguments": {"answer": "done"}}],
                       "latency_s": self.profile.model_s, "usage": usage})
        return {"kind": "scripted", "model": "offline", "script": script}

    def model_name(self) -> str:
        config = self.provider_config()
        return f"{config['kind']}/{config['model']}"

    @property
    def episode_timeout_sec(self) -> float:
        return self.cap_s + 60  # the cap ends a run, never an episode's own budget


def new_agent(burst: Burst, logs_dir: Path) -> Any:
    """The implementation's harbor agent, constructed as harbor's `Trial` constructs it
    (keyword arguments from the job's agent config)."""
    if burst.impl == "baseline":
        from benchmarks.traffic_baseline import OriginalDesignAgent

        return OriginalDesignAgent(logs_dir=logs_dir, model_name=burst.model_name(),
                                   provider_config=burst.provider_config(), episode_workers=burst.n,
                                   command_timeout_sec=COMMAND_TIMEOUT_SEC,
                                   skip_model_parsing=burst.skip_model_parsing)
    from wmo_trio.harbor import WmoTrioHarborAgent

    return WmoTrioHarborAgent(
        logs_dir=logs_dir, model_name=burst.model_name(), harness=HARNESS,
        provider_config=burst.provider_config(), episode_workers=burst.n,
        episode_timeout_sec=burst.episode_timeout_sec, command_timeout_sec=COMMAND_TIMEOUT_SEC,
        skip_model_parsing=burst.skip_model_parsing)


async def harbor_trials(burst: Burst, environments: list[Any]) -> None:
    """Every trial at once, each the way harbor's `Trial` drives its agent: construct it,
    `setup`, then `asyncio.wait_for(agent.run(...), timeout)`. The cap is each trial's agent
    timeout, counted from its `run()` as harbor counts it (a budget shared by all trials
    would reach zero for late ones, and a zero timeout cancels `run()` before its first line:
    no episode, no trace, which harbor never does)."""
    from harbor.models.agent.context import AgentContext

    tally = burst.tally

    async def trial(index: int) -> None:
        environment = environments[index]
        constructing = time.perf_counter()
        agent = new_agent(burst, burst.trial_dir(index) / "agent")
        tally.construct_s += time.perf_counter() - constructing
        agent.session_id, agent.context_id = f"trial-{index}__agent", uuid.uuid4()
        context = AgentContext()
        try:
            await agent.setup(environment)
            await asyncio.wait_for(agent.run(INSTRUCTION, environment, context), burst.cap_s)
        except TimeoutError:
            tally.timed_out += 1
            return
        except Exception as error:
            tally.errors[type(error).__name__] += 1
            return
        reason = (context.metadata or {}).get("stop_reason")
        if reason == "submitted":
            tally.submitted += 1
        else:
            tally.errors[str(reason)] += 1

    await asyncio.gather(*(trial(index) for index in range(burst.n)))


async def research_trials(burst: Burst, doc: Any, environments: list[Any], pool: Any = None) -> None:
    """The research API: one pool (opened here, or `pool`, open already), one fan-out of
    every episode, from trio. With `pool`, the steps are counted from the results (the
    environments counted nothing in this process)."""
    import contextlib

    import outcome
    import trio

    import wmo_trio

    config = burst.provider_config()
    specs = [wmo_trio.EpisodeSpec(doc, config, INSTRUCTION, environments[index],
                                  task_id=f"trial-{index}", episode_timeout=burst.episode_timeout_sec,
                                  trace_path=burst.trial_dir(index) / "agent" / "wmo-run.json")
             for index in range(burst.n)]
    tally = burst.tally
    finished = 0
    opened = contextlib.nullcontext(pool) if pool is not None else wmo_trio.open_episode_pool(limit=burst.n)
    with trio.move_on_after(burst.cap_s) as cap:
        async with opened as running, running.fan_out(specs) as results:
            async for _, result in results:
                finished += 1
                if isinstance(result, outcome.Error):
                    tally.errors[type(result.error).__name__] += 1
                    continue
                if pool is not None:  # each tool step after a model call: bash calls, then submit
                    burst.progress.commands += result.value.turns - 1
                if result.value.stop_reason == "submitted":
                    tally.submitted += 1
                else:
                    tally.errors[str(result.value.stop_reason)] += 1
    if cap.cancelled_caught:
        tally.timed_out = burst.n - finished


async def sdk_alone_trials(burst: Burst) -> None:
    """The episodes as a bare trio program over the SDK's async client: the model calls
    and the sleeps of the commands, nothing else (see the module docstring)."""
    import anthropic
    import httpx2
    import openai
    import trio

    from benchmarks.traffic_baseline import SYSTEM_PROMPT, TOOLS

    config = burst.provider_config()
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    per_client = 16  # as the engine shares its clients (CALLS_PER_CLIENT)
    clients: list[Any] = []
    for _ in range(max(1, -(-burst.n // per_client))):
        if burst.provider == "anthropic":
            clients.append(anthropic.AsyncAnthropic(
                api_key=os.environ[API_KEY_ENV], base_url=config["base_url"], max_retries=0,
                http_client=anthropic.DefaultAsyncHttpxClient(limits=limits)))
        else:
            clients.append(openai.AsyncOpenAI(
                api_key=os.environ[OPENAI_KEY_ENV], base_url=config["base_url"], max_retries=0,
                http_client=openai.DefaultAsyncHttpxClient(limits=limits)))
    chat_tools = [{"type": "function", "function": {
        "name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}}
        for tool in TOOLS]
    tally, profile = burst.tally, burst.profile

    class Episode:
        bench_started = False

    async def anthropic_episode(client: Any, episode: Episode) -> bool:
        messages: list[dict[str, Any]] = [{"role": "user", "content": INSTRUCTION}]
        for _ in range(profile.model_calls):
            reply = await client.messages.create(
                model=MODEL, max_tokens=4096, tools=TOOLS, messages=messages,
                system=[{"type": "text", "text": SYSTEM_PROMPT}])
            call = next(block for block in reply.content if block.type == "tool_use")
            if call.name == "submit":
                return True
            burst.progress.command(episode)
            await trio.sleep(profile.command_s)
            messages += [{"role": "assistant", "content": [block.model_dump() for block in reply.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                       "content": f"ran {call.input['command']}\n"}]}]
        return False

    async def openai_episode(client: Any, episode: Episode) -> bool:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": INSTRUCTION}]
        for _ in range(profile.model_calls):
            reply = await client.chat.completions.create(
                model=MODEL, max_tokens=4096, tools=chat_tools, messages=messages)
            message = reply.choices[0].message
            [call] = message.tool_calls
            if call.function.name == "submit":
                return True
            burst.progress.command(episode)
            await trio.sleep(profile.command_s)
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id,
                          "content": f"ran {json.loads(call.function.arguments)['command']}\n"}]
        return False

    async def episode(index: int) -> None:
        run = anthropic_episode if burst.provider == "anthropic" else openai_episode
        try:
            with trio.fail_after(burst.cap_s):
                submitted = await run(clients[index // per_client], Episode())
        except trio.TooSlowError:
            tally.timed_out += 1
            return
        except Exception as error:
            tally.errors[type(error).__name__] += 1
            return
        if submitted:
            tally.submitted += 1
        else:
            tally.errors["no submit"] += 1

    try:
        async with trio.open_nursery() as nursery:
            for index in range(burst.n):
                nursery.start_soon(episode, index)
    finally:
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.close()


# -- one run, in its own interpreter ------------------------------------------------------


def warm_up_agent(burst: Burst) -> None:
    """Construct one agent before the burst and drop it. Its one-off imports (harbor's
    `BaseAgent` pulls in litellm: seconds of CPU) happen once per harbor process, before
    or with its first trial, so they are not what a burst of trials costs."""
    new_agent(burst, burst.root / "warm-up")


def run_burst(burst: Burst) -> dict[str, Any]:
    """Run one implementation at one size in this process; its figures."""
    from benchmarks.messages_server import raise_open_files_limit

    raise_open_files_limit()
    os.environ.setdefault(API_KEY_ENV, "bench-key")
    os.environ.setdefault(OPENAI_KEY_ENV, "bench-key")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm goes online
    if burst.provider in SDK_PROVIDERS:  # its SDK loaded before the burst, as after a first trial
        importlib.import_module(burst.provider)

    host_beat = Heartbeat() if burst.impl not in ("research", "sdk-alone", *SCALE_OUT_IMPLS) else None
    trio_beat = Heartbeat() if burst.impl != "baseline" else None
    window, progress = burst.window, burst.progress
    for index in range(burst.n):  # harbor creates each trial's directories before the agent runs
        (burst.trial_dir(index) / "agent").mkdir(parents=True)

    async def asyncio_main() -> None:
        assert host_beat is not None
        beat = asyncio.ensure_future(host_beat.asyncio_task())
        environment_class = harbor_environment_class()
        environments = [environment_class(burst.trial_dir(index), progress, burst.profile.command_s)
                        for index in range(burst.n)]
        warm_up_agent(burst)
        with burst.sampler.sampling():
            window.open()
            await harbor_trials(burst, environments)
            window.close()
        if burst.impl == "baseline":
            from benchmarks.traffic_baseline import shutdown

            shutdown()
        host_beat.running = False
        await beat

    if burst.impl in ("baseline", "thread", "guest"):
        if trio_beat is not None:
            heartbeat_in_engine_trio_runs(trio_beat)
        asyncio.run(asyncio_main())
    elif burst.impl == "trio-asyncio":
        import trio
        import trio_asyncio

        async def trio_main() -> None:
            assert trio_beat is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio_beat.trio_task)
                async with trio_asyncio.open_loop():
                    await trio_asyncio.aio_as_trio(asyncio_main)()
                nursery.cancel_scope.cancel()

        trio.run(trio_main)
    elif burst.impl == "research-workers":
        import trio

        import wmo_trio

        async def workers_main() -> None:
            assert trio_beat is not None
            doc = wmo_trio.parse_harness(HARNESS)
            environments = [SendableSleepingEnvironment(burst.profile.command_s)
                            for _ in range(burst.n)]
            async with trio.open_nursery() as nursery, wmo_trio.open_episode_pool(
                    limit=burst.n, workers=WORKERS) as pool:
                nursery.start_soon(trio_beat.trio_task)
                # One episode a worker first, as after a first trial: each worker's SDK
                # import and client; the server's counters then count the burst alone.
                warm = [wmo_trio.EpisodeSpec(doc, burst.provider_config(), INSTRUCTION,
                                             SendableSleepingEnvironment(0.0), task_id="warm-up")
                        for _ in range(WORKERS)]
                async with pool.fan_out(warm) as warmed:
                    async for _, result in warmed:
                        result.unwrap()
                reset = urllib.request.Request(burst.base_url + "/stats/reset", method="POST")
                await trio.to_thread.run_sync(lambda: urllib.request.urlopen(reset, timeout=60).close())
                pids = {worker.pid for worker in pool.workers}
                before = tree_cpu_s(os.getpid(), pids)  # this process, its Ray, its workers
                with burst.sampler.sampling():
                    window.open()
                    await research_trials(burst, doc, environments, pool)
                    window.close()
                after = tree_cpu_s(os.getpid(), pids)
                burst.tree_cpu_s = {role: after[role] - before[role] for role in after}
                nursery.cancel_scope.cancel()

        trio.run(workers_main)
    elif burst.impl == "sdk-alone":
        import trio

        async def sdk_alone_main() -> None:
            assert trio_beat is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio_beat.trio_task)
                with burst.sampler.sampling():
                    window.open()
                    await sdk_alone_trials(burst)
                    window.close()
                nursery.cancel_scope.cancel()

        trio.run(sdk_alone_main)
    else:
        import trio

        import wmo_trio

        async def research_main() -> None:
            assert trio_beat is not None
            doc = wmo_trio.parse_harness(HARNESS)
            environments = [SleepingTrioEnvironment(progress, burst.profile.command_s)
                            for _ in range(burst.n)]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio_beat.trio_task)
                with burst.sampler.sampling():
                    window.open()
                    await research_trials(burst, doc, environments)
                    window.close()
                nursery.cancel_scope.cancel()

        trio.run(research_main)

    for beat in (host_beat, trio_beat):
        if beat is not None:
            beat.running = False
    tally, profile = burst.tally, burst.profile
    wall = window.ended - window.launched
    steps = progress.commands + tally.submitted  # each a model call with its tool call
    # beyond one process, every process of the layout: this one, its Ray and its workers
    roles = burst.tree_cpu_s or {"driver": sum(window.cpu)}
    cpu = sum(roles.values())
    all_started = progress.all_started_at
    return {
        "impl": burst.impl, "provider": burst.provider, "n": burst.n,
        "wmo_trio_host_env": os.environ.get("WMO_TRIO_HOST"),
        "model_s": profile.model_s, "command_s": profile.command_s, "ideal_s": profile.ideal_s,
        "cap_s": burst.cap_s, "wall_s": wall, "wall_over_ideal": wall / profile.ideal_s,
        "cpu_s": cpu, "cpu_user_s": window.cpu[0], "cpu_sys_s": window.cpu[1], "cpu_by_role_s": roles,
        "steps": steps, "cpu_per_step_ms": cpu / steps * 1000 if steps else float("nan"),
        "all_started_s": (all_started - window.launched) if all_started else float("nan"),
        "host_heartbeat": host_beat.figures(window.launched, all_started, window.ended)
        if host_beat else None,
        "trio_heartbeat": trio_beat.figures(window.launched, all_started, window.ended)
        if trio_beat else None,
        "peak_threads": burst.sampler.peak, "peak_rss_mb": proc_status("VmHWM") / 1024,
        "traces": sum(1 for _ in burst.root.glob("trial-*/agent/wmo-run.json")),
        "submitted": tally.submitted, "timed_out": tally.timed_out, "errors": dict(tally.errors),
        "agent_construct_s": tally.construct_s,
    }


# -- the suite ----------------------------------------------------------------------------


def _command(impls: tuple[str, ...], bursts: list[tuple[str, int]], profile: Profile,
             base_url: str, cap_s: float, sdk_calls: int = 0,
             skip_model_parsing: bool = False, split: tuple[str, int] | None = None) -> list[str]:
    return [sys.executable, "-W", "ignore", "-m", "benchmarks.traffic", "run",
            *(f"--impl={impl}" for impl in impls),
            *(f"--burst={provider}:{n}" for provider, n in bursts), "--base-url", base_url,
            "--model-s", repr(profile.model_s), "--command-s", repr(profile.command_s),
            "--cap", repr(cap_s), *((f"--sdk-calls={sdk_calls}",) if sdk_calls else ()),
            *(("--skip-model-parsing",) if skip_model_parsing else ()),
            *((f"--split={split[0]}:{split[1]}",) if split else ())]


def _use_host(impl: str, env: MutableMapping[str, str]) -> None:
    """The host `impl` runs wmo_trio's episodes on, chosen in `env`: a child's, or this
    process's own for a run of several impls in turn."""
    env.pop("WMO_TRIO_HOST", None)
    if impl == "guest":
        env["WMO_TRIO_HOST"] = "guest"


def _environ(impl: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           API_KEY_ENV: "bench-key", OPENAI_KEY_ENV: "bench-key"}
    _use_host(impl, env)
    return env


def _finish(process: subprocess.Popen[str], timeout_s: float, impls: tuple[str, ...],
            bursts: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """The runs' figures; a run that failed or had to be killed is reported as such."""
    try:
        out, err = process.communicate(timeout=timeout_s)
        failed = f"exit {process.returncode}: {err.strip()[-1500:]}" if process.returncode else ""
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        failed = f"killed after {timeout_s:.0f} s: the run did not end"
    if failed:
        return [{"impl": impl, "provider": provider, "n": n, "failed": failed}
                for impl in impls
                for provider, n in bursts if runs_provider(impl, provider)]
    runs: list[dict[str, Any]] = json.loads(out)
    return runs


def _sdk_cost(base_url: str, calls: int) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "benchmarks.sdk_cost", "--base-url", base_url,
         "--calls", str(calls)], cwd=ROOT, env=_environ("baseline"), capture_output=True,
        text=True, timeout=300)
    if completed.returncode != 0:
        raise RuntimeError(f"SDK cost measurement failed:\n{completed.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(completed.stdout)
    return result


def _busy_cpu_s() -> float:
    """CPU time the whole machine has spent busy since boot (every core, every process)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class MachineShare:
    """How busy the rest of the machine was while our runs ran: the machine's busy CPU
    time less our runs' (reaped children) and the server's, per second of wall time."""

    def __init__(self) -> None:
        self._busy, self._ours, self._wall = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()

    def figures(self, server_cpu_s: float) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        busy, ours = _busy_cpu_s() - self._busy, _children_cpu_s() - self._ours
        return {"wall_s": wall, "busy_cores": busy / wall, "runs_cores": ours / wall,
                "server_cores": server_cpu_s / wall,
                "others_cores": max(0.0, busy - ours - server_cpu_s) / wall}


def suite(quick: bool, *, sizes: dict[str, list[int]] | None = None,
          impls: tuple[str, ...] = IMPLS, cap_s: float | None = None,
          smoke: SmokeRunner | None = None,
          log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """The whole scenario; see the module docstring. Ratios come from `markdown_rows`.
    `smoke` (with `quick`): `smoke_sizes()`, in the fewest interpreters (`_smoke`), this
    runner's copy the first of them; it ends with the suite."""
    profile = QUICK if quick else FULL
    sizes = sizes or (smoke_sizes() if smoke is not None else QUICK_SIZES if quick else FULL_SIZES)
    # A cap ends a collapsed run and reports it (timed-out episodes) instead of hanging:
    # harbor's agent timeout for each trial, the whole fan-out for the research API. A
    # quick run only checks shape, so its cap is loose enough for a busy machine.
    cap = cap_s or max(profile.ideal_s * 30, 120.0 if quick else 0.0)
    try:
        return _suite(quick, profile, sizes, impls, cap, smoke, log)
    finally:
        if smoke is not None:
            smoke.close()


def _suite(quick: bool, profile: Profile, sizes: dict[str, list[int]], impls: tuple[str, ...],
           cap: float, smoke: SmokeRunner | None, log: Callable[[str], None]) -> dict[str, Any]:
    from benchmarks import messages_server

    messages_server.raise_open_files_limit()
    results: dict[str, Any] = {"profile": asdict(profile), "ideal_s": profile.ideal_s, "cap_s": cap,
                               "impls": list(impls), "load_before": os.getloadavg(), "runs": []}
    bursts = [(provider, n) for provider in PROVIDERS for n in sizes.get(provider, [])]
    with messages_server.serve(delay_s=profile.model_s, tool_calls=profile.tool_calls) as server:
        if smoke is not None:
            results.update(_smoke(smoke, impls, bursts, profile, server, cap, log))
        elif quick:
            log("SDK cost per call ...")
            results["sdk"] = _sdk_cost(server.base_url, 100)
            # Shape only: each implementation runs every burst in one interpreter, all of
            # them side by side, which keeps the quick suite short.
            log(f"all bursts, {', '.join(impls)} side by side ...")
            load = os.getloadavg()
            server.stats(reset=True)
            share = MachineShare()
            own = {impl: [(provider, n) for provider, n in bursts if runs_provider(impl, provider)]
                   for impl in impls}
            running = {impl: subprocess.Popen(
                _command((impl,), own[impl], profile, server.base_url, cap), cwd=ROOT, env=_environ(impl),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for impl in impls}
            runs = [run for impl, process in running.items()
                    for run in _finish(process, 2 * cap * len(own[impl]) + 300, (impl,), own[impl])]
            results["server"] = server.stats()
            machine = share.figures(results["server"]["cpu_s"])  # the whole batch's
            results["runs"] += [{**run, "load_before": load, "machine": machine} for run in runs]
            results["split"] = split_runs(profile, server, cap, log, per_process=8)
        else:
            log("SDK cost per call ...")
            results["sdk"] = _sdk_cost(server.base_url, 300)
            # One interpreter per implementation and size, one after the other, so that
            # no run shares the machine, its threads or its memory with another.
            for burst in bursts:
                for impl in (impl for impl in impls if runs_provider(impl, burst[0])):
                    load = os.getloadavg()
                    server.stats(reset=True)
                    log(f"{burst[0]} x {burst[1]:,}: {impl} (load {load[0]:.2f}) ...")
                    share = MachineShare()
                    process = subprocess.Popen(
                        _command((impl,), [burst], profile, server.base_url, cap), cwd=ROOT,
                        env=_environ(impl), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    # the cap bounds each trial's run(), not its construction and setup
                    [run] = _finish(process, 2 * cap + 300, (impl,), [burst])
                    stats = server.stats()
                    results["runs"].append({**run, "load_before": load, "server": stats,
                                            "machine": share.figures(stats["cpu_s"])})
            results["split"] = split_runs(profile, server, cap, log)
    results["load_after"] = os.getloadavg()
    return results


# Beyond one process: the same total of episodes in one interpreter, and split over one
# interpreter per core, side by side (`split_runs`).
SPLIT_PER_PROCESS = 1024
SPLIT_IMPLS = ("thread", "research")


def split_processes() -> int:
    return max(2, os.cpu_count() or 1)


def _smoke(runner: SmokeRunner, impls: tuple[str, ...], bursts: list[tuple[str, int]],
           profile: Profile, server: Any, cap: float, log: Callable[[str], None]) -> dict[str, Any]:
    """A smoke run's `sdk`, `server`, `runs` and `split`, in one interpreter instead of a
    quick run's thirteen (`runner`'s copy of the suite's process, which shares its harbor
    and wmo_trio imports): each interpreter's imports (the SDKs', harbor's) cost more than
    all of its episodes, and a smoke run checks that every figure is produced, not what a
    process costs. It measures the SDKs' own cost, then runs every implementation's bursts
    one after the other (trio-asyncio, which changes asyncio's loop policy for the
    process, last); its `anthropic` runs of `thread` and `research` are the split's
    single-interpreter layout. The per-core layout is this interpreter, running its share
    before trio-asyncio, and forked copies of it (`--split`), made after the imports.
    Every agent is constructed as a harbor job run with
    `--skip-model-parsing-and-provider-mapping` (as the README runs one) constructs it,
    so no interpreter imports litellm to look the model name up."""
    order = tuple(sorted(impls, key=lambda impl: impl == "trio-asyncio"))
    processes = split_processes()
    log(f"SDK cost per call, then all bursts of {', '.join(order)} in one interpreter, and "
        f"anthropic x {processes} as {processes} x 1 ...")
    load = os.getloadavg()
    server.stats(reset=True)
    share = MachineShare()
    ran: dict[str, Any] = runner.run(
        _command(order, bursts, profile, server.base_url, cap, sdk_calls=2, skip_model_parsing=True,
                 split=("anthropic", 1)),
        2 * cap * (len(order) * len(bursts) + 2) + 300)
    # the per-core layout's calls are counted too: 5 a model-driven episode
    stats = server.stats()
    machine = share.figures(stats["cpu_s"])
    runs = [{**run, "load_before": load, "machine": machine} for run in ran["runs"]]
    split = []
    for impl in SPLIT_IMPLS:
        split.append({"impl": impl, "processes": processes, "episodes": processes,
                      "runs": [run for each in ran["split"] for run in each if run["impl"] == impl]})
        single = [run for run in ran["runs"]
                  if (run["impl"], run["provider"], run["n"]) == (impl, "anthropic", processes)]
        split.append({"impl": impl, "processes": 1, "episodes": processes, "runs": single})
    return {"sdk": ran["sdk"], "server": stats, "runs": runs, "split": split}


def split_runs(profile: Profile, server: Any, cap: float, log: Callable[[str], None], *,
               per_process: int = SPLIT_PER_PROCESS) -> list[dict[str, Any]]:
    """For each of `SPLIT_IMPLS`: one interpreter per core, each running `per_process`
    anthropic episodes at the same time, then the same total in a single interpreter.
    Each entry: the processes, the episodes in all, and their runs."""
    processes = split_processes()
    total = processes * per_process
    entries = []
    for impl in SPLIT_IMPLS:
        for count, each in ((processes, per_process), (1, total)):
            log(f"anthropic x {total:,} as {count} x {each:,}: {impl} ...")
            burst = [("anthropic", each)]
            running = [subprocess.Popen(_command((impl,), burst, profile, server.base_url, cap), cwd=ROOT,
                                        env=_environ(impl), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True) for _ in range(count)]
            runs = [run for process in running for run in _finish(process, 2 * cap + 300, (impl,), burst)]
            entries.append({"impl": impl, "processes": count, "episodes": total, "runs": runs})
    return entries


def split_rows(traffic: dict[str, Any]) -> list[tuple[str, str, float, float, int]]:
    """(implementation, layout, wall over ideal of the slowest process, mean CPU per step,
    episodes submitted) per entry of `split_runs`."""
    rows = []
    for entry in traffic.get("split", []):
        runs = entry["runs"]
        ok = [run for run in runs if "wall_s" in run]
        layout = f"{entry['processes']} x {entry['episodes'] // entry['processes']:,}"
        wall = max((run["wall_over_ideal"] for run in ok), default=float("nan"))
        cpu = sum(run["cpu_per_step_ms"] for run in ok) / len(ok) if ok else float("nan")
        rows.append((entry["impl"], layout, wall if len(ok) == len(runs) else float("nan"), cpu,
                     sum(run.get("submitted", 0) for run in ok)))
    return rows


def find_run(traffic: dict[str, Any], provider: str, n: int, impl: str) -> dict[str, Any]:
    for run in traffic["runs"]:
        if (run["provider"], run["n"], run["impl"]) == (provider, n, impl):
            result: dict[str, Any] = run
            return result
    return {}


def figure(run: dict[str, Any], *path: str) -> float:
    """`run[path[0]][path[1]]...`, NaN where the run failed or the figure does not apply."""
    value: Any = run if "wall_s" in run else None
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) else float("nan")


# (label, unit, where the figure is in a run's result)
_ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    ("wall time / ideal", "x", ("wall_over_ideal",)),
    ("process CPU per step", "ms", ("cpu_per_step_ms",)),
    ("every episode past its first command, from the launch", "s", ("all_started_s",)),
    *((f"{name} heartbeat lateness {label}", "ms", (loop, key))
      for loop, name in (("host_heartbeat", "host asyncio loop"), ("trio_heartbeat", "trio loop"))
      for key, label in (("p99_ms", "p99"), ("max_ms", "max"),
                         ("with_start_p99_ms", "p99, start included"),
                         ("with_start_max_ms", "max, start included"))),
    ("peak threads", "", ("peak_threads",)),
    ("peak RSS (MiB)", "", ("peak_rss_mb",)),
    ("traces written", "", ("traces",)),
    ("episodes timed out at the cap", "", ("timed_out",)),
    ("other processes' CPU during the run (not ours, not the server's)", "cores",
     ("machine", "others_cores")),
]


# The SDK's own cost per call that a provider's CPU per step is set against.
_SDK_CLIENTS = {
    "anthropic": (("sync_cpu_per_call_ms", "sync client"),
                  ("async_trio_cpu_per_call_ms", "AsyncAnthropic on trio")),
    "openai": (("openai_sync_cpu_per_call_ms", "sync client"),
               ("openai_async_trio_cpu_per_call_ms", "AsyncOpenAI on trio")),
}


def markdown_rows(traffic: dict[str, Any]) -> list[tuple[str, str, dict[str, float]]]:
    """(metric, unit, {impl: value}) for every figure of the scenario, NaN where a figure
    does not apply (no trio loop in the baseline; no asyncio loop in the research API; no
    baseline of the `openai` provider) or
    the run failed."""
    sdk = traffic["sdk"]
    rows: list[tuple[str, str, dict[str, float]]] = []
    sizes = sorted({(run["provider"], run["n"]) for run in traffic["runs"]},
                   key=lambda key: (PROVIDERS.index(key[0]), key[1]))
    for provider, n in sizes:
        runs = {impl: find_run(traffic, provider, n, impl) for impl in traffic["impls"]}
        where = f"@ {n:,} ({provider})"
        for index, (label, unit, path) in enumerate(_ROWS):
            rows.append((f"{label} {where}", unit,
                         {impl: figure(run, *path) for impl, run in runs.items()}))
            if index == 1:
                # One step every model_s + command_s per episode: at this CPU per step, the
                # episodes whose work fills one core (the interpreter lock's bound, roughly).
                step_s = traffic["profile"]["model_s"] + traffic["profile"]["command_s"]
                rows.append((f"episodes whose steps fill one core at {step_s:g} s a step {where}",
                             "", {impl: step_s * 1000 / figure(run, "cpu_per_step_ms")
                                  for impl, run in runs.items()}))
            if index == 1 and provider in _SDK_CLIENTS:
                for key, client in _SDK_CLIENTS[provider]:
                    rows.append((f"CPU per step / SDK's own per call ({client}) {where}", "x",
                                 {impl: figure(run, "cpu_per_step_ms") / sdk[key]
                                  for impl, run in runs.items()}))
    return rows


def failures(traffic: dict[str, Any]) -> list[str]:
    runs = traffic["runs"] + [run for entry in traffic.get("split", []) for run in entry["runs"]]
    return [f"{run['impl']} at {run['n']:,} ({run['provider']}): {run['failed']}"
            for run in runs if "failed" in run]


class SmokeRunner:
    """A smoke run's traffic interpreter: `run` in a forked copy of the suite's process,
    forked before the suite starts any thread (the harbor and wmo_trio imports it shares
    are then paid once; the SDKs' are not shared, `run` measures them), told its command
    line once the server is up."""

    def __init__(self) -> None:
        from benchmarks import sdk_cost, traffic_baseline  # noqa: F401 - for the copy
        from wmo_trio.harbor import WmoTrioHarborAgent  # noqa: F401 - harbor's imports

        receive, self._orders = multiprocessing.get_context("fork").Pipe(duplex=False)
        self._copy = Forked("the smoke traffic run", _run_ordered, receive, self._orders)
        receive.close()
        self._waited = False

    def run(self, command: list[str], timeout_s: float) -> Any:
        """`command` (as `_command` makes it) in the copy; what `run` would print."""
        self._orders.send(command[command.index("run"):])
        self._orders.close()
        self._waited = True
        return self._copy.result(timeout_s)

    def close(self) -> None:
        """The copy ends without a run, if it has not run one."""
        self._orders.close()
        if not self._waited:
            self._waited = True
            self._copy.result(60)


def _run_ordered(orders: Connection, ours: Connection) -> Any:
    ours.close()  # the parent's end, copied by the fork: else no end of orders is ever seen
    try:
        argv = orders.recv()
    except EOFError:
        return None
    # as a quick run's traffic interpreter starts: `_environ("thread")`, `-W ignore`
    os.environ.update(_environ("thread"))
    _use_host("thread", os.environ)
    warnings.simplefilter("ignore")
    return _run(_parser().parse_args(argv))


def _run_one(impl: str, provider: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One burst of `impl` in this process, as `run`'s arguments describe it."""
    _use_host(impl, os.environ)
    with tempfile.TemporaryDirectory(prefix="wmo-bench-traffic-") as scratch:
        return run_burst(Burst(impl, provider, n, Profile(args.model_s, args.command_s),
                               args.base_url, args.cap, Path(scratch), Progress(n),
                               skip_model_parsing=args.skip_model_parsing))


def _fork_split_shares(share: tuple[str, int], args: argparse.Namespace) -> list[Forked]:
    """The other interpreters of the split's per-core layout, as forked copies of this one
    (a smoke run): started once the SDKs and what `SPLIT_IMPLS` run are imported, before
    any burst starts a thread; each runs its share, both of `SPLIT_IMPLS` in turn."""
    import trio  # noqa: F401 - for the copies

    import wmo_trio  # noqa: F401
    from wmo_trio.harbor import WmoTrioHarborAgent  # noqa: F401 - harbor's imports

    importlib.import_module(share[0])
    return [Forked(f"split share {index}", _split_share, share, args)
            for index in range(1, split_processes())]


def _split_share(share: tuple[str, int], args: argparse.Namespace) -> list[dict[str, Any]]:
    return [_run_one(impl, *share, args) for impl in SPLIT_IMPLS]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.traffic")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one implementation at one size, in this process")
    one.add_argument("--impl", choices=IMPLS + SCALE_OUT_IMPLS, action="append", required=True,
                     help="repeatable (a smoke run): each in turn, every burst it runs")
    one.add_argument("--sdk-calls", type=int, default=0,
                     help="first measure the SDKs' own cost (benchmarks/sdk_cost.py) with this "
                          "many calls; then prints {\"sdk\": ..., \"runs\": [...]}")
    one.add_argument("--split", metavar="PROVIDER:N",
                     help="(a smoke run) also the split's per-core layout at this burst a process: "
                          "this interpreter, before trio-asyncio, and forked copies of it; then "
                          "prints {\"sdk\": ..., \"runs\": [...], \"split\": [[...] a process]}")
    one.add_argument("--skip-model-parsing", action="store_true",
                     help="construct the agents as harbor's --skip-model-parsing-and-provider-"
                          "mapping does: no litellm lookup (and import) of the model name")
    one.add_argument("--burst", action="append", required=True, metavar="PROVIDER:N",
                     help="a provider (anthropic, openai or scripted) and a number of episodes; repeatable")
    one.add_argument("--base-url", required=True)
    one.add_argument("--model-s", type=float, default=FULL.model_s)
    one.add_argument("--command-s", type=float, default=FULL.command_s)
    one.add_argument("--cap", type=float, default=FULL.ideal_s * 30,
                     help="each trial's agent timeout; the research API's bound on its fan-out")
    everything = commands.add_parser("suite", help="every implementation and size")
    everything.add_argument("--quick", action="store_true")
    everything.add_argument("--sizes", type=int, nargs="+", help="these sizes, both providers")
    everything.add_argument("--providers", choices=PROVIDERS, nargs="+", default=list(PROVIDERS))
    everything.add_argument("--impls", choices=IMPLS, nargs="+", default=list(IMPLS))
    everything.add_argument("--cap", type=float, help="as for run (default 30x ideal)")
    return parser


def _run(args: argparse.Namespace) -> Any:
    """`run`: every burst of every implementation in this process; what it prints."""
    def burst_of(option: str, spec: str) -> tuple[str, int]:
        provider, _, n = spec.partition(":")
        if provider not in PROVIDERS or not n.isdigit() or int(n) < 1:
            _parser().error(f"{option} {spec}: expected PROVIDER:N, PROVIDER one of {PROVIDERS}")
        return provider, int(n)

    bursts = [burst_of("--burst", spec) for spec in args.burst]
    # (implementation, its bursts, where its runs are printed)
    plan = [(impl, bursts, "runs") for impl in args.impl]
    share = burst_of("--split", args.split) if args.split else None
    if share:  # before trio-asyncio, which changes asyncio's loop policy for good
        last = next((i for i, (impl, _, _) in enumerate(plan) if impl == "trio-asyncio"), len(plan))
        plan[last:last] = [(impl, [share], "split") for impl in SPLIT_IMPLS]
    sdk = None
    if args.sdk_calls:  # before anything here imports an SDK: it measures the import
        from benchmarks import sdk_cost

        sdk = sdk_cost.measure(args.base_url, args.sdk_calls)
        # the server's counters then count the episodes' calls only, as in a quick run
        reset = urllib.request.Request(args.base_url + "/stats/reset", method="POST")
        with urllib.request.urlopen(reset, timeout=60):
            pass
    copies = _fork_split_shares(share, args) if share else []
    printed: dict[str, list[dict[str, Any]]] = {"runs": [], "split": []}
    for impl, its_bursts, key in plan:
        for provider, n in its_bursts:
            if runs_provider(impl, provider):
                printed[key].append(_run_one(impl, provider, n, args))
    if sdk is None and not share:
        return printed["runs"]
    shares = [printed["split"], *(copy.result(4 * args.cap + 300) for copy in copies)]
    return {"sdk": sdk, "runs": printed["runs"], "split": shares}


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.command == "run":
        json.dump(_run(args), sys.stdout)
        return
    defaults = QUICK_SIZES if args.quick else FULL_SIZES
    sizes = {provider: (args.sizes or defaults[provider]) if provider in args.providers else []
             for provider in PROVIDERS}
    json.dump(suite(args.quick, sizes=sizes, impls=tuple(args.impls), cap_s=args.cap,
                    log=lambda line: print(line, file=sys.stderr, flush=True)), sys.stdout, indent=2)


if __name__ == "__main__":
    main()
