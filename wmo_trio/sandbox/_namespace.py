"""A sandbox's lifetime: bubblewrap's namespaces around its overlay root, the helper
that runs in them as PID 1, its user-mode network, and its end.

``util-linux``'s ``unshare`` gives the launch a private mount namespace in which the
overlays are mounted (bubblewrap 0.8 has no overlay option: see ``_overlay``), so no
mount is ever visible on the host and all of them vanish with the sandbox's last
process. bubblewrap then pivots into that root as the sandbox's profile says
(``_profile.TRIAL_PROFILE``: fresh PID, IPC, UTS, network and cgroup namespaces,
Docker's masks and capabilities less ``CAP_MKNOD``, its system-call filter, a keyring
of its own); the helper (``_helper``) runs there as PID 1 and starts every command
(``_processes``). With ``--die-with-parent`` the whole sandbox is killed when the
process that started it dies. Its network stack, slirp4netns, runs in a sandbox of its
own (``_network``).

A :class:`Sandbox` is launched into a state directory its owner holds (``_state``),
and ends in two steps, each an exit stack that the launch fills as it goes, so a
launch that fails halfway ends exactly what it had started: every process of the
sandbox ends (:meth:`Sandbox.stop`), then the kernel's leftovers are let go
(:meth:`Sandbox.finish`), which waits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from wmo_trio.sandbox import _profile, _storage
from wmo_trio.sandbox._cgroup import TrialCgroup
from wmo_trio.sandbox._errors import SandboxUnavailableError, unavailable
from wmo_trio.sandbox._hostfs import read_tail, remove_tree
from wmo_trio.sandbox._network import NetworkStack
from wmo_trio.sandbox._overlay import SCRATCH, SandboxRoot, prepare_root
from wmo_trio.sandbox._processes import Channel, read_pipe
from wmo_trio.sandbox._state import StateDir
from wmo_trio.sandbox._threads import made_in_thread

__all__ = ["Sandbox", "helper_program", "missing_tools"]

# Bounds a hang only: a start takes milliseconds, but seconds on a saturated machine.
START_TIMEOUT_SEC = 120.0
STOP_TIMEOUT_SEC = 10.0
LAUNCH_LOG = "launch.log"  # in the state directory
LAUNCH_LOG_TAIL = 64 << 10
HELPER = Path(__file__).with_name("_helper.py")


def missing_tools() -> str | None:
    """Why this machine cannot host a sandbox, or None."""
    if not os.path.isdir("/proc/self"):
        return "/proc is not mounted"
    if os.uname().sysname != "Linux":
        return f"it runs on {os.uname().sysname}, not Linux"
    if os.geteuid() != 0:
        return "it runs as root only (it mounts overlays), and this process is not root"
    missing = [tool for tool in ("unshare", "mount", "bwrap", "slirp4netns", "keyctl", "tar")
               if shutil.which(tool) is None]
    if missing:
        return "missing " + ", ".join(missing) + " on PATH"
    return (_profile.profile_problem(_profile.TRIAL_PROFILE)
            or _profile.profile_problem(_profile.NETWORK_STACK_PROFILE))


class Sandbox:
    """A running sandbox: bubblewrap, its helper as PID 1, its cgroup, and its network
    stack. Its lifetime is an ``async with`` block (or :meth:`launch` to :meth:`stop`);
    its state directory is its owner's."""

    def __init__(self, state: StateDir, cgroup: TrialCgroup) -> None:
        self.state = state
        self.cgroup = cgroup
        self.stopped = False
        self.network: NetworkStack | None = None
        # Ended by stop, in the reverse of the launch's order: what runs in the sandbox.
        self._running = contextlib.AsyncExitStack()
        # Let go by finish, once nothing runs: the launch's and the sandbox's mount
        # namespaces (held so that the processes' exits need not unmount the overlays)
        # and slirp4netns's exit.
        self._leftovers: contextlib.ExitStack | None = contextlib.ExitStack()
        # Set by the launch.
        self.process: asyncio.subprocess.Process
        self.channel: Channel
        self.helper_pid: int
        self._helper_pidfd: int  # names the helper itself, never a later process of its pid

    @property
    def upper(self) -> Path:
        """Where everything the sandbox wrote is: one directory per overlay (a sandbox
        without ``storage_bytes``: a build's)."""
        return self.state.path / "upper"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @classmethod
    async def launch(cls, state: StateDir, root: SandboxRoot, *, hostname: str,
                     network: bool, profile: _profile.Profile = _profile.TRIAL_PROFILE) -> Sandbox:
        """Mount ``root`` in ``state``, start bubblewrap and its helper there as
        ``profile`` says and, with ``network``, a slirp4netns stack for its network
        namespace; every process of the sandbox runs in a cgroup of its own that holds
        them to ``profile.limits`` (where this machine offers cgroups: see ``_cgroup``).

        A start that lost bubblewrap's race for a loopback address is tried again. If
        this fails or is cancelled, whatever was started is stopped again; the state
        directory is the caller's to remove.
        """
        reason = missing_tools()
        if reason is not None:
            raise unavailable(reason)
        for attempt in range(_profile.LAUNCH_ATTEMPTS):
            try:
                return await cls._launch(state, root, hostname=hostname, network=network,
                                         profile=profile)
            except SandboxUnavailableError as error:
                if not _profile.lost_loopback_race(str(error)) or attempt == _profile.LAUNCH_ATTEMPTS - 1:
                    raise
                await asyncio.to_thread(_clear_scratch, state)
        raise AssertionError("unreachable")

    @classmethod
    async def _launch(cls, state: StateDir, root: SandboxRoot, *, hostname: str,
                      network: bool, profile: _profile.Profile) -> Sandbox:

        def prepare() -> tuple[str, bytes]:
            # One hop to a thread for both: each hop is a wait for the loop.
            return prepare_root(state.path, root), helper_program()

        mount, program = await asyncio.to_thread(prepare)
        cgroup = await made_in_thread(functools.partial(TrialCgroup.create, profile.limits),
                                      TrialCgroup.close)
        sandbox = cls(state, cgroup)
        try:
            if cgroup.directories:
                sandbox._running.push_async_callback(asyncio.to_thread, cgroup.close)
            await sandbox._start(mount, program, profile, hostname=hostname, binds=root.binds)
            if network:
                await sandbox._start_network()
            try:
                async with asyncio.timeout(START_TIMEOUT_SEC):
                    await sandbox.channel.wait_ready()
            except TimeoutError:
                raise unavailable(
                    f"the sandbox was not ready within {START_TIMEOUT_SEC:g} s") from None
            except RuntimeError:
                raise unavailable(await sandbox._launch_failure()) from None
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox

    async def _start(self, mount: str, program: bytes, profile: _profile.Profile, *, hostname: str,
                     binds: Sequence[_profile.Bind]) -> None:
        """Start bubblewrap in the cgroup, with the helper as its PID 1; each process
        and descriptor that outlives the start is pushed on ``_running``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._running.callback(ours.close)  # the channel's, once it is made
        with contextlib.ExitStack() as launching, contextlib.ExitStack() as inherited:
            # What the launch inherits is closed once it started (or failed to).
            inherited.callback(theirs.close)
            info_read, info_write = os.pipe()
            launching.callback(os.close, info_read)
            inherited.callback(os.close, info_write)
            helper_fd = _read_only_memfd(program)
            inherited.callback(os.close, helper_fd)
            bwrap, pass_fds = _profile.bwrap_argv(
                profile, inherited, root=str(self.state.path / "root"), hostname=hostname,
                binds=binds, info_fd=info_write,
                command=["python3", "-I", "-S", f"/proc/self/fd/{helper_fd}"])
            log = os.open(self.state.path / LAUNCH_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                          0o600)
            inherited.callback(os.close, log)
            self.process = await asyncio.create_subprocess_exec(
                "unshare", "--mount", "--propagation", "private",
                *_profile.launch_argv(bwrap, before=mount, cgroup_procs=self.cgroup.procs_files),
                stdin=theirs.fileno(), stdout=asyncio.subprocess.DEVNULL, stderr=log,
                pass_fds=(helper_fd, *pass_fds, self.state.lock_fd),
                # Its own session: a Ctrl-C at harbor's terminal must not end the
                # sandbox before harbor's own shutdown stops it.
                start_new_session=True, env={"PATH": _profile.DEFAULT_PATH},
            )
            self._running.push_async_callback(_end, self.process)
            inherited.close()
            self.channel = Channel(ours)
            self._running.push_async_callback(self.channel.close)
            self.helper_pid = await self._read_child_pid(info_read)
        try:
            self._helper_pidfd = os.pidfd_open(self.helper_pid)
        except ProcessLookupError:
            raise unavailable(await self._launch_failure()) from None
        self._running.callback(self._kill_helper)
        assert self._leftovers is not None
        _hold_mount_namespaces(self._leftovers, self.process.pid, self.helper_pid,
                               self._helper_pidfd)

    async def _start_network(self) -> None:
        """slirp4netns for the sandbox's network namespace (see ``_network``)."""
        netns = self._open_namespace("net")
        try:
            self.network = network = NetworkStack.start(netns)
        finally:
            os.close(netns)
        assert self._leftovers is not None
        self._leftovers.callback(network.reap)
        # slirp4netns ends while the namespace does, not after it.
        self._running.callback(network.tell_to_exit)
        await network.wait_ready()

    def _kill_helper(self) -> None:
        # Killed rather than told: it need not be scheduled to see its socket close and
        # run its interpreter's exit before the kernel ends the rest.
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._helper_pidfd, signal.SIGKILL)
        os.close(self._helper_pidfd)

    def _helper_gone(self) -> bool:
        return bool(select.select([self._helper_pidfd], [], [], 0)[0])

    def open_root(self) -> int:
        """A descriptor of the sandbox's root as its processes see it, mounts included
        (see ``_hostfs`` for how to walk it). Raises ``RuntimeError`` once the sandbox
        is stopped or its helper is gone."""
        if self.stopped:
            raise RuntimeError("the sandbox is stopped")
        fd = os.open(f"/proc/{self.helper_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        # Checked after the open: had the helper died before it, its pid may have named
        # another process, whose root this would be.
        if self._helper_gone():
            os.close(fd)
            raise RuntimeError("the sandbox's processes are gone")
        return fd

    def _open_namespace(self, kind: str) -> int:
        """A descriptor of the helper's namespace ``kind``; raises ``RuntimeError`` once
        the helper is gone (its pid could name another process by then)."""
        fd = os.open(f"/proc/{self.helper_pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        if self._helper_gone():
            os.close(fd)
            raise RuntimeError("the sandbox's processes are gone")
        return fd

    async def death(self) -> str:
        """Why the sandbox's helper is gone, for an error once its channel closed
        unasked: how its PID 1 ended and whether the kernel killed for want of
        memory in the trial."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_SEC):
                await self.process.wait()
        code = self.process.returncode
        # bubblewrap exits with its PID 1's status, 128 + the signal that killed it.
        if code is None:
            ended = "its helper (PID 1) closed its channel"
        elif code > 128 and code - 128 in set(signal.Signals):
            ended = f"its helper (PID 1) was killed by {signal.Signals(code - 128).name}"
        else:
            ended = f"its helper (PID 1) exited with status {code}"
        oom = await asyncio.to_thread(self.cgroup.oom_kills)
        if oom:
            ended += (f"; the kernel killed {oom} process(es) of the trial for want of memory "
                      "(memory_mb is its ceiling, and files in /dev/shm and other in-memory "
                      "filesystems count against it)")
        return "the trial's sandbox died: " + ended

    async def stop(self, linger: bool = False) -> None:
        """End every process of the sandbox (the helper's death, as PID 1, ends its PID
        namespace) and its network stack, then let go of the kernel's leftovers
        (:meth:`finish`). Its state directory is left to its owner. Idempotent.

        Unmounting the overlays and removing slirp4netns's network device wait for the
        kernel (RCU grace periods, tens of ms on a busy machine). The sandbox's mount
        namespaces are held meanwhile, so its processes end without unmounting. With
        ``linger``, neither is waited for once no process of the sandbox runs: the
        namespaces stay held (mounted in no process's namespace) and slirp4netns's exit
        unreaped until :meth:`finish`, which the caller may leave to a thread (see
        :meth:`take_leftovers`)."""
        if not self.stopped:
            self.stopped = True
            await self._running.aclose()
        if not linger and self._leftovers is not None:
            await asyncio.to_thread(self.finish)

    def take_leftovers(self) -> contextlib.ExitStack:
        """What :meth:`finish` would let go, for the caller to close (in a thread: it
        waits); the sandbox then has none."""
        leftovers, self._leftovers = self._leftovers, None
        return leftovers if leftovers is not None else contextlib.ExitStack()

    def finish(self) -> None:
        """Wait for slirp4netns's exit and let the kernel unmount the overlays, once
        the sandbox is stopped; blocks until both are done."""
        self.take_leftovers().close()

    def keep_changes(self) -> Path:
        """Keep what the stopped sandbox wrote (its upper directories) as
        ``kept-<name>/`` beside its state directory, out of reach of the sweep, and drop
        the rest; where it is (with ``storage_bytes``, the filesystem image whose
        ``upper/`` it holds). Blocks."""
        kept = self.state.keep(drop=("work", "root", "hidden", LAUNCH_LOG, _storage.TOP))
        return kept / _storage.IMAGE if (kept / _storage.IMAGE).exists() else kept

    async def _read_child_pid(self, info_read: int) -> int:
        try:
            async with asyncio.timeout(START_TIMEOUT_SEC):
                info = await read_pipe(info_read, limit=1 << 16)
        except TimeoutError:
            raise unavailable(
                f"the sandbox did not start within {START_TIMEOUT_SEC:g} s") from None
        try:
            return int(json.loads(info)["child-pid"])
        except (ValueError, KeyError, TypeError):
            raise unavailable(await self._launch_failure()) from None

    async def _launch_failure(self) -> str:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_SEC):
                await self.process.wait()
        # The sandbox's processes can write to this log: only its tail is read.
        tail = await asyncio.to_thread(read_tail, self.state.path / LAUNCH_LOG, LAUNCH_LOG_TAIL)
        lines = _profile.launch_output(tail.decode(errors="replace"))
        return "the sandbox did not start: " + (lines[-1] if lines else "no error was printed")


def _clear_scratch(state: StateDir) -> None:
    """Remove what a failed launch made in the state directory, before the next try."""
    for scratch in SCRATCH:
        remove_tree(state.path / scratch)


def _hold_mount_namespaces(leftovers: contextlib.ExitStack, launcher: int, helper: int,
                           helper_pidfd: int) -> None:
    """Hold the launch's mount namespace (the overlays' first) and the sandbox's until
    ``leftovers`` closes; neither if either process is gone (its pid could name
    another's)."""
    with contextlib.ExitStack() as held:
        try:
            for pid in (launcher, helper):
                held.callback(os.close, os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return
        # The launcher is this process's child, not yet waited for: its pid is its own.
        if select.select([helper_pidfd], [], [], 0)[0]:
            return
        leftovers.enter_context(held.pop_all())


async def _end(process: asyncio.subprocess.Process) -> None:
    """Wait for a sandbox process to exit; SIGKILL its process group if it lingers."""
    try:
        async with asyncio.timeout(STOP_TIMEOUT_SEC):
            await process.wait()
            return
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


# Run by the host's own python3: the helper's code object, marshalled after the magic
# number of the interpreter that compiled it.
_COMPILE = ("import marshal, sys; from _frozen_importlib_external import MAGIC_NUMBER; "
            "sys.stdout.buffer.write(MAGIC_NUMBER + marshal.dumps(compile("
            "sys.stdin.buffer.read(), '_helper.py', 'exec')))")
# What bubblewrap's python3 runs: the compiled helper when it is this interpreter's
# bytecode, else its source.
_BOOTSTRAP = """\
import marshal
from binascii import a2b_base64
from _frozen_importlib_external import MAGIC_NUMBER
COMPILED = a2b_base64({compiled!r})
if COMPILED[:len(MAGIC_NUMBER)] == MAGIC_NUMBER:
    exec(marshal.loads(COMPILED[len(MAGIC_NUMBER):]))
else:
    exec(compile({source!r}, "_helper.py", "exec"))
"""


@functools.cache
def helper_program() -> bytes:
    """The helper as bubblewrap's ``python3 -I -S`` runs it. Compiling the helper's
    source is most of its start after the interpreter's own, so the host's python3
    (the one a sandbox finds unless its image brings its own) compiles it once per
    process; a sandbox's python3 of another version compiles the source itself."""
    source = HELPER.read_bytes()
    compiled = b""
    python = shutil.which("python3", path=_profile.DEFAULT_PATH)
    if python is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            completed = subprocess.run([python, "-I", "-S", "-c", _COMPILE], input=source,
                                       capture_output=True, timeout=STOP_TIMEOUT_SEC, env={})
            if completed.returncode == 0:
                compiled = completed.stdout
    return _BOOTSTRAP.format(compiled=base64.b64encode(compiled).decode(),
                             source=source.decode()).encode()


def _read_only_memfd(data: bytes) -> int:
    """A read-only descriptor of a new in-memory file holding ``data``."""
    writable = os.memfd_create("wmo-trio-helper", os.MFD_CLOEXEC)
    try:
        os.write(writable, data)
        return os.open(f"/proc/self/fd/{writable}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(writable)
