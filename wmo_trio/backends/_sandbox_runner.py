"""One runner of the sandbox backend (`wmo_trio.backends._sandbox`): bubblewrap and the
episode's program in it, its frames on pipes, and the Python runtime it is given.

A runner's sandbox is built from the profile the backend's settings make (a trial's,
tightened); its cgroup is joined before bubblewrap starts, so every process of the
sandbox is in it. Everything read from a runner is bounded: a line by
`MAX_FRAME_BYTES`, its stderr by the tail kept. Its lifetime is a `with` block (or
`close`): killed, reaped, its pipes and cgroup let go, in that order.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import IO, Any, Self

from wmo_trio.backends._frames import MAX_FRAME_BYTES, WAKE, Exited, TransportFailure, ended_early
from wmo_trio.sandbox import (
    LAUNCH_ATTEMPTS,
    Bind,
    Profile,
    TrialCgroup,
    bwrap_argv,
    launch_argv,
    launch_output,
    lost_loopback_race,
)

__all__ = ["START_TIMEOUT_S", "Once", "PythonRuntime", "Runner", "python_runtime", "start_runner"]

RUNNER_SOURCE = resources.files("wmo_trio.episode").joinpath("portable.py").read_bytes()
_CHUNK = 1 << 16
_STDERR_TAIL_CHARS = 2000
# How long a runner whose frame stream ended may take to exit before it is killed.
_EXIT_PATIENCE_S = 2.0
# How long the availability probe, or a pooled runner's start, may take.
START_TIMEOUT_S = 30.0


class Once[T]:
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


@Once
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


@Once
def _runner_script() -> int:
    """A sealed in-memory file holding `portable.py`, passed to every runner by number."""
    fd = os.memfd_create("wmo-trio-runner", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, RUNNER_SOURCE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
                | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


# -- one runner -----------------------------------------------------------------------------


class Runner:
    """One runner: bubblewrap and the program in it, its frames on pipes.

    `next` and `send` belong to the thread that serves the episode; `kill` and `wake` may
    come from any thread; `close` (kill, reap, free) from the thread that serves it, or
    the end of a `with runner:` block there.
    """

    def __init__(self, process: subprocess.Popen[bytes], cgroup: TrialCgroup,
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
        # Let go by close, in the reverse order: the process reaped (once killed), its
        # pipes and the wake-up closed, its cgroup removed (once its processes are gone).
        self._owned = contextlib.ExitStack()
        self._owned.enter_context(cgroup)
        self._owned.callback(os.close, self._wake)
        for stream in (process.stdin, process.stdout, process.stderr):
            self._owned.callback(_close_quietly, stream)
        self._owned.callback(process.wait)
        self._buffer = bytearray()
        self._scanned = 0
        self._pending: list[str] = []
        self._ended: Exited | None = None
        self._stderr = ""
        self._killed = False
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def start(cls, runtime: PythonRuntime, profile: Profile) -> Runner:
        """Start one runner in a sandbox of `profile`. The script is read from a
        descriptor, the episode from stdin."""
        script = _runner_script()
        with contextlib.ExitStack() as on_fail, contextlib.ExitStack() as descriptors:
            cgroup = on_fail.enter_context(TrialCgroup.create(profile.limits))
            bwrap, inherited = bwrap_argv(
                profile, descriptors, hostname="sandbox", chdir="/tmp",
                binds=[Bind(source, target, read_only=True) for source, target in runtime.binds],
                hidden=runtime.masked,
                command=[runtime.interpreter, "-I", "-S", f"/proc/self/fd/{script}", "-"])
            process = subprocess.Popen(
                launch_argv(bwrap, cgroup_procs=cgroup.procs_files),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(script, *inherited),
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, start_new_session=True,
            )
            on_fail.pop_all()
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
        while self._ended is None:
            line = self._line()
            if line is not None:
                return line
            if len(self._buffer) > MAX_FRAME_BYTES:
                self._ended = Exited(None, f"the runner wrote over {MAX_FRAME_BYTES} bytes "
                                           "without ending a frame")
                self._buffer = bytearray()
            elif not self._read_more(timeout):
                return WAKE
        return self._ended

    def _read_more(self, timeout: float | None) -> bool:
        """Wait for the runner's output and read what came (its stderr too, and its
        end); False when woken, or `timeout` passed, first."""
        errors = () if self._errors is None else (self._errors,)
        ready = _ready([self._output, self._wake, *errors], [], timeout)
        if not ready:
            return False
        if self._errors is not None and self._errors in ready:
            self._read_stderr()
        if self._wake in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake)
            return False
        if self._output in ready:
            try:
                chunk = os.read(self._output, _CHUNK)
            except BlockingIOError:
                return True
            if chunk:
                self._buffer += chunk
            else:
                self._ended = self._exited()
        return True

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
        why = (f" (killed at its memory ceiling of {self.memory_mb} MiB)"
               if self.cgroup.oom_kills() else "")
        return ended_early(exited, "\n".join(launch_output(self._stderr)), why)

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
        self._owned.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_runner(runtime: PythonRuntime, profile: Profile,
                 started: Callable[[Runner], None] = lambda runner: None) -> Runner:
    """A started runner that said hello; `started` is told of it as soon as it exists (to
    be killed or woken while it starts). A start that lost bubblewrap's race for a
    loopback address is tried again."""
    for attempt in range(LAUNCH_ATTEMPTS):
        runner = Runner.start(runtime, profile)
        started(runner)
        problem = runner.greeted(START_TIMEOUT_S)
        if problem is None:
            return runner
        runner.close()
        if not lost_loopback_race(problem) or attempt == LAUNCH_ATTEMPTS - 1:
            raise TransportFailure(f"starting the sandbox failed: {problem}")
    raise AssertionError("unreachable")


def _close_quietly(stream: IO[bytes]) -> None:
    with contextlib.suppress(OSError):
        stream.close()


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
