"""The sandbox backend: the episode's program runs in a bubblewrap sandbox of its own on
this machine; its model calls and tool calls are answered here.

An optimizer mutates `code:runtime` programs, and a mutated program is untrusted code.
`SandboxRuntime` (the surface of `EpisodeRuntime`: `run`, `abort`, `close`, `log`) runs the
episode's program, a document's `code:runtime` or the built-in loop, as a *runner*
(`wmo_trio/episode/portable.py`, the program an in-process episode runs) that speaks the
e2b backend's JSON frames over its stdin and stdout (`wmo_trio.backends._frames`). The
host stays the authority, as on `e2b`: it answers each model call with its provider and
each tool call with the episode's environment (any harbor environment: the commands never
run in this sandbox), counts every budget, records every step, and ends the episode by
killing the sandbox.

What the runner gets: a trial sandbox's profile (`wmo_trio.sandbox.TRIAL_PROFILE`: its
`/proc` and `/sys` masks, its system-call filter, a keyring of its own, a new session,
death with the thread that started it, a cgroup with its ceilings), tightened as
`RUNNER_PROFILE` says, and:

- a root of its own: an empty tmpfs, read-only, holding only the Python runtime that runs
  the runner (the interpreter, its standard library without site-packages, the shared
  libraries they load), each read-only at its own path; a private `/tmp` (a tmpfs within
  the memory ceiling). No `/etc`, no home, no shell, no host tree. Smaller than the
  docker-free environment's overlay root on purpose: a program needs Python and nothing
  else, and every file left out is one it cannot read;
- ceilings on CPUs, memory and processes (`SandboxSettings`), where this machine offers
  cgroups;
- a kill at abort, close, the wall-clock budget, and any frame that breaks the protocol.

Start latency: a runner starts before its episode is known (`python3 -I -S portable.py -`,
the spec arriving as the first frame), so a small pool of ready runners per process
(`pool_size`) hands one to each new episode; a pool runs its starts in one thread of its
own, which lives as long as the process (a runner dies with the thread that started it).

`sandbox_problem()` says why this machine cannot run the backend (not Linux, no
bubblewrap, no namespaces, no Python runtime it can bind), or None; `check_backend`
turns it into the argument check's error.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from typing import Annotated, Any, Self

from pydantic import Field

from wmo_trio.backends._frames import TransportFailure, serve_frames
from wmo_trio.backends._sandbox_runner import (
    START_TIMEOUT_S,
    Once,
    PythonRuntime,
    Runner,
    python_runtime,
    start_runner,
)
from wmo_trio.episode.channel import ProtocolViolation, refuse
from wmo_trio.episode.environment import Environment
from wmo_trio.episode.runtime import RuntimeBase
from wmo_trio.episode.services import EpisodeEnded, EpisodeServices, episode_spec
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import RunResult, StopReason
from wmo_trio.providers.base import Provider
from wmo_trio.sandbox import LAUNCH_ATTEMPTS, TRIAL_PROFILE, Limits, Profile, profile_problem
from wmo_trio.settings import Settings

__all__ = ["RUNNER_PROFILE", "SandboxRuntime", "SandboxSettings", "python_runtime",
           "sandbox_problem"]

log = logging.getLogger("wmo_trio.backends.sandbox")

# A trial's sandbox, tightened: a user namespace besides, no capability, no variable (it
# runs one interpreter by its path), and bubblewrap's reaper as PID 1 (the runner is a
# program like any other). Its /tmp, sized by the memory ceiling, and its cgroup's
# ceilings come from the settings (`SandboxSettings.profile`).
RUNNER_PROFILE = replace(TRIAL_PROFILE, namespaces=TRIAL_PROFILE.namespaces | {"user"},
                         capabilities=(), environment=(), command_is_pid_1=False)


class SandboxSettings(Settings):
    """How episodes use the sandbox backend.

    - `cpus`, `memory_mb`, `pids`: the ceilings of each runner's cgroup (CPUs, memory
      and its `/tmp`, processes and threads alive at once);
    - `pool_size`: runners kept started and waiting for an episode (0: none; every
      episode then pays a runner's start).
    """

    cpus: Annotated[float, Field(gt=0, allow_inf_nan=False, description="a positive number")] = 1.0
    memory_mb: Annotated[int, Field(ge=16, description="an integer >= 16")] = 512
    pids: Annotated[int, Field(ge=2, description="an integer >= 2")] = 64
    pool_size: Annotated[int, Field(ge=0, le=64, description="an integer in [0, 64]")] = 4

    @property
    def profile(self) -> Profile:
        """The runner's sandbox under these settings."""
        return replace(RUNNER_PROFILE, tmp_bytes=self.memory_mb << 20,
                       limits=Limits(cpus=self.cpus, memory_mb=self.memory_mb, pids=self.pids))


@Once
def sandbox_problem() -> str | None:
    """Why this machine cannot run `harness_backend='sandbox'`, or None. Checked once per
    process: the first call starts one runner and waits for its hello."""
    if sys.platform != "linux":
        return f"it needs Linux (namespaces and bubblewrap), and this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not on PATH: install it (Debian: apt-get install bubblewrap)"
    if shutil.which("keyctl") is None:
        return "keyctl is not on PATH: install it (Debian: apt-get install keyutils)"
    problem = profile_problem(RUNNER_PROFILE)
    if problem is not None:
        return f"its system-call filter cannot be built: {problem}"
    try:
        runtime = python_runtime()
    except (OSError, subprocess.SubprocessError) as error:
        return f"the Python runtime for the sandbox cannot be found: {error}"
    try:
        runner = Runner.start(runtime, replace(SandboxSettings().profile, limits=Limits()))
    except OSError as error:
        return f"bubblewrap could not be started: {error}"
    with runner:
        problem = runner.greeted(START_TIMEOUT_S)
    if problem is not None:
        return f"bubblewrap could not start a sandbox (its namespaces): {problem}"
    return None


# -- a pool of ready runners ----------------------------------------------------------------


class _Pool:
    """Runners started ahead of their episodes, at most `size`, for one settings.

    Starts run in one daemon thread that lives as long as the process: a runner dies with
    the thread that started it. `take` never waits for a start."""

    def __init__(self, runtime: PythonRuntime, settings: SandboxSettings) -> None:
        self._runtime = runtime
        self._settings = settings
        self._ready: list[Runner] = []
        self._wanted = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._fill, daemon=True, name="wmo-trio-sandbox-pool").start()

    def take(self) -> Runner | None:
        with self._wanted:
            while self._ready:
                runner = self._ready.pop(0)
                self._wanted.notify()
                if runner.alive():
                    return runner
                runner.close()
        return None

    def _fill(self) -> None:
        failures = 0
        while True:
            with self._wanted:
                while not self._stopped and len(self._ready) >= self._settings.pool_size:
                    self._wanted.wait()
                if self._stopped:
                    return
            try:
                runner = start_runner(self._runtime, self._settings.profile)
            except Exception:
                failures += 1
                log.warning("starting a pooled sandbox runner failed", exc_info=failures == 1)
                if failures >= LAUNCH_ATTEMPTS:
                    return  # episodes start their own runners, and say why they cannot
                continue
            failures = 0
            with self._wanted:
                if self._stopped:
                    runner.close()
                    return
                self._ready.append(runner)

    def stop(self) -> None:
        """Start no more runners, and close the ready ones. Idempotent."""
        with self._wanted:
            self._stopped = True
            ready, self._ready = self._ready, []
            self._wanted.notify_all()
        for runner in ready:
            runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_STARTS = threading.BoundedSemaphore(8 * (os.cpu_count() or 1))
_START_POLL_S = 0.05
_POOLS: dict[SandboxSettings, _Pool] = {}
_POOLS_LOCK = threading.Lock()
# The pools live as long as the process: each is entered here when it is made, and
# stopped (its ready runners killed and reaped) when the process exits.
_POOLS_LIFETIME = contextlib.ExitStack()
atexit.register(_POOLS_LIFETIME.close)


def _pool(settings: SandboxSettings) -> _Pool | None:
    if settings.pool_size == 0:
        return None
    with _POOLS_LOCK:
        pool = _POOLS.get(settings)
        if pool is None:
            pool = _POOLS[settings] = _POOLS_LIFETIME.enter_context(_Pool(python_runtime(), settings))
        return pool


# -- the runtime ----------------------------------------------------------------------------


class SandboxRuntime(RuntimeBase):
    """Runs one episode of `doc` with its program in a sandbox of its own; see the module
    docstring.

    `run()` returns a `RunResult` for every ending, the runner's failures included, and
    raises only on a defect of wmo_trio. `abort()` kills the sandbox at once (a signal:
    quick from any thread); `close()` (idempotent) kills whatever is left.
    """

    def __init__(self, doc: HarnessDoc, provider: Provider, *,
                 settings: SandboxSettings | None = None, **kwargs: Any) -> None:
        super().__init__(doc, provider, **kwargs)
        self.settings = settings or SandboxSettings()
        self._runner: Runner | None = None

    def kill_program(self) -> None:
        """Kill the sandbox: a signal, quick from any thread."""
        with self._lock:
            runner = self._runner
        if runner is not None:
            runner.kill()

    def wake(self) -> None:
        runner = self._runner
        if runner is not None:
            runner.wake()

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult:
        with self._episode(environment):
            services = self._services(environment)
            spec = episode_spec(self.doc, task_id=task_id, instruction=instruction,
                                context_window=self.context_window)
            try:
                reason, answer = self._attempt(services, spec)
            except EpisodeEnded as ended:
                reason, answer = ended.reason, ended.answer
            finally:
                with self._lock:
                    runner, self._runner = self._runner, None
                if runner is not None:
                    runner.close()
        return self._result(task_id, reason, answer)

    def _attempt(self, services: EpisodeServices, spec: dict[str, Any]) -> tuple[StopReason, str]:
        services.boundary()
        try:
            runner = self._start()
            runner.send({"type": "episode", "spec": spec})
            return serve_frames(runner, services, self.control)
        except TransportFailure as failure:
            services.boundary()  # a sandbox killed by abort() or the budget ends as that
            services.record_error(f"sandbox transport failed: {failure}")
            return StopReason.ERROR, ""
        except ProtocolViolation as violation:
            return refuse(services, violation)

    def _start(self) -> Runner:
        pool = _pool(self.settings)
        runner = pool.take() if pool is not None else None
        if runner is not None:
            self._hold(runner)
            return runner
        with self.control.blocking():
            # A burst starts its runners a few at a time: all at once, every one of them
            # waits for the whole burst's CPU.
            while not _STARTS.acquire(timeout=_START_POLL_S):
                if self.stopping():
                    raise TransportFailure("the episode stopped before its sandbox started")
            try:
                return start_runner(python_runtime(), self.settings.profile, self._hold)
            except OSError as error:
                raise TransportFailure(f"starting the sandbox failed: {error}") from error
            finally:
                _STARTS.release()

    def _hold(self, runner: Runner) -> None:
        with self._lock:
            previous, self._runner = self._runner, runner
        if previous is not None:  # a start tried again
            previous.close()
        if self.stopping():  # aborted while it started
            runner.kill()
