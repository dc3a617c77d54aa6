"""A sandbox's user-mode network: slirp4netns for its network namespace, in a sandbox of
its own (``_profile.NETWORK_STACK_PROFILE``), and in its own ``--enable-sandbox`` and
``--enable-seccomp`` within that once it is set up.

It sees of the host's files only its programs (/usr), the loader's cache, the host's
resolv.conf (its DNS forwarder reads it) and the tun device; the trial's network
namespace is a descriptor the host opened. It ends in two steps, as its sandbox does:
told to (its exit descriptor closed) while the sandbox's processes end, then reaped
once they are gone (:meth:`NetworkStack.reap`, which waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess

from wmo_trio.sandbox._errors import unavailable
from wmo_trio.sandbox._processes import read_pipe
from wmo_trio.sandbox._profile import (
    DEFAULT_PATH,
    NETWORK_STACK_PROFILE,
    Bind,
    bwrap_argv,
    launch_argv,
    launch_output,
)

__all__ = ["RESOLV_CONF", "NetworkStack"]

# A sandbox's /etc/resolv.conf while it has a network: slirp4netns's DNS forwarder.
RESOLV_CONF = "nameserver 10.0.2.3\n"

# Bounds a hang only: slirp4netns exits at once when told to.
EXIT_PATIENCE_SEC = 10.0
OUTPUT_TAIL = 64 << 10


class NetworkStack:
    """slirp4netns serving one sandbox's network namespace."""

    def __init__(self, process: subprocess.Popen[bytes], ready_fd: int, exit_fd: int) -> None:
        self.process = process
        self._ready_fd: int | None = ready_fd
        self._exit_fd: int | None = exit_fd

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(cls, netns: int) -> NetworkStack:
        """Start slirp4netns for the network namespace ``netns`` (a descriptor). It is
        not ready yet: see :meth:`wait_ready`."""
        slirp, binds = _network_stack()
        with contextlib.ExitStack() as on_fail, contextlib.ExitStack() as inherited:
            ready_read, ready_write = os.pipe()
            on_fail.callback(os.close, ready_read)
            inherited.callback(os.close, ready_write)
            exit_read, exit_write = os.pipe()
            inherited.callback(os.close, exit_read)
            on_fail.callback(os.close, exit_write)
            bwrap, pass_fds = bwrap_argv(
                NETWORK_STACK_PROFILE, inherited, hostname="slirp4netns", binds=binds,
                dirs=["/tmp", "/run"],
                command=[slirp, "--configure", "--mtu=65520", "--disable-host-loopback",
                         "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_write}",
                         f"--exit-fd={exit_read}", "--netns-type=path",
                         f"/proc/self/fd/{netns}", "tap0"])
            # Popen returns once the program is exec'd, as asyncio's own start does.
            process = subprocess.Popen(
                launch_argv(bwrap), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, pass_fds=(ready_write, exit_read, netns, *pass_fds),
                start_new_session=True, env={"PATH": DEFAULT_PATH},
            )
            on_fail.pop_all()
        return cls(process, ready_read, exit_write)

    async def wait_ready(self) -> None:
        """Wait until slirp4netns has set the namespace's network up; raises
        ``SandboxUnavailableError`` with its last words if it exited instead."""
        assert self._ready_fd is not None
        try:
            ready = await read_pipe(self._ready_fd, limit=16)
        finally:
            self._close(ready=True)
        if ready:
            return
        assert self.process.stderr is not None
        # It said nothing on its ready descriptor: it has exited, or is exiting.
        output = await asyncio.to_thread(self.process.stderr.read, OUTPUT_TAIL)
        lines = launch_output(output.decode(errors="replace"))
        raise unavailable(f"slirp4netns could not give the sandbox a network: "
                          f"{lines[-1] if lines else 'it exited'}")

    def tell_to_exit(self) -> None:
        """Close its exit descriptor: it exits while the sandbox's namespace ends."""
        self._close(exit=True)

    def _close(self, *, ready: bool = False, exit: bool = False) -> None:
        if ready and self._ready_fd is not None:
            fd, self._ready_fd = self._ready_fd, None
            os.close(fd)
        if exit and self._exit_fd is not None:
            fd, self._exit_fd = self._exit_fd, None
            os.close(fd)

    def reap(self) -> None:
        """Wait for its exit (killed if it lingers) once it was told to; blocks."""
        self._close(ready=True, exit=True)
        try:
            self.process.wait(timeout=EXIT_PATIENCE_SEC)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()


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
