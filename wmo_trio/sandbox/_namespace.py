"""A sandbox's lifecycle: its private state directory, its overlay root, the bubblewrap
namespace around it, its user-mode network, and its removal.

``util-linux``'s ``unshare`` gives the launch a private mount namespace in which the
overlays are mounted (bubblewrap 0.8 has no overlay option), so no mount is ever visible
on the host and all of them vanish with the sandbox's last process. bubblewrap then
pivots into that root as the trial's profile says (``_profile.TRIAL_PROFILE``: fresh PID, IPC,
UTS, network and cgroup namespaces, Docker's masks and capabilities less ``CAP_MKNOD``,
its system-call filter, a keyring of its own); the helper runs there as PID 1. With
``--die-with-parent`` the whole sandbox is killed when the process that started it dies.
Its network stack, slirp4netns, runs in a sandbox of its own (``_profile.NETWORK_STACK_PROFILE``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wmo_trio.sandbox import _storage
from wmo_trio.sandbox._cgroup import Limits, TrialCgroup
from wmo_trio.sandbox._hostfs import read_tail, remove_or_set_aside, remove_tree
from wmo_trio.sandbox._processes import Channel, wait_readable
from wmo_trio.sandbox._profile import (
    DEFAULT_PATH,
    NETWORK_STACK_PROFILE,
    TRIAL_PROFILE,
    Bind,
    bwrap_argv,
    launch_argv,
    profile_problem,
)
from wmo_trio.sandbox._rootfs import HostLayers, make_hiding_layer

__all__ = ["DEFAULT_PATH", "Bind", "Sandbox", "SandboxUnavailableError", "StateDir",
           "remove_stale_states", "wait_for_removals"]

# Bounds a hang only: a start takes milliseconds, but seconds on a saturated machine.
START_TIMEOUT_SEC = 120.0
STOP_TIMEOUT_SEC = 10.0
LAUNCH_ATTEMPTS = 3
LAUNCH_LOG_TAIL = 64 << 10
HELPER = Path(__file__).with_name("_helper.py")
_UNSAFE_OVERLAY_PATH = re.compile(r"[,:\\\s]")


class SandboxUnavailableError(RuntimeError):
    """This machine cannot run the docker-free environment; the message says what is
    missing and what to do."""


def unavailable(reason: str) -> SandboxUnavailableError:
    return SandboxUnavailableError(
        f"LocalEnvironment cannot run on this machine: {reason}. It needs Linux, root, "
        "overlayfs, util-linux (unshare, mount), bubblewrap, slirp4netns, keyutils (keyctl) "
        "and libseccomp (`make test` installs the last four with apt-get). "
        "Use harbor's Docker environment instead (-e docker)."
    )


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
    return profile_problem(TRIAL_PROFILE) or profile_problem(NETWORK_STACK_PROFILE)


@dataclass
class StateDir:
    """A sandbox's private directory on the host, kept while its lock file is locked.

    The lock (``<name>.lock`` beside the directory) is held by the process that owns
    the sandbox and by the sandbox itself; once all of them are gone, any later start
    may remove the directory (:func:`remove_stale_states`).
    """

    path: Path
    lock_path: Path
    lock_fd: int
    removing: bool = False  # handed to remove_later

    @classmethod
    def create(cls, root: Path, name: str) -> StateDir:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        prefix = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:60]
        while True:
            path = root / f"{prefix}.{uuid.uuid4().hex[:10]}"
            lock_path = path.with_name(path.name + ".lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A cleaner may have taken the lock file between its creation and our lock.
            if same_file(fd, lock_path):
                break
            os.close(fd)
        path.mkdir(mode=0o700)
        return cls(path, lock_path, fd)

    def remove(self) -> None:
        """Remove the directory (what will not go is set aside, never left in the
        way) and its lock file; then release the lock."""
        try:
            remove_or_set_aside(self.path, logging.getLogger(__name__))
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()
        finally:
            os.close(self.lock_fd)

    def remove_later(self, first: Callable[[], None] | None = None) -> None:
        """:meth:`remove` in a thread of its own, once nothing runs in the sandbox any
        more: a trial's stop need not wait for its files to go. The lock is held till
        they are gone, so no other start takes the directory for a stale one; the
        interpreter waits for the thread at its exit (as does :func:`wait_for_removals`),
        and a process killed meanwhile leaves the rest to a later start. ``first`` runs
        in the thread before the removal."""

        def remove() -> None:
            try:
                if first is not None:
                    first()
                self.remove()
            except OSError as error:
                logging.getLogger(__name__).warning(
                    "could not remove the sandbox directory %s: %s", self.path, error)
            finally:
                with _REMOVING_LOCK:
                    _REMOVING.discard(thread)

        self.removing = True
        thread = threading.Thread(target=remove, name=f"remove {self.path.name}", daemon=False)
        with _REMOVING_LOCK:
            _REMOVING.add(thread)
        thread.start()


# The threads of StateDir.remove_later still running.
_REMOVING: set[threading.Thread] = set()
_REMOVING_LOCK = threading.Lock()


def wait_for_removals() -> None:
    """Wait until every state directory this process is removing in the background is
    gone (or failed to go, with a warning)."""
    while True:
        with _REMOVING_LOCK:
            pending = next(iter(_REMOVING), None)
        if pending is None:
            return
        pending.join()
        with _REMOVING_LOCK:
            _REMOVING.discard(pending)


def same_file(fd: int, path: Path) -> bool:
    try:
        held, named = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def remove_stale_states(root: Path) -> list[Path]:
    """Remove state directories whose owners all died (e.g. a SIGKILLed harbor); safe
    while other jobs run, since live sandboxes hold their locks. What will not go is
    set aside (``remove_or_set_aside``): no leftover fails a later start."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for lock_path in root.glob("*.lock"):
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if not same_file(fd, lock_path):
                continue
            directory = lock_path.with_suffix("")
            try:
                remove_or_set_aside(directory, logging.getLogger(__name__))
                lock_path.unlink()
            except OSError as error:  # tried again by the next start
                logging.getLogger(__name__).warning(
                    "could not remove the stale sandbox directory %s: %s", directory, error)
                continue
            removed.append(directory)
        finally:
            os.close(fd)
    return removed


def _overlay_options(lower: Sequence[str], upper: Path, work: Path, state: Path,
                     layers: dict[str, str]) -> str:
    """The overlay's options, every path in them relative to ``state`` (where mount(8)
    runs): a trial's /proc/self/mountinfo shows them, as Docker's shows its own, and
    they name no host path. A lower directory is named by a link of ``state``'s
    ``layers/`` (``layers`` maps each path to its link, made on first use)."""
    for path in [*lower, str(upper), str(work)]:
        if _UNSAFE_OVERLAY_PATH.search(path):
            raise unavailable(f"the path {path} holds a character overlayfs options cannot "
                              "carry (comma, colon, backslash or space); choose other "
                              "state_dir and cache_dir")
    for path in lower:
        if path not in layers:
            layers[path] = f"layers/{len(layers)}"
            (state / "layers").mkdir(exist_ok=True)
            os.symlink(path, state / layers[path])
    names = ":".join(layers[path] for path in lower)
    return (f"lowerdir={names},upperdir={upper.relative_to(state)},"
            f"workdir={work.relative_to(state)}")


@dataclass
class Sandbox:
    """A running sandbox: bubblewrap, its helper, and its network stack."""

    process: asyncio.subprocess.Process
    channel: Channel
    helper_pid: int
    state: StateDir
    # Not asyncio's: a stop may leave its exit to a thread (see stop).
    network: subprocess.Popen[bytes] | None = None
    network_exit_fd: int | None = None
    cgroup: TrialCgroup | None = None
    stopped: bool = field(default=False)
    # Names the helper itself, never a later process given its pid.
    helper_pidfd: int = -1
    # The launch's and the sandbox's mount namespaces, held so that the processes'
    # exits need not unmount the overlays (see stop).
    mount_namespaces: list[int] = field(default_factory=list)

    @property
    def upper(self) -> Path:
        """Where everything the sandbox wrote is: one directory per overlay (a sandbox
        without ``storage_bytes``: a build's)."""
        return self.state.path / "upper"

    @classmethod
    async def launch(cls, **options: Any) -> Sandbox:
        """Start a sandbox (see :meth:`_launch`). bubblewrap 0.8 now and then fails to
        give a new network namespace its loopback address (the kernel answers ECHILD
        under concurrent starts); such a start is tried again."""
        for attempt in range(LAUNCH_ATTEMPTS):
            try:
                return await cls._launch(**options)
            except SandboxUnavailableError as error:
                if "bwrap: loopback:" not in str(error) or attempt == LAUNCH_ATTEMPTS - 1:
                    raise
                for scratch in ("upper", "work", "root", "hidden", "layers", _storage.TOP,
                                _storage.IMAGE):
                    await asyncio.to_thread(remove_tree, options["state"].path / scratch)
        raise AssertionError("unreachable")

    @classmethod
    async def _launch(
        cls,
        *,
        state: StateDir,
        host: HostLayers,
        image_layer: Path | None,
        network: bool,
        hostname: str,
        binds: Sequence[Bind] = (),
        etc_files: dict[str, str] | None = None,
        limits: Limits | None = None,
        shm_bytes: int = TRIAL_PROFILE.shm_bytes,
        storage_bytes: int | None = None,
    ) -> Sandbox:
        """Mount the root in ``state``, start bubblewrap and its helper there and, with
        ``network``, a slirp4netns stack for its network namespace; every process of
        the sandbox runs in a cgroup of its own that holds them to ``limits`` (where
        this machine offers cgroups: see ``_cgroup``). ``/dev/shm`` holds ``shm_bytes``;
        with ``storage_bytes``, what the sandbox writes is held to that (see ``_storage``).

        If this fails or is cancelled, whatever was started is stopped again; the state
        directory is the caller's to remove.
        """
        reason = missing_tools()
        if reason is not None:
            raise unavailable(reason)
        root = state.path / "root"

        def prepare() -> tuple[str, bytes]:
            # One hop to a thread for both: each hop is a wait for the loop.
            return (_prepare_root(state, host, image_layer, binds, etc_files or {},
                                  storage_bytes),
                    helper_program())

        mount, program = await asyncio.to_thread(prepare)
        profile = dataclasses.replace(TRIAL_PROFILE, limits=limits or Limits(), shm_bytes=shm_bytes)
        process: asyncio.subprocess.Process | None = None
        channel: Channel | None = None
        sandbox: Sandbox | None = None
        cgroup: TrialCgroup | None = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # What the launch inherits: closed once it started, or when it failed to.
        inherited = contextlib.ExitStack()
        try:
            with contextlib.ExitStack() as launching:
                launching.enter_context(inherited)
                inherited.callback(theirs.close)
                info_read, info_write = os.pipe()
                launching.callback(os.close, info_read)
                inherited.callback(os.close, info_write)
                helper_fd = _read_only_memfd(program)
                inherited.callback(os.close, helper_fd)
                bwrap, pass_fds = bwrap_argv(
                    profile, inherited, root=str(root), hostname=hostname, binds=binds,
                    info_fd=info_write,
                    command=["python3", "-I", "-S", f"/proc/self/fd/{helper_fd}"])
                log = os.open(state.path / "launch.log",
                              os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                launching.callback(os.close, log)
                cgroup = await asyncio.to_thread(TrialCgroup.create, profile.limits)
                process = await asyncio.create_subprocess_exec(
                    "unshare", "--mount", "--propagation", "private",
                    *launch_argv(bwrap, before=mount,
                                 cgroup_procs=cgroup.procs_files if cgroup else ()),
                    stdin=theirs.fileno(), stdout=asyncio.subprocess.DEVNULL, stderr=log,
                    pass_fds=(helper_fd, *pass_fds, state.lock_fd),
                    # Its own session: a Ctrl-C at harbor's terminal must not end the
                    # sandbox before harbor's own shutdown stops it.
                    start_new_session=True, env={"PATH": DEFAULT_PATH},
                )
                inherited.close()
                channel = Channel(ours)
                helper_pid = await _read_child_pid(info_read, process, state)
            try:
                helper_pidfd = os.pidfd_open(helper_pid)
            except ProcessLookupError:
                raise unavailable(await _launch_failure(process, state)) from None
            sandbox = cls(process=process, channel=channel, helper_pid=helper_pid, state=state,
                          cgroup=cgroup, helper_pidfd=helper_pidfd)
            sandbox.mount_namespaces = _mount_namespaces(process.pid, helper_pid, helper_pidfd)
            if network:
                await sandbox._start_network()
            try:
                async with asyncio.timeout(START_TIMEOUT_SEC):
                    await channel.wait_ready()
            except TimeoutError:
                raise unavailable(
                    f"the sandbox was not ready within {START_TIMEOUT_SEC:g} s") from None
            except RuntimeError:
                raise unavailable(await _launch_failure(process, state)) from None
            return sandbox
        except BaseException:
            if sandbox is not None:
                await sandbox.stop()
            else:
                if channel is not None:
                    await channel.close()
                else:
                    ours.close()
                if process is not None:
                    await _end(process)
                if cgroup is not None:
                    await asyncio.to_thread(cgroup.remove)
            raise

    def open_root(self) -> int:
        """A descriptor of the sandbox's root as its processes see it, mounts included
        (see ``_hostfs`` for how to walk it). Raises ``RuntimeError`` once the sandbox
        is stopped or its helper is gone."""
        if self.stopped or self.helper_pidfd < 0:
            raise RuntimeError("the sandbox is stopped")
        fd = os.open(f"/proc/{self.helper_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        # Checked after the open: had the helper died before it, its pid may have named
        # another process, whose root this would be.
        if select.select([self.helper_pidfd], [], [], 0)[0]:
            os.close(fd)
            raise RuntimeError("the sandbox's processes are gone")
        return fd

    async def _start_network(self) -> None:
        """slirp4netns for the sandbox's network namespace, in a sandbox of its own
        (``NETWORK_STACK_PROFILE``), and in its own ``--enable-sandbox`` and
        ``--enable-seccomp`` within that once it is set up. It sees of the host's files
        only its programs (/usr), the loader's cache, the host's resolv.conf (its DNS
        forwarder reads it) and the tun device; the trial's network namespace is a
        descriptor this process opened."""
        ready_read, ready_write = os.pipe()
        try:
            with contextlib.ExitStack() as inherited:
                inherited.callback(os.close, ready_write)
                exit_read, exit_write = os.pipe()
                inherited.callback(os.close, exit_read)
                with contextlib.ExitStack() as kept:
                    kept.callback(os.close, exit_write)
                    netns = self._open_namespace("net")
                    inherited.callback(os.close, netns)
                    slirp, binds = _network_stack()
                    bwrap, pass_fds = bwrap_argv(
                        NETWORK_STACK_PROFILE, inherited, hostname="slirp4netns",
                        binds=binds, dirs=["/tmp", "/run"], command=[slirp, "--configure", "--mtu=65520",
                                 "--disable-host-loopback", "--enable-sandbox",
                                 "--enable-seccomp", f"--ready-fd={ready_write}",
                                 f"--exit-fd={exit_read}", "--netns-type=path",
                                 f"/proc/self/fd/{netns}", "tap0"])
                    # Popen returns once the program is exec'd, as asyncio's own start does.
                    self.network = subprocess.Popen(  # noqa: ASYNC220
                        launch_argv(bwrap), stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        pass_fds=(ready_write, exit_read, netns, *pass_fds),
                        start_new_session=True, env={"PATH": DEFAULT_PATH},
                    )
                    kept.pop_all()
                    self.network_exit_fd = exit_write
            ready = await _read_all(ready_read, limit=16)
        finally:
            os.close(ready_read)
        if not ready:
            assert self.network is not None and self.network.stderr is not None
            # It said nothing on its ready descriptor: it has exited, or is exiting.
            output = await asyncio.to_thread(self.network.stderr.read, LAUNCH_LOG_TAIL)
            lines = [line for line in output.decode(errors="replace").strip().splitlines()
                     if not line.startswith("Joined session keyring")]
            raise unavailable(f"slirp4netns could not give the sandbox a network: "
                              f"{lines[-1] if lines else 'it exited'}")

    def _open_namespace(self, kind: str) -> int:
        """A descriptor of the helper's namespace ``kind``; raises ``RuntimeError`` once
        the helper is gone (its pid could name another process by then)."""
        fd = os.open(f"/proc/{self.helper_pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        if self.helper_pidfd < 0 or select.select([self.helper_pidfd], [], [], 0)[0]:
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
        oom = None if self.cgroup is None else await asyncio.to_thread(self.cgroup.oom_kills)
        if oom:
            ended += (f"; the kernel killed {oom} process(es) of the trial for want of memory "
                      "(memory_mb is its ceiling, and files in /dev/shm and other in-memory "
                      "filesystems count against it)")
        return "the trial's sandbox died: " + ended

    async def stop(self, linger: bool = False) -> None:
        """End every process of the sandbox (the helper's death, as PID 1, ends its PID
        namespace) and its network stack. Its state directory is left to the caller.

        Unmounting the overlays and removing slirp4netns's network device wait for the
        kernel (RCU grace periods, tens of ms on a busy machine). The sandbox's mount
        namespaces are held meanwhile, so its processes end without unmounting. With
        ``linger``, neither is waited for once no process of the sandbox runs: the
        namespaces stay held (mounted in no process's namespace) and slirp4netns's exit
        unreaped until :meth:`finish`, which the caller may leave to a thread."""
        if self.stopped:
            return
        self.stopped = True
        if self.helper_pidfd >= 0:
            # Killed rather than told: it need not be scheduled to see its socket close
            # and run its interpreter's exit before the kernel ends the rest.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.helper_pidfd, signal.SIGKILL)
            os.close(self.helper_pidfd)
            self.helper_pidfd = -1
        await self.channel.close()
        # slirp4netns ends while the namespace does, not after it.
        if self.network_exit_fd is not None:
            os.close(self.network_exit_fd)
            self.network_exit_fd = None
        await _end(self.process)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        if not linger:
            await asyncio.to_thread(self.finish)

    @property
    def unfinished(self) -> bool:
        """A stop left something to :meth:`finish`."""
        return bool(self.mount_namespaces) or (self.network is not None
                                               and self.network.returncode is None)

    def finish(self) -> None:
        """Wait for slirp4netns's exit and let the kernel unmount the overlays, once
        the sandbox is stopped; blocks until both are done."""
        if self.network is not None:
            try:
                self.network.wait(timeout=STOP_TIMEOUT_SEC)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.network.pid, signal.SIGKILL)
                self.network.wait()
            if self.network.stderr is not None:
                self.network.stderr.close()
        held, self.mount_namespaces = self.mount_namespaces, []
        for fd in held:
            os.close(fd)


@functools.cache
def _network_stack() -> tuple[str, tuple[Bind, ...]]:
    """slirp4netns's path, and what its sandbox shows of the host: the program and the
    libraries it loads (/usr, and /lib* and /bin as the host has them: links into /usr
    or directories), the loader's cache, the resolver's configuration, read-only; the
    tun device."""
    program = os.path.realpath(shutil.which("slirp4netns", path=DEFAULT_PATH) or "slirp4netns")
    binds = [Bind("/usr", "/usr", read_only=True)]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            binds.append(Bind(os.readlink(top), top, link=True))
        elif os.path.isdir(top):
            binds.append(Bind(top, top, read_only=True))
    if not program.startswith("/usr/"):
        binds.append(Bind(program, program, read_only=True))
    for path in ("/etc/ld.so.cache", "/etc/resolv.conf"):
        if os.path.exists(path):
            binds.append(Bind(os.path.realpath(path), path, read_only=True))
    return program, (*binds, Bind("/dev/net/tun", "/dev/net/tun", device=True))


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
    python = shutil.which("python3", path=DEFAULT_PATH)
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


def _mount_namespaces(launcher: int, helper: int, helper_pidfd: int) -> list[int]:
    """Descriptors of the launch's mount namespace (the overlays' first) and the
    sandbox's; none if either process is gone (its pid could name another's)."""
    held: list[int] = []
    try:
        for pid in (launcher, helper):
            held.append(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass
    # The launcher is this process's child, not yet waited for: its pid is its own.
    if len(held) < 2 or select.select([helper_pidfd], [], [], 0)[0]:
        for fd in held:
            os.close(fd)
        return []
    return held


def _prepare_root(state: StateDir, host: HostLayers, image_layer: Path | None,
                  binds: Sequence[Bind], etc_files: dict[str, str],
                  storage_bytes: int | None = None) -> str:
    """Make the state's upper, work, hiding and mount-point directories, and the table
    of the overlays to mount (``fstab`` in the state directory; a parent before its
    children, the order ``mount --all`` keeps); the command that mounts them. With
    ``storage_bytes``, the upper and work directories are made in ``_storage.TOP`` and
    copied into a filesystem of that size, which the table mounts over them first."""
    base = state.path / _storage.TOP if storage_bytes is not None else state.path
    upper, work, root = base / "upper", base / "work", state.path / "root"
    hiding = state.path / "hidden"
    make_hiding_layer(hiding, host.hidden)
    mounts: list[str] = []
    layers: dict[str, str] = {}
    for name in ("", *host.system):
        (upper / (name or "_root")).mkdir(parents=True, exist_ok=True)
        (work / (name or "_root")).mkdir(parents=True, exist_ok=True)
        if name:
            lower = host.lower_dirs(name, hiding)
            if image_layer is not None and (image_layer / name).is_dir():
                lower.insert(0, str(image_layer / name))
        else:
            lower = [str(host.skeleton)]
            if image_layer is not None:
                lower.insert(0, str(image_layer / "_root"))
        options = _overlay_options(lower, upper / (name or "_root"), work / (name or "_root"),
                                   state.path, layers)
        mounts.append(f"overlay {root}/{name} overlay {options},nodev 0 0\n")
    root.mkdir(exist_ok=True)
    for bind in binds:
        # bubblewrap makes missing mount points mode 0700; Docker makes them 0755.
        top = bind.target.strip("/").split("/")[0]
        if top and top not in host.system:
            target = upper / "_root" / bind.target.strip("/")
            target.mkdir(mode=0o755, parents=True, exist_ok=True)
    for relative, text in etc_files.items():
        target = upper / "etc" / relative
        target.write_text(text)
    if storage_bytes is not None:  # made last: it copies what is prepared above
        mounts.insert(0, _storage.make(state.path, storage_bytes))
    # One table for one run of mount(8): a run per overlay costs a start of it each. It
    # runs in the state directory, where the overlays' relative options point.
    (state.path / "fstab").write_text("".join(mounts))
    return f"cd {_quote(str(state.path))} && mount --all --fstab fstab"


def _quote(word: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_./:=@%+-]+", word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


async def _read_all(fd: int, limit: int) -> bytes:
    """Read a pipe until EOF (at most ``limit`` bytes) without blocking the loop."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except BlockingIOError:
            await wait_readable(fd)
            continue
        if not chunk:
            break
        data += chunk
    return data


async def _read_child_pid(info_read: int, process: asyncio.subprocess.Process,
                          state: StateDir) -> int:
    try:
        async with asyncio.timeout(START_TIMEOUT_SEC):
            info = await _read_all(info_read, limit=1 << 16)
    except TimeoutError:
        raise unavailable(f"the sandbox did not start within {START_TIMEOUT_SEC:g} s") from None
    try:
        return int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        raise unavailable(await _launch_failure(process, state)) from None


async def _launch_failure(process: asyncio.subprocess.Process, state: StateDir) -> str:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(STOP_TIMEOUT_SEC):
            await process.wait()
    # The sandbox's processes can write to this log: only its tail is read.
    tail = await asyncio.to_thread(read_tail, state.path / "launch.log", LAUNCH_LOG_TAIL)
    lines = [line for line in tail.decode(errors="replace").strip().splitlines()
             if not line.startswith("Joined session keyring")]
    return "the sandbox did not start: " + (lines[-1] if lines else "no error was printed")


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


def default_state_root() -> Path:
    return Path(tempfile.gettempdir()) / "wmo-trio-sandbox"
