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
import functools
import glob
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from typing import Annotated, Any, Self

from pydantic import Field

from wmo_trio.backends._frames import (
    MAX_FRAME_BYTES,
    WAKE,
    Exited,
    TransportFailure,
    ended_early,
    serve_frames,
)
from wmo_trio.episode.channel import ProtocolViolation, refuse
from wmo_trio.episode.environment import Environment
from wmo_trio.episode.runtime import RuntimeBase
from wmo_trio.episode.services import EpisodeEnded, EpisodeServices, episode_spec
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import RunResult, StopReason
from wmo_trio.providers.base import Provider
from wmo_trio.sandbox import (
    TRIAL_PROFILE,
    Bind,
    Limits,
    Profile,
    TrialCgroup,
    bwrap_argv,
    launch_argv,
    profile_problem,
)
from wmo_trio.settings import Settings

__all__ = ["SandboxRuntime", "SandboxSettings", "sandbox_problem"]

log = logging.getLogger("wmo_trio.backends.sandbox")

RUNNER_SOURCE = resources.files("wmo_trio.episode").joinpath("portable.py").read_bytes()
# A trial's sandbox, tightened: a user namespace besides, no capability, no variable (it
# runs one interpreter by its path), and bubblewrap's reaper as PID 1 (the runner is a
# program like any other). Its /tmp, sized by the memory ceiling, and its cgroup's
# ceilings come from the settings (`SandboxSettings.profile`).
RUNNER_PROFILE = replace(TRIAL_PROFILE, namespaces=TRIAL_PROFILE.namespaces | {"user"},
                         capabilities=(), environment=(), command_is_pid_1=False)
_CHUNK = 1 << 16
_STDERR_TAIL_CHARS = 2000
# How long a runner whose frame stream ended may take to exit before it is killed.
_EXIT_PATIENCE_S = 2.0
# How long the availability probe, or a pooled runner's start, may take.
_START_TIMEOUT_S = 30.0
_LAUNCH_ATTEMPTS = 3


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


class _Once[T]:
    """A function of no argument whose value the first caller computes while the others
    wait (the threads of a burst all ask at once: `functools.cache` would let each of them
    compute it). A failure is not kept: the next call tries again."""

    def __init__(self, function: Callable[[], T]) -> None:
        self._function = function
        self._lock = threading.Lock()
        self._value: tuple[T] | None = None
        functools.update_wrapper(self, function)

    def __call__(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = (self._function(),)
            return self._value[0]

    def cache_clear(self) -> None:
        with self._lock:
            self._value = None


# -- the Python runtime a runner gets -------------------------------------------------------


@dataclass(frozen=True)
class PythonRuntime:
    """The interpreter that runs runners, and every path it needs, bound read-only at the
    same path in the sandbox: `binds` are (host path, sandbox path), `masked` directories
    within them that the sandbox sees empty."""

    interpreter: str
    binds: tuple[tuple[str, str], ...]
    masked: tuple[str, ...]


def _shared_libraries(files: list[str]) -> set[str]:
    """The shared libraries (and the loader) that `files` load, as `ldd` resolves them."""
    done = subprocess.run(["ldd", *files], capture_output=True, text=True, timeout=60,
                          check=False)
    found = set()
    for line in done.stdout.splitlines():
        words = line.split()
        if "=>" in words and len(words) >= 3 and words[2].startswith("/"):
            found.add(words[2])
        elif words and words[0].startswith("/") and not words[0].endswith(":"):
            found.add(words[0])
    return found


@_Once
def python_runtime() -> PythonRuntime:
    """The runtime of the Python running wmo_trio (its base install, not a venv): the
    runner needs Python 3.8 and the standard library only."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                      "installed_base": sys.base_prefix,
                                      "installed_platbase": sys.base_exec_prefix})
    stdlibs = sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])})
    if shutil.which("ldd") is None:
        raise FileNotFoundError("ldd (from the C library's tools) is not on PATH")
    modules = [path for stdlib in stdlibs for path in glob.glob(f"{stdlib}/lib-dynload/*.so")]
    binds = [(interpreter, interpreter), *((stdlib, stdlib) for stdlib in stdlibs)]
    for library in sorted(_shared_libraries([interpreter, *modules])):
        if not any(library.startswith(stdlib + "/") for stdlib in stdlibs):
            binds.append((os.path.realpath(library), library))
    masked = tuple(f"{stdlib}/site-packages" for stdlib in stdlibs
                   if os.path.isdir(f"{stdlib}/site-packages"))
    return PythonRuntime(interpreter, tuple(binds), masked)


@_Once
def _runner_script() -> int:
    """A sealed in-memory file holding `portable.py`, passed to every runner by number."""
    fd = os.memfd_create("wmo-trio-runner", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, RUNNER_SOURCE)
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
                | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


@_Once
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
        runner = _Runner.start(runtime, replace(SandboxSettings().profile, limits=Limits()))
    except OSError as error:
        return f"bubblewrap could not be started: {error}"
    with runner:
        problem = runner.greeted(_START_TIMEOUT_S)
    if problem is not None:
        return f"bubblewrap could not start a sandbox (its namespaces): {problem}"
    return None


# -- one runner -----------------------------------------------------------------------------


class _Runner:
    """One runner: bubblewrap and the program in it, its frames on pipes.

    `next` and `send` belong to the thread that serves the episode; `kill` and `wake` may
    come from any thread; `close` (kill, reap, free) from the thread that serves it, or
    the end of a `with runner:` block there.
    Everything read from the runner is bounded: a line by `MAX_FRAME_BYTES`, its stderr by
    the tail kept.
    """

    def __init__(self, process: subprocess.Popen[bytes], cgroup: TrialCgroup | None,
                 memory_mb: int | None) -> None:
        self.process = process
        self.cgroup = cgroup
        self.memory_mb = memory_mb
        assert process.stdin and process.stdout and process.stderr
        self._input = process.stdin.fileno()
        self._output = process.stdout.fileno()
        self._errors: int | None = process.stderr.fileno()
        for fd in (self._input, self._output, self._errors):
            os.set_blocking(fd, False)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._buffer = bytearray()
        self._scanned = 0
        self._pending: list[str] = []
        self._ended: Exited | None = None
        self._stderr = ""
        self._killed = False
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def start(cls, runtime: PythonRuntime, profile: Profile) -> _Runner:
        """Start one runner in a sandbox of `profile`; its cgroup (where this machine
        offers one) is joined before bubblewrap starts, so every process of the sandbox
        is in it. The script is read from a descriptor, the episode from stdin."""
        script = _runner_script()
        cgroup = TrialCgroup.create(profile.limits)
        try:
            with contextlib.ExitStack() as descriptors:
                bwrap, inherited = bwrap_argv(
                    profile, descriptors, hostname="sandbox", chdir="/tmp",
                    binds=[Bind(source, target, read_only=True) for source, target in runtime.binds],
                    hidden=runtime.masked,
                    command=[runtime.interpreter, "-I", "-S", f"/proc/self/fd/{script}", "-"])
                process = subprocess.Popen(
                    launch_argv(bwrap, cgroup_procs=cgroup.procs_files if cgroup else ()),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=(script, *inherited),
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, start_new_session=True,
                )
        except BaseException:
            if cgroup is not None:
                cgroup.remove(patience=0.0)
            raise
        return cls(process, cgroup, profile.limits.memory_mb)

    def greeted(self, timeout: float) -> str | None:
        """Wait for the runner's first line (kept for `next`); None when it came, else what
        went wrong."""
        line = self.next(timeout)
        if isinstance(line, str):
            self._pending.append(line)
            return None
        if isinstance(line, Exited):
            return self.describe(line)
        return f"no hello within {timeout:g} s"

    # -- reading --------------------------------------------------------------------------

    def next(self, timeout: float | None) -> object:
        """The next line, an `Exited`, or `WAKE` (woken, or `timeout` passed)."""
        if self._pending:
            return self._pending.pop(0)
        if self._ended is not None:
            return self._ended
        while True:
            line = self._line()
            if line is not None:
                return line
            if len(self._buffer) > MAX_FRAME_BYTES:
                self._ended = Exited(None, f"the runner wrote over {MAX_FRAME_BYTES} bytes "
                                           "without ending a frame")
                self._buffer = bytearray()
                return self._ended
            ready = _ready([self._output, self._wake,
                            *(() if self._errors is None else (self._errors,))], [], timeout)
            if not ready:
                return WAKE
            if self._errors is not None and self._errors in ready:
                self._read_stderr()
            if self._wake in ready:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
                return WAKE
            if self._output in ready:
                try:
                    chunk = os.read(self._output, _CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    self._ended = self._exited()
                    return self._ended
                self._buffer += chunk

    def _line(self) -> str | None:
        end = self._buffer.find(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(self._buffer)
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        self._scanned = 0
        return line.decode("utf-8", errors="replace")

    def _read_stderr(self) -> None:
        assert self._errors is not None
        try:
            chunk = os.read(self._errors, _CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            self._errors = None
            return
        self._stderr = (self._stderr + chunk.decode("utf-8", errors="replace"))[-_STDERR_TAIL_CHARS:]

    def _exited(self) -> Exited:
        try:
            code = self.process.wait(_EXIT_PATIENCE_S)
        except subprocess.TimeoutExpired:
            return Exited(None, "the runner closed its frame stream but did not exit")
        while self._errors is not None and _ready([self._errors], [], 0):
            self._read_stderr()  # its last words, within the tail kept
        return Exited(code)

    def describe(self, exited: Exited) -> str:
        why = f" (killed at its memory ceiling of {self.memory_mb} MiB)" if self._out_of_memory() else ""
        # keyctl's own note on joining the session keyring is not the runner's last word.
        stderr = "".join(line for line in self._stderr.splitlines(keepends=True)
                         if not line.startswith("Joined session keyring"))
        return ended_early(exited, stderr, why)

    def _out_of_memory(self) -> bool:
        for directory in self.cgroup.directories if self.cgroup else ():
            for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
                with contextlib.suppress(OSError, ValueError):
                    for line in (directory / name).read_text().splitlines():
                        field, _, value = line.partition(" ")
                        if field == key and int(value) > 0:
                            return True
        return False

    # -- writing --------------------------------------------------------------------------

    def send(self, frame: dict[str, Any]) -> None:
        """Write one frame; a wake (abort, the budget) or the runner's end stops the write
        as a `TransportFailure`, which the caller turns into the episode's ending."""
        data = memoryview(json.dumps(frame).encode("utf-8") + b"\n")
        while data:
            try:
                written = os.write(self._input, data)
            except BlockingIOError:
                written = 0
            except (BrokenPipeError, OSError) as error:
                raise TransportFailure(f"could not send a frame to the runner: {error}") from error
            data = data[written:]
            if not data:
                return
            if self._wake in _ready([self._wake], [self._input], None):
                raise TransportFailure("sending a frame to the runner was interrupted")

    # -- ending ---------------------------------------------------------------------------

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)

    def kill(self) -> None:
        """End the sandbox at once: bubblewrap is killed, and with it (its children die
        with their parent, a PID namespace with its first process) everything inside."""
        with self._lock:
            if self._killed or self._closed:
                return
            self._killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.wake()

    def close(self) -> None:
        """Kill, reap, and free the pipes and the cgroup."""
        self.kill()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        os.close(self._wake)
        if self.cgroup is not None and not self.cgroup.remove():
            log.warning("a runner's cgroup %s was not empty in time; a later start removes it",
                        self.cgroup.directories)

    def alive(self) -> bool:
        return self.process.poll() is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _start_runner(runtime: PythonRuntime, settings: SandboxSettings,
                  started: Callable[[_Runner], None] = lambda runner: None) -> _Runner:
    """A started runner that said hello; `started` is told of it as soon as it exists (to
    be killed or woken while it starts). A start that lost the kernel's race for a new
    network namespace's loopback (bubblewrap 0.8, concurrent starts) is tried again."""
    for attempt in range(_LAUNCH_ATTEMPTS):
        runner = _Runner.start(runtime, settings.profile)
        started(runner)
        problem = runner.greeted(_START_TIMEOUT_S)
        if problem is None:
            return runner
        runner.close()
        if "bwrap: loopback" not in problem or attempt == _LAUNCH_ATTEMPTS - 1:
            raise TransportFailure(f"starting the sandbox failed: {problem}")
    raise AssertionError("unreachable")


# -- a pool of ready runners ----------------------------------------------------------------


class _Pool:
    """Runners started ahead of their episodes, at most `size`, for one settings.

    Starts run in one daemon thread that lives as long as the process: a runner dies with
    the thread that started it. `take` never waits for a start."""

    def __init__(self, runtime: PythonRuntime, settings: SandboxSettings) -> None:
        self._runtime = runtime
        self._settings = settings
        self._ready: list[_Runner] = []
        self._wanted = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._fill, daemon=True, name="wmo-trio-sandbox-pool").start()

    def take(self) -> _Runner | None:
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
                runner = _start_runner(self._runtime, self._settings)
            except Exception:
                failures += 1
                log.warning("starting a pooled sandbox runner failed", exc_info=failures == 1)
                if failures >= _LAUNCH_ATTEMPTS:
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
        self._runner: _Runner | None = None

    closing_stops = True

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

    def _start(self) -> _Runner:
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
                return _start_runner(python_runtime(), self.settings, self._hold)
            except OSError as error:
                raise TransportFailure(f"starting the sandbox failed: {error}") from error
            finally:
                _STARTS.release()

    def _hold(self, runner: _Runner) -> None:
        with self._lock:
            previous, self._runner = self._runner, runner
        if previous is not None:  # a start tried again
            previous.close()
        if self.stopping():  # aborted while it started
            runner.kill()


def _ready(readable: list[int], writable: list[int], timeout: float | None) -> set[int]:
    """The descriptors ready among `readable` and `writable` (an end or an error counts as
    ready: the read or write that follows says which), within `timeout` seconds."""
    poller = select.poll()
    for fd in readable:
        poller.register(fd, select.POLLIN)
    for fd in writable:
        poller.register(fd, select.POLLOUT)
    milliseconds = None if timeout is None else max(0, int(timeout * 1000) + 1)
    return {fd for fd, _ in poller.poll(milliseconds)}
