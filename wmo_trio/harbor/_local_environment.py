"""A harbor environment that runs unmodified harbor tasks on the host, without Docker.

Each trial gets a private mount namespace and PID namespace whose root is an overlayfs:
the lower layer is the host's ``/`` and the upper layer is a directory private to the
trial. Everything the trial writes lands in that directory, so the host's own files stay
untouched and concurrent trials do not see each other's changes. A small init process
(the *holder*) keeps the namespaces alive; commands enter them with ``nsenter`` and run
chrooted into the overlay.

Read this before relying on it:

- **The host's userland is the image.** The task's Dockerfile is not built: only its
  final ``WORKDIR`` is honoured (created in the overlay and used as the default working
  directory). Whatever the Dockerfile would install must already be on the host.
- **This is filesystem isolation, not a security boundary.** Commands run as real host
  users (root included) on the host's kernel, see the host's devices and ``/sys``, can
  read every host file, and share the host's network unless the task asks for none.

Use harbor's Docker environment (``-e docker``) when the task needs its real image or
when the agent must be contained.

Each ``exec`` runs in a session of its own; on timeout or cancellation that session,
its process group, its descendants and every process still carrying the exec's tag
variable are killed. Without root, the trial lives in an unprivileged user namespace
with one overlay per top-level directory (see :class:`LocalEnvironment`).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import json
import os
import posixpath
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from harbor.environments.base import (
    BaseEnvironment,
    ExecResult,
    OutputCallback,
    transfer_tar_filter,
)
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import require_agent_environment_definition
from harbor.models.task.config import NetworkMode

__all__ = ["LocalEnvironment", "LocalEnvironmentUnavailableError"]

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Every process an exec starts inherits this variable; it lets a timeout or a
# cancellation find the exec's daemons even after they left its session.
_EXEC_TAG_VARIABLE = "WMO_TRIO_LOCAL_EXEC"
_HOLDER_START_TIMEOUT_SEC = 30.0
_HOLDER_STOP_TIMEOUT_SEC = 10.0
# After the command exits, how long to keep reading output that background processes
# still hold open. Docker's exec returns at exit too; this only bounds the drain.
_OUTPUT_DRAIN_SEC = 0.25
_STATE_DIR_NAME = "wmo-trio-local-env"
_HOLDER_VARIABLE = "WMO_TRIO_LOCAL_HOLDER"
_UNSAFE_OVERLAY_PATH = re.compile(r"[,:\\\s]")

# The holder: init (PID 1) of the trial's PID namespace, running inside its fresh mount
# namespace. It builds the overlay root, chroots into it, prints "ready <host pid>"
# only then (an earlier line would race the first exec), reaps orphans, and exits when
# its stdin closes; the kernel then kills every process left in the namespace and the
# namespace's mounts go away with the last process that uses them.
_HOLDER_SOURCE = r"""
import ctypes, fcntl, json, os, select, signal, socket, struct, sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, fstype, flags, data=None):
    def enc(value):
        return None if value is None else value.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        what = fstype or "a bind of " + source
        reason = os.strerror(ctypes.get_errno())
        raise RuntimeError("cannot mount %s on %s: %s" % (what, target, reason))


def overlay(lower, upper, work, target, extra):
    for path in (upper, work, target):
        os.makedirs(path, exist_ok=True)
    options = "lowerdir=%s,upperdir=%s,workdir=%s%s" % (lower, upper, work, extra)
    mount("overlay", target, "overlay", 0, options)


def overlay_each_directory(state, root, extra):
    # An unprivileged user namespace may not overlay "/" itself: the kernel locks
    # /proc, /dev and the other submounts under it. Overlay each top-level
    # directory instead, under a root that is a plain directory of the state.
    with open("/proc/self/mountinfo") as table:
        mount_points = [line.split()[4] for line in table]
    mount(state + "/upper", root, None, MS_BIND)
    for name in sorted(os.listdir("/")):
        source, target = "/" + name, root + "/" + name
        if name in ("proc", "dev", "sys") or os.path.lexists(target):
            os.makedirs(target, exist_ok=True)
        elif os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif not os.path.isdir(source):
            open(target, "a").close()
            mount(source, target, None, MS_BIND)
        elif any(point.startswith(source + "/") for point in mount_points):
            os.makedirs(target)  # holds locked submounts: shared, not overlaid
            mount(source, target, None, MS_BIND | MS_REC)
        else:
            layer = state + "/layers/" + name
            overlay(source, layer + "/upper", layer + "/work", target, extra)


def loopback_up():
    ifreq = struct.pack("16sH22x", b"lo", 0)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, 0x8913, ifreq))[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))


def build(cfg):
    state, root = cfg["state"], cfg["state"] + "/root"
    extra = ",userxattr" if cfg["user_namespace"] else ""
    if cfg["user_namespace"]:
        overlay_each_directory(state, root, extra)
    else:
        overlay("/", state + "/upper", state + "/work", root, extra)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("/dev", root + "/dev", None, MS_BIND | MS_REC)
    mount("shm", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    if os.path.isdir("/sys"):
        mount("/sys", root + "/sys", None, MS_BIND | MS_REC)
        try:
            mount(None, root + "/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        except OSError:
            pass
    for hidden in cfg["hide"]:
        if os.path.isdir(root + hidden):
            mount("tmpfs", root + hidden, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    for path, mode in cfg["dirs"]:
        os.makedirs(root + path, exist_ok=True)
        if mode is not None:
            os.chmod(root + path, mode)
    for bind in cfg["binds"]:
        target = root + bind["target"]
        if os.path.isdir(bind["source"]):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        mount(bind["source"], target, None, MS_BIND | MS_REC)
        if bind["read_only"]:
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    if cfg["loopback"]:
        loopback_up()
    host_pid = int(os.readlink("/proc/self"))
    os.chroot(root)
    os.chdir("/")
    return host_pid


def serve():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        readable, _, _ = select.select([0, wake_read], [], [])
        if 0 in readable and not os.read(0, 4096):
            os._exit(0)
        if wake_read in readable:
            try:
                os.read(wake_read, 4096)
            except BlockingIOError:
                pass


try:
    host_pid = build(json.loads(sys.argv[1]))
except Exception as exc:
    sys.stderr.write("%s\n" % (exc,))
    sys.exit(1)
sys.stdout.write("ready %d\n" % host_pid)
sys.stdout.flush()
serve()
"""


class LocalEnvironmentUnavailableError(RuntimeError):
    """This machine cannot host a :class:`LocalEnvironment`; the message names what is
    missing and points to harbor's Docker environment."""


def _unavailable(reason: str) -> LocalEnvironmentUnavailableError:
    return LocalEnvironmentUnavailableError(
        f"LocalEnvironment cannot run on this machine: {reason}. It needs Linux, "
        "util-linux's unshare and nsenter, overlayfs, and either root or unprivileged "
        "user namespaces. Use harbor's Docker environment instead (-e docker)."
    )


@dataclass(frozen=True)
class _Tools:
    unshare: str
    nsenter: str
    rootless: bool


@functools.cache
def _find_tools() -> _Tools | str:
    """The host tools a trial needs, or a sentence naming what is missing."""
    if sys.platform != "linux":
        return f"it runs on {sys.platform}, not Linux"
    found = {name: shutil.which(name) for name in ("unshare", "nsenter", "setpriv", "tar")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        return "missing " + ", ".join(missing) + " on PATH"
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        return "/proc is not mounted"
    # An overlay module not loaded yet is not listed; then the mount itself will tell.
    if "overlay" not in filesystems and not Path("/lib/modules").is_dir():
        return "the kernel has no overlayfs"
    rootless = os.geteuid() != 0
    if rootless:
        for knob in ("/proc/sys/user/max_user_namespaces",
                     "/proc/sys/kernel/unprivileged_userns_clone"):
            with contextlib.suppress(OSError, ValueError):
                if int(Path(knob).read_text()) == 0:
                    return f"not root, and unprivileged user namespaces are off ({knob} is 0)"
    unshare, nsenter = found["unshare"], found["nsenter"]
    assert unshare is not None and nsenter is not None
    return _Tools(unshare=unshare, nsenter=nsenter, rootless=rootless)


def _default_state_root() -> Path:
    return Path(tempfile.gettempdir()) / _STATE_DIR_NAME


@dataclass(frozen=True)
class _Namespace:
    """A running trial namespace."""

    unshare: asyncio.subprocess.Process
    init_pid: int
    pid_namespace: str
    state_dir: Path
    shell: str


@dataclass(frozen=True)
class _Identity:
    uid: int
    gid: int
    home: str
    in_passwd: bool


_ROOT = _Identity(uid=0, gid=0, home="/root", in_passwd=True)


@dataclass(frozen=True)
class _Completed:
    return_code: int
    stdout: bytes
    stderr: bytes


class LocalEnvironment(BaseEnvironment):  # type: ignore[misc]
    """Harbor environment: a private overlay of the host's ``/`` per trial, no Docker.

    Select it with ``harbor run -e wmo_trio.harbor:LocalEnvironment``.

    - **The host's userland is the image.** The Dockerfile is not built; only its final
      ``WORKDIR`` is honoured (created in the overlay, default working directory).
      ``[environment].workdir`` in ``task.toml`` overrides it, as with Docker.
    - **Filesystem isolation, not a security boundary.** Writes go to a private upper
      directory; processes still run as real host users on the host kernel, can read
      all host files and use the host network (``network_mode = "no-network"`` gets an
      empty network namespace).
    - Each trial has its own mount and PID namespace: ``ps`` inside shows only the
      trial's processes, and ``stop`` ends all of them at once.
    - Supports harbor's host bind mounts (``capabilities.mounted``): user mounts always,
      and the trial's log directories when ``--ek auto_mounting=true``, in which case
      harbor writes logs straight to the trial directory and skips the downloads.
    - Upper directories live under ``--ek state_dir=...`` (default
      ``$TMPDIR/wmo-trio-local-env``); ``stop(delete=False)`` keeps the trial's upper
      directory there for inspection.

    Works as root. Without root it runs in an unprivileged user namespace, where the
    kernel refuses an overlay over ``/`` itself, so each top-level directory gets its
    own overlay: files owned by the host's root stay read-only, only root exists
    inside, and renames across top-level directories fail with EXDEV. Where even that
    is refused (or unshare, nsenter or overlayfs are missing), ``preflight`` and
    ``start`` fail with one :class:`LocalEnvironmentUnavailableError` naming the cause
    and pointing to ``-e docker``.
    """

    def __init__(
        self,
        *args: Any,
        state_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        self._state_root = Path(state_dir) if state_dir else _default_state_root()
        self._namespace: _Namespace | None = None
        self._default_workdir = "/"
        super().__init__(*args, **kwargs)
        dockerfile_workdir = _dockerfile_workdir(self.environment_dir / "Dockerfile")
        self._default_workdir = (
            self.task_env_config.workdir or dockerfile_workdir or "/"
        )

    @staticmethod
    def type() -> str:
        return "wmo-trio-local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(mounted=True, disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # CPU and memory figures are accepted but never enforced.
        return EnvironmentResourceCapabilities(fractional_cpus=True)

    @classmethod
    def preflight(cls) -> None:
        """Fail the job early, before any trial is queued, if no trial could start."""
        tools = _find_tools()
        reason = tools if isinstance(tools, str) else _probe(tools)
        if reason is not None:
            raise SystemExit(str(_unavailable(reason)))

    def _validate_definition(self) -> None:
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError(
                "LocalEnvironment does not run Docker Compose task environments; "
                "use harbor's Docker environment (-e docker)."
            )
        require_agent_environment_definition(
            self.environment_dir, docker_image=self.task_env_config.docker_image
        )
        for mount in self._mounts:
            if mount["type"] != "bind":
                raise ValueError(
                    f"LocalEnvironment supports only bind mounts, not {mount['type']!r} "
                    f"(target {mount['target']})."
                )

    # ------------------------------------------------------------------ lifecycle

    async def start(self, force_build: bool) -> None:
        """Create the trial's namespaces and overlay root (nothing is built).

        Raises :class:`LocalEnvironmentUnavailableError` when this machine cannot do it.
        If cancelled meanwhile, the half-built namespace and its directory are removed.
        """
        if self._namespace is not None:
            raise RuntimeError(f"environment {self.session_id} is already started")
        tools = _find_tools()
        if isinstance(tools, str):
            raise _unavailable(tools)
        if self.task_env_config.docker_image:
            self.logger.debug(
                "docker_image %s is ignored: the host's userland is the image",
                self.task_env_config.docker_image,
            )
        no_network = self._network_policy.network_mode == NetworkMode.NO_NETWORK
        state_dir = await asyncio.to_thread(self._make_state_dir)
        unshare: asyncio.subprocess.Process | None = None
        try:
            config = self._holder_config(state_dir, tools.rootless, no_network)
            unshare = await asyncio.create_subprocess_exec(
                *_holder_argv(tools, config, no_network),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # Its own session: a Ctrl-C at harbor's terminal must not end the
                # namespace before harbor's own shutdown stops it.
                start_new_session=True,
                env=_holder_environment(),
            )
            init_pid = await _await_ready(unshare, tools)
            pid_namespace, shell = _describe_namespace(init_pid)
        except BaseException:
            if unshare is not None:
                await _end_holder(unshare)
            await asyncio.to_thread(_remove_tree, state_dir)
            raise
        self._namespace = _Namespace(
            unshare=unshare,
            init_pid=init_pid,
            pid_namespace=pid_namespace,
            state_dir=state_dir,
            shell=shell,
        )
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """End every process of the trial and its mounts; remove the upper directory
        unless ``delete`` is false, in which case it is kept for inspection.

        Safe to call twice or without ``start``.
        """
        namespace, self._namespace = self._namespace, None
        if namespace is None:
            return
        await _end_holder(namespace.unshare)
        if delete:
            await asyncio.to_thread(_remove_tree, namespace.state_dir)
            return
        await asyncio.to_thread(_remove_scratch, namespace.state_dir)
        self.logger.info(
            "Kept the trial's filesystem changes in %s", namespace.state_dir / "upper"
        )

    def _make_state_dir(self) -> Path:
        return _make_state_dir(self._state_root, self.session_id)

    def _holder_config(
        self, state_dir: Path, user_namespace: bool, no_network: bool
    ) -> dict[str, Any]:
        """What the holder builds: overlay, directories, host bind mounts."""
        for mount in self._host_mounts:
            source = Path(mount["source"])
            if not source.exists():
                if mount.get("bind", {}).get("create_host_path") is False:
                    raise FileNotFoundError(f"bind mount source {source} does not exist")
                source.mkdir(parents=True, exist_ok=True)
        writable_targets = set(self._mount_targets(writable_only=True))
        # Like Docker's start, writable mount targets exist and are world-writable.
        dirs: list[tuple[str, int | None]] = [(self._default_workdir, None)]
        dirs += [(target, 0o777) for target in self._mount_targets()
                 if target in writable_targets]
        return _holder_config(
            state_dir,
            user_namespace=user_namespace,
            hide=[str(self._state_root.resolve())],
            dirs=dirs,
            binds=[
                {
                    "source": str(Path(m["source"]).resolve()),
                    "target": m["target"],
                    "read_only": bool(m.get("read_only")),
                }
                for m in self._host_mounts
            ],
            loopback=no_network,
        )

    def _require_namespace(self) -> _Namespace:
        if self._namespace is None:
            raise RuntimeError(f"environment {self.session_id} is not started")
        return self._namespace

    # ------------------------------------------------------------------ exec

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` with bash (sh if the host has no bash) inside the trial.

        ``cwd`` defaults to the task's workdir; ``env`` is merged with harbor's
        persistent and scoped variables; ``user`` (name, uid, or ``name:group``)
        defaults to harbor's default user, else root.

        On timeout every process the command started is killed and
        ``RuntimeError("Command timed out after N seconds")`` is raised, as harbor's
        Docker environment does. If cancelled, the same processes are killed before
        the cancellation propagates.
        """
        namespace = self._require_namespace()
        spec = self._resolve_user(user)
        identity = _resolve_identity(namespace.init_pid, spec)
        if identity is None:
            return ExecResult(
                stdout=None,
                stderr=f"unable to find user {spec}: no matching entries in passwd file",
                return_code=126,
            )
        variables = {"PATH": _DEFAULT_PATH, "HOME": identity.home}
        variables.update(self._merge_env(env) or {})
        completed = await self._run(
            namespace,
            [namespace.shell, "-c", command],
            cwd=cwd or self._default_workdir,
            variables=variables,
            identity=identity,
            timeout_sec=timeout_sec,
            stream_output=True,
        )
        return ExecResult(
            stdout=completed.stdout.decode(errors="replace") if completed.stdout else None,
            stderr=completed.stderr.decode(errors="replace") if completed.stderr else None,
            return_code=completed.return_code,
        )

    async def _run(
        self,
        namespace: _Namespace,
        argv: Sequence[str],
        *,
        cwd: str = "/",
        variables: Mapping[str, str] | None = None,
        identity: _Identity = _ROOT,
        timeout_sec: float | None = None,
        stdin: int | IO[bytes] = asyncio.subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = None,
        stream_output: bool = False,
    ) -> _Completed:
        """Run ``argv`` chrooted in the trial; capture stdout unless ``stdout`` is given.

        The command runs in a new session led by its ``nsenter``; a timeout or a
        cancellation kills that session, its process group, its descendants and any
        process of the trial still carrying this run's tag.
        """
        tag = uuid.uuid4().hex
        environment = {"PATH": _DEFAULT_PATH, **(variables or {})}
        environment[_EXEC_TAG_VARIABLE] = tag
        for key in environment:
            if not key or "=" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
        tools = _find_tools()
        assert not isinstance(tools, str)
        enter = [tools.nsenter, f"--target={namespace.init_pid}", "--mount", "--pid"]
        if self._network_policy.network_mode == NetworkMode.NO_NETWORK:
            enter.append("--net")
        if tools.rootless:
            # The kernel refuses setgroups there; the caller's uid already maps to root.
            enter += ["--user", "--preserve-credentials"]
        # nsenter's --wd would resolve on the host side; env -C runs inside the chroot.
        full = [*enter, "--root", "--", "env", "-i", f"--chdir={cwd}"]
        full += [f"{key}={value}" for key, value in environment.items()]
        if identity != _ROOT:
            full += [
                "setpriv",
                f"--reuid={identity.uid}",
                f"--regid={identity.gid}",
                "--init-groups" if identity.in_passwd else "--clear-groups",
                "--",
            ]
        full += argv

        # Own pipes rather than asyncio's: Process.wait() on asyncio pipes also waits
        # for every background process that inherited them to close them.
        sinks = {"stdout": bytearray(), "stderr": bytearray()}
        read_ends: dict[str, IO[bytes]] = {}
        write_ends: dict[str, int | IO[bytes]] = {}
        for name in ("stdout", "stderr"):
            if name == "stdout" and stdout is not None:
                write_ends[name] = stdout
                continue
            read_fd, write_fd = os.pipe()
            read_ends[name] = os.fdopen(read_fd, "rb", buffering=0)
            write_ends[name] = write_fd
        try:
            process = await asyncio.create_subprocess_exec(
                *full,
                stdin=stdin,
                stdout=write_ends["stdout"],
                stderr=write_ends["stderr"],
                start_new_session=True,
                env={"PATH": _DEFAULT_PATH},
            )
        except BaseException:
            for read_end in read_ends.values():
                read_end.close()
            raise
        finally:
            for write_end in write_ends.values():
                if isinstance(write_end, int):
                    os.close(write_end)
        callback = self._output_callback() if stream_output else None
        pumps = [
            asyncio.create_task(_pump(read_end, sinks[name], name, callback))
            for name, read_end in read_ends.items()
        ]
        try:
            try:
                async with asyncio.timeout(timeout_sec or None) as scope:
                    return_code = await process.wait()
            except TimeoutError:
                if not scope.expired():
                    raise
                self._kill_run(namespace, process.pid, tag)
                await _settle(process)
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
            except BaseException:
                self._kill_run(namespace, process.pid, tag)
                await _settle(process)
                raise
            await asyncio.wait(pumps, timeout=_OUTPUT_DRAIN_SEC)
        finally:
            for pump in pumps:
                pump.cancel()
            # Let the pumps unregister their pipes before the descriptors are closed.
            await asyncio.gather(*pumps, return_exceptions=True)
            for read_end in read_ends.values():
                read_end.close()
        if return_code < 0:  # killed by a signal: report it the way a shell would
            return_code = 128 - return_code
        return _Completed(return_code, bytes(sinks["stdout"]), bytes(sinks["stderr"]))

    def _kill_run(self, namespace: _Namespace, leader: int, tag: str) -> None:
        """SIGKILL every process of one run but its nsenter; repeat until none is left
        (forks race). The nsenter then exits by itself after reaping its child: killed
        first, it would leave that child's zombie to the host's init, and the trial's
        PID namespace could not end until the host's init got round to reaping it."""
        spared = {os.getpid(), leader, namespace.init_pid, namespace.unshare.pid}
        marker = f"{_EXEC_TAG_VARIABLE}={tag}".encode() + b"\0"
        for _ in range(50):
            victims = _processes_of_run(leader, marker, namespace.pid_namespace) - spared
            if not victims:
                return
            # Freeze them all before killing any: killed one by one, a shell whose child
            # just died could run the rest of its command line (`sleep 30; echo late >
            # file`) against the environment harbor is about to verify.
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
        self.logger.warning("Some processes of a killed command kept forking")

    # ------------------------------------------------------------------ files

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file into the trial, owned by root, mode kept. A target that is
        a directory (or ends with ``/``) receives the file under its own name."""
        namespace = self._require_namespace()
        source = Path(source_path)
        script = (
            't=$1; case $t in */) mkdir -p -- "$t"; t=$t$2;; *) '
            'if [ -d "$t" ]; then t=$t/$2; else mkdir -p -- "$(dirname -- "$t")"; fi;; '
            'esac; cat > "$t" && chmod "$3" "$t"'
        )
        handle, mode = _open_source_file(source)
        with handle:
            completed = await self._run(
                namespace,
                ["sh", "-c", script, "sh", target_path, source.name, f"{mode:o}"],
                stdin=handle,
            )
        _check(completed, f"upload {source} to {target_path}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host directory's contents into ``target_dir`` (created if needed),
        owned by root, modes kept."""
        namespace = self._require_namespace()
        source = Path(source_dir)
        if not await asyncio.to_thread(source.is_dir):
            raise FileNotFoundError(f"{source} is not a directory")
        read_fd, write_fd = os.pipe()
        packer = asyncio.create_task(asyncio.to_thread(_pack_dir, source, write_fd))
        try:
            completed = await self._run(
                namespace,
                ["sh", "-c", 'mkdir -p -- "$1" && exec tar -xf - -C "$1"', "sh", target_dir],
                stdin=read_fd,
            )
        finally:
            os.close(read_fd)
            # Unblocks the packer if tar died early; it then fails on a broken pipe.
            await asyncio.gather(packer, return_exceptions=True)
        packing_error = packer.exception()
        if packing_error is not None and not isinstance(packing_error, BrokenPipeError):
            raise packing_error  # the real cause of tar's truncated-archive complaint
        _check(completed, f"upload {source} to {target_dir}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a file out of the trial; the host copy belongs to harbor's user."""
        namespace = self._require_namespace()
        target = Path(target_path)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.part")
        try:
            with partial.open("wb") as handle:
                completed = await self._run(
                    namespace,
                    ["sh", "-c", '[ -f "$1" ] || { echo "no such file: $1" >&2; exit 2; }; '
                     'exec cat -- "$1"', "sh", source_path],
                    stdout=handle,
                )
            _check(completed, f"download {source_path}")
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a directory's contents out of the trial into ``target_dir``, overwriting
        files there; the host copies belong to harbor's user."""
        namespace = self._require_namespace()
        target = Path(target_dir)
        await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as archive:
            completed = await self._run(
                namespace,
                ["sh", "-c", '[ -d "$1" ] || { echo "no such directory: $1" >&2; exit 2; }; '
                 'exec tar -cf - -C "$1" .', "sh", source_dir],
                stdout=archive,
            )
            _check(completed, f"download {source_dir}")
            await asyncio.to_thread(_unpack, archive, target)


# ---------------------------------------------------------------------- helpers


def _make_state_dir(state_root: Path, session_id: str) -> Path:
    state_root.mkdir(mode=0o711, parents=True, exist_ok=True)
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", session_id)[:80] + "."
    state_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=state_root))
    for name in ("upper", "work", "root"):
        (state_dir / name).mkdir()
    return state_dir


def _holder_config(
    state_dir: Path,
    *,
    user_namespace: bool,
    hide: list[str] | None = None,
    dirs: list[tuple[str, int | None]] | None = None,
    binds: list[dict[str, Any]] | None = None,
    loopback: bool = False,
) -> dict[str, Any]:
    if _UNSAFE_OVERLAY_PATH.search(str(state_dir)):
        raise _unavailable(
            f"the state directory {state_dir} holds a character overlayfs options "
            "cannot carry (comma, colon, backslash or space)"
        )
    return {
        "state": str(state_dir),
        "user_namespace": user_namespace,
        # Other trials' upper directories are under the state root: hide them.
        "hide": hide or [],
        "dirs": dirs or [],
        "binds": binds or [],
        "loopback": loopback,
    }


def _holder_argv(tools: _Tools, config: Mapping[str, Any], no_network: bool) -> list[str]:
    flags = ["--mount", "--pid", "--fork", "--kill-child"]
    if tools.rootless:
        flags += ["--user", "--map-root-user"]
    if no_network:
        flags.append("--net")
    return [
        tools.unshare,
        *flags,
        "--",
        sys.executable,
        "-I",
        "-S",
        "-c",
        f"import os; exec(os.environ[{_HOLDER_VARIABLE!r}])",
        json.dumps(config),
    ]


def _holder_environment() -> dict[str, str]:
    # The source travels in the environment so that `ps` stays readable.
    return {"PATH": _DEFAULT_PATH, _HOLDER_VARIABLE: _HOLDER_SOURCE}


def _holder_failure(stderr: bytes, tools: _Tools) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else "the namespace holder exited"
    if tools.rootless:
        reason += " (without root, inside an unprivileged user namespace)"
    return reason


async def _await_ready(unshare: asyncio.subprocess.Process, tools: _Tools) -> int:
    """The holder's host pid, once its root is complete."""
    assert unshare.stdout is not None and unshare.stderr is not None
    try:
        line = await asyncio.wait_for(
            unshare.stdout.readline(), timeout=_HOLDER_START_TIMEOUT_SEC
        )
    except TimeoutError:
        raise _unavailable(
            f"the trial namespace was not ready within {_HOLDER_START_TIMEOUT_SEC:g} s"
        ) from None
    words = line.split()
    if len(words) == 2 and words[0] == b"ready" and words[1].isdigit():
        return int(words[1])
    unshare.kill()
    stderr = await unshare.stderr.read()
    await unshare.wait()
    raise _unavailable(_holder_failure(stderr, tools))


def _probe(tools: _Tools) -> str | None:
    """Build and end a throwaway namespace; why that failed, or None."""
    state_dir = _make_state_dir(_default_state_root(), "preflight")
    try:
        config = _holder_config(state_dir, user_namespace=tools.rootless)
        try:
            completed = subprocess.run(
                _holder_argv(tools, config, no_network=False),
                input=b"",
                capture_output=True,
                env=_holder_environment(),
                timeout=_HOLDER_START_TIMEOUT_SEC,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
        if completed.stdout.startswith(b"ready "):
            return None
        return _holder_failure(completed.stderr, tools)
    finally:
        _remove_tree(state_dir)


def _describe_namespace(init_pid: int) -> tuple[str, str]:
    """The holder's PID namespace id and the shell commands run with (bash, as in
    harbor's Docker environment, else sh)."""
    pid_namespace = os.readlink(f"/proc/{init_pid}/ns/pid")
    shell = "bash" if os.path.exists(f"/proc/{init_pid}/root/bin/bash") else "sh"
    return pid_namespace, shell


def _open_source_file(source: Path) -> tuple[IO[bytes], int]:
    handle = source.open("rb")
    return handle, os.fstat(handle.fileno()).st_mode & 0o7777


async def _end_holder(unshare: asyncio.subprocess.Process) -> None:
    """Close the holder's stdin so it exits (the kernel then kills the rest of its PID
    namespace); SIGKILL ``unshare`` if that takes too long."""
    if unshare.stdin is not None:
        unshare.stdin.close()
    try:
        await asyncio.wait_for(unshare.wait(), timeout=_HOLDER_STOP_TIMEOUT_SEC)
    except TimeoutError:
        # --kill-child: the holder gets SIGKILL when unshare dies.
        with contextlib.suppress(ProcessLookupError):
            unshare.kill()
        await unshare.wait()


async def _settle(process: asyncio.subprocess.Process) -> None:
    """Wait for a run's nsenter to exit once its command is killed; SIGKILL it if it
    lingers. A second cancellation meanwhile only cuts the wait short."""
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), timeout=2)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await asyncio.wait_for(asyncio.shield(process.wait()), timeout=2)


async def _pump(
    read_end: IO[bytes],
    sink: bytearray,
    stream: str,
    callback: OutputCallback | None,
) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), read_end
    )
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        while chunk := await reader.read(1 << 16):
            sink += chunk
            if callback is not None and (text := decoder.decode(chunk)):
                await callback(text, stream)
        if callback is not None and (text := decoder.decode(b"", final=True)):
            await callback(text, stream)
    finally:
        transport.close()


def _processes_of_run(leader: int, marker: bytes, pid_namespace: str) -> set[int]:
    """Live processes started by one run: its session and process group (led by its
    nsenter), their descendants, and processes of the trial carrying its tag."""
    parents: dict[int, int] = {}
    matched: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            continue
        pid = int(name)
        parent, group, session = int(fields[1]), int(fields[2]), int(fields[3])
        parents[pid] = parent
        if leader in (pid, group, session):
            matched.add(pid)
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != pid_namespace:
                continue
            with open(f"/proc/{name}/environ", "rb") as handle:
                if marker in b"\0" + handle.read():
                    matched.add(pid)
        except OSError:
            continue
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    pending = list(matched)
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in matched:
                matched.add(child)
                pending.append(child)
    return matched


def _resolve_identity(init_pid: int, spec: str | int | None) -> _Identity | None:
    """uid, gid and home for a harbor user spec (name, uid, ``name:group``), looked up
    in the trial's own /etc/passwd so users an agent creates count; None if unknown."""
    if spec is None or spec == 0 or spec == "root":
        return _ROOT
    name, _, group = str(spec).partition(":")
    root = f"/proc/{init_pid}/root"
    passwd = _read_table(f"{root}/etc/passwd")
    entry = next(
        (row for row in passwd if row[0] == name or (name.isdigit() and row[2] == name)),
        None,
    )
    if entry is not None:
        identity = _Identity(
            uid=int(entry[2]), gid=int(entry[3]), home=entry[5] or "/", in_passwd=True
        )
    elif name.isdigit():
        identity = _Identity(uid=int(name), gid=0, home="/", in_passwd=False)
    else:
        return None
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            row = next((r for r in _read_table(f"{root}/etc/group") if r[0] == group), None)
            if row is None:
                return None
            gid = int(row[2])
        identity = _Identity(identity.uid, gid, identity.home, identity.in_passwd)
    return identity



def _read_table(path: str) -> list[list[str]]:
    """Rows of a colon-separated file such as /etc/passwd; empty if unreadable."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [
        line.split(":") for line in text.splitlines()
        if line and not line.startswith("#") and line.count(":") >= 2
        and (not path.endswith("passwd") or line.count(":") >= 6)
    ]


def _check(completed: _Completed, action: str) -> None:
    if completed.return_code != 0:
        detail = completed.stderr.decode(errors="replace").strip() or "no output"
        if completed.return_code == 2 and detail.startswith("no such "):
            raise FileNotFoundError(f"cannot {action}: {detail}")
        raise RuntimeError(f"cannot {action} (exit {completed.return_code}): {detail}")


def _root_owned(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.uid = member.gid = 0
    member.uname = member.gname = "root"
    return member


def _pack_dir(source: Path, write_fd: int) -> None:
    with (
        os.fdopen(write_fd, "wb") as pipe,
        tarfile.open(fileobj=pipe, mode="w|", format=tarfile.PAX_FORMAT) as archive,
    ):
        for entry in sorted(source.iterdir()):
            archive.add(entry, arcname=entry.name, filter=_root_owned)


def _unpack(archive: IO[bytes], target: Path) -> None:
    archive.seek(0)
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        tar.extractall(target, filter=transfer_tar_filter)


def _remove_scratch(state_dir: Path) -> None:
    """Remove what a kept trial does not need: overlay work dirs and the mount point."""
    for scratch in [state_dir / "work", state_dir / "root",
                    *state_dir.glob("layers/*/work")]:
        _remove_tree(scratch)


def _remove_tree(path: Path) -> None:
    def make_writable(function: Any, failed: str, exc: BaseException) -> None:
        # Overlay leaves mode-000 directories in its work dir; unprivileged owners
        # must open them up before removing them.
        os.chmod(failed, 0o700)
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
        function(failed)

    if path.exists():
        shutil.rmtree(path, onexc=make_writable)


# ---------------------------------------------------------------------- Dockerfile

_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::-([^}]*))?\}|(\w+))")


def _dockerfile_instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs, with continuation lines joined."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, argument = line.partition(" ")
        yield keyword.upper(), argument.strip()


def _dockerfile_workdir(dockerfile: Path) -> str | None:
    """The final stage's WORKDIR, resolved the way Docker does; None if unset."""
    try:
        text = dockerfile.read_text(errors="replace")
    except OSError:
        return None
    stage_workdirs: dict[str, str | None] = {}
    workdir: str | None = None
    variables: dict[str, str] = {}
    stage = ""

    def expand(value: str) -> str:
        return _VARIABLE.sub(
            lambda m: variables.get(m.group(1) or m.group(3), m.group(2) or ""), value
        )

    for keyword, argument in _dockerfile_instructions(text):
        if keyword == "FROM":
            names = [word for word in argument.split() if not word.startswith("--")]
            # A stage built FROM an earlier stage inherits that stage's WORKDIR.
            workdir = stage_workdirs.get(names[0].lower()) if names else None
            variables = {}
            stage = names[2].lower() if len(names) >= 3 and names[1].upper() == "AS" else ""
        elif keyword in ("ARG", "ENV"):
            with contextlib.suppress(ValueError):
                words = shlex.split(argument)
                if keyword == "ENV" and len(words) >= 2 and "=" not in words[0]:
                    variables[words[0]] = expand(" ".join(words[1:]))
                else:
                    for word in words:
                        name, has_value, value = word.partition("=")
                        if has_value:
                            variables[name] = expand(value)
        elif keyword == "WORKDIR" and argument:
            path = expand(argument.strip().strip("\"'"))
            workdir = posixpath.normpath(posixpath.join(workdir or "/", path))
        if stage:
            stage_workdirs[stage] = workdir
    return workdir

