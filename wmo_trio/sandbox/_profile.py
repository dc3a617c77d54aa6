"""What every bubblewrap sandbox of wmo_trio holds to, as one frozen `Profile`, and the
one function that turns a profile into bubblewrap's command line (`bwrap_argv`), with
the one launch around it (`launch_argv`: the cgroup joined, a session keyring of its
own).

Three sandboxes are built from it: a trial's (`TRIAL_PROFILE`, ``_namespace``), its network
stack's (`NETWORK_STACK_PROFILE`: slirp4netns, ``_namespace``) and a candidate's runner
(``wmo_trio.backends._sandbox``, a `dataclasses.replace` of `TRIAL_PROFILE` that names what it
tightens). What may differ between them is a field; what may not is a rule of
`bwrap_argv` that no field reaches:

- a fresh ``/proc`` whose writable corners are read-only and whose lists of the host's
  state are masked (`READ_ONLY`, `MASKED`: Docker's lists, and more), no ``/sys``, a
  minimal ``/dev`` made read-only once its mounts are made, with a size-bounded
  ``/dev/shm`` (or no ``/dev`` at all);
- an empty environment but the profile's own variables, a new session (no ``TIOCSTI``
  into a terminal outside), death with the process that started it, a hostname of its
  own, no capability but the profile's;
- Docker's default system-call filter resolved for those capabilities, the machine's
  own ABI only (``_seccomp``);
- a new anonymous session keyring (`launch_argv`), so no key of harbor's session is
  within reach even if a key system call ever got through the filter.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from wmo_trio.sandbox._cgroup import Limits
from wmo_trio.sandbox._seccomp import filter_fd, filter_problem

__all__ = [
    "CAPABILITIES",
    "DEFAULT_PATH",
    "LAUNCH_ATTEMPTS",
    "MASKED",
    "NETWORK_STACK_PROFILE",
    "READ_ONLY",
    "TRIAL_PROFILE",
    "Bind",
    "Profile",
    "bwrap_argv",
    "launch_argv",
    "launch_output",
    "lost_loopback_race",
    "profile_problem",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOCKER_SHM_BYTES = 64 << 20
# Docker's default capability set, less CAP_MKNOD: without a device cgroup, a device
# node made inside could open the host's disks.
CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_NET_RAW",
                "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
                "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE")
# Docker's read-only paths (moby's oci defaults): root may write most sysctls with no
# capability at all.
READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
# Those bubblewrap 0.8's --proc makes read-only itself (the others are bound read-only
# from the host's /proc, which shows the same kernel's).
_BWRAP_READ_ONLY = ("/proc/bus", "/proc/irq")
# Shown empty (a file as an empty one, a directory as an empty tmpfs, both read-only): Docker's
# masked paths (moby's oci defaults, 2025), then what tells of the host here: the host
# root's keys by owner (key-users), and the kernel's command line (this machine's VM
# names its vsock ports there). No sandbox mounts sysfs, so the /sys ones (and Docker's
# per-CPU thermal_throttle) are absent already.
MASKED = ("/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys",
          "/proc/latency_stats", "/proc/sched_debug", "/proc/scsi", "/proc/timer_list",
          "/proc/timer_stats", "/sys/devices/virtual/powercap", "/sys/firmware",
          "/proc/key-users", "/proc/cmdline")

Namespace = Literal["user", "pid", "ipc", "uts", "net", "cgroup"]


@dataclass(frozen=True)
class Bind:
    """A host path shown in the sandbox: read-only, writable, or a device node; or, with
    `link`, a symbolic link at `target` whose text is `source`."""

    source: str
    target: str
    read_only: bool = False
    device: bool = False
    link: bool = False

    @property
    def arguments(self) -> list[str]:
        """bubblewrap's arguments that make it."""
        if self.link:
            return ["--symlink", self.source, self.target]
        option = "--dev-bind" if self.device else "--ro-bind" if self.read_only else "--bind"
        return [option, self.source, self.target]


@dataclass(frozen=True)
class Profile:
    """How one kind of sandbox differs from the others (see the module docstring for
    what it cannot change).

    - `namespaces`: those bubblewrap makes besides the mount namespace;
    - `capabilities` kept (all others dropped; the system-call filter follows them),
      and `extra_system_calls` the filter allows besides;
    - `environment`: the only variables set (``--clearenv`` first);
    - `command_is_pid_1`: the command runs as PID 1 (``--as-pid-1``), else bubblewrap's
      own reaper is PID 1;
    - `dev`: a minimal ``/dev``; False for a program that needs no device but those
      its binds bring (each of its nodes is a mount, and mounts cost most on a machine
      busy with other sandboxes' mounts);
    - ceilings: `shm_bytes` for ``/dev/shm``, `tmp_bytes` for a ``/tmp`` of bubblewrap's
      own (None: the root's), `limits` for the sandbox's cgroup.
    """

    namespaces: frozenset[Namespace]
    capabilities: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    command_is_pid_1: bool
    shm_bytes: int = DOCKER_SHM_BYTES
    tmp_bytes: int | None = None
    limits: Limits = field(default_factory=Limits)
    extra_system_calls: tuple[str, ...] = ()
    dev: bool = True


# A trial, and each build step: Docker's namespaces (a cgroup one besides), Docker's
# capabilities less CAP_MKNOD, the helper (``_helper``) as PID 1.
TRIAL_PROFILE = Profile(
    namespaces=frozenset({"pid", "ipc", "uts", "net", "cgroup"}),
    capabilities=CAPABILITIES,
    environment=(("PATH", DEFAULT_PATH),),
    command_is_pid_1=True,
)

# slirp4netns, which parses every packet a trial sends: in the host's network namespace
# (it is the trial's way out), with only what it needs until its own sandbox
# (``--enable-sandbox``) drops every capability but CAP_NET_BIND_SERVICE: CAP_SYS_ADMIN
# to join the trial's network namespace and make that sandbox (pivot_root besides
# Docker's filter), CAP_NET_ADMIN for the trial's tap device, CAP_SETPCAP to drop the
# rest, CAP_NET_BIND_SERVICE for what it keeps. Its own filter (``--enable-seccomp``)
# then applies on top of this one. It needs no device but the tun device.
NETWORK_STACK_PROFILE = Profile(
    namespaces=frozenset({"pid", "ipc", "uts", "cgroup"}),
    capabilities=("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE"),
    environment=(),
    command_is_pid_1=False,
    extra_system_calls=("pivot_root",),
    dev=False,
)


def profile_problem(profile: Profile) -> str | None:
    """Why no sandbox of ``profile`` can start here (its filter cannot be built), or
    None."""
    return filter_problem(profile.capabilities, profile.extra_system_calls)


def bwrap_argv(profile: Profile, descriptors: ExitStack, *, command: Sequence[str],
               hostname: str, root: str | None = None, binds: Sequence[Bind] = (),
               hidden: Sequence[str] = (), dirs: Sequence[str] = (), chdir: str | None = None,
               info_fd: int | None = None) -> tuple[list[str], list[int]]:
    """bubblewrap's command line for a sandbox of ``profile`` that runs ``command``, and
    the descriptors it must inherit. Each descriptor this opens is closed when
    ``descriptors`` closes (bubblewrap reads it at its start: close it once started).

    ``root``: the host directory bound as ``/``; None for an empty tmpfs, read-only once
    every mount is made. ``binds`` then show host paths, ``hidden`` directories empty
    and read-only, ``dirs`` are made. ``info_fd``: where bubblewrap writes its child's
    pid.
    """
    seccomp = filter_fd(profile.capabilities, profile.extra_system_calls)
    descriptors.callback(os.close, seccomp)
    inherited = [seccomp]
    argv = ["bwrap", *_mounts(profile, descriptors, inherited, root=root, binds=binds,
                              hidden=hidden, dirs=dirs)]
    for namespace in sorted(profile.namespaces):
        argv.append(f"--unshare-{namespace}")
    argv += ["--hostname", hostname, "--die-with-parent", "--new-session", "--clearenv"]
    for name, value in profile.environment:
        argv += ["--setenv", name, value]
    argv += ["--cap-drop", "ALL"]
    for capability in profile.capabilities:
        argv += ["--cap-add", capability]
    argv += ["--seccomp", str(seccomp)]
    if profile.command_is_pid_1:
        argv.append("--as-pid-1")
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
        inherited.append(info_fd)
    if chdir is not None:
        argv += ["--chdir", chdir]
    return [*argv, *command], inherited


def _mounts(profile: Profile, descriptors: ExitStack, inherited: list[int], *,
            root: str | None, binds: Sequence[Bind], hidden: Sequence[str],
            dirs: Sequence[str]) -> list[str]:
    """The arguments that make the sandbox's filesystem (see `bwrap_argv`), in the order
    bubblewrap must mount them: a remount read-only comes after every mount beneath."""
    argv = []
    if root is not None:
        argv += ["--bind", root, "/"]
    argv += ["--proc", "/proc"]
    if profile.dev:
        argv += ["--dev", "/dev",
                 "--size", str(profile.shm_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]
    argv += _masks(descriptors, inherited)
    if profile.tmp_bytes is not None:
        argv += ["--size", str(profile.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    for bind in binds:
        argv += bind.arguments
    for directory in hidden:
        argv += ["--tmpfs", directory, "--remount-ro", directory]
    for directory in dirs:
        argv += ["--dir", directory]
    if root is None:
        argv += ["--remount-ro", "/"]
    if profile.dev:
        # Last, once mount points are made: /dev is an in-memory filesystem without a
        # size (Docker's holds 64 MiB), whose files no process frees when memory runs out.
        argv += ["--remount-ro", "/dev"]
    return argv


def _masks(descriptors: ExitStack, inherited: list[int]) -> list[str]:
    """The arguments that keep `READ_ONLY` read-only and show `MASKED` empty in a fresh
    /proc; each descriptor they need is appended to ``inherited``."""
    argv: list[str] = []
    for path in READ_ONLY:
        if path not in _BWRAP_READ_ONLY:
            argv += ["--ro-bind-try", path, path]
    for path in MASKED:
        # The sandbox's /proc has what the host's has; a path it lacks needs no mask.
        if not path.startswith("/proc/") or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            argv += ["--tmpfs", path, "--remount-ro", path]
        else:
            # An empty read-only file: Docker binds /dev/null, which a bind here (nodev,
            # as bubblewrap makes it) would refuse to open rather than read empty.
            empty = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            descriptors.callback(os.close, empty)
            argv += ["--ro-bind-data", str(empty), path]
            inherited.append(empty)
    return argv


# bubblewrap 0.8 now and then fails to give a new network namespace its loopback address
# (the kernel answers ECHILD under concurrent starts): such a start is tried again, this
# many times in all.
LAUNCH_ATTEMPTS = 3


def lost_loopback_race(error: str) -> bool:
    """Whether a launch that failed with ``error`` lost that race, and may be tried
    again."""
    return "bwrap: loopback" in error


# What keyctl says when a launch joins its new session keyring: not the sandbox's words.
_KEYCTL_NOTE = "Joined session keyring"


def launch_output(text: str) -> list[str]:
    """The lines a launch (:func:`launch_argv`) wrote to its stderr, less keyctl's own
    note on joining the session keyring."""
    return [line for line in text.strip().splitlines() if not line.startswith(_KEYCTL_NOTE)]


def launch_argv(bwrap: Sequence[str], *, cgroup_procs: Sequence[Path] = (),
                before: str = "") -> list[str]:
    """The command that starts ``bwrap`` (from :func:`bwrap_argv`): a shell joins the
    cgroup first (``cgroup_procs``: its ``cgroup.procs`` files, so bubblewrap and all it
    starts follow), runs ``before`` (a shell command), then bubblewrap in a new
    anonymous session keyring."""
    steps = [f"echo $$ > {shlex.quote(str(path))}" for path in cgroup_procs]
    if before:
        steps.append(before)
    steps.append('exec keyctl session - "$@"')
    return ["sh", "-c", " && ".join(steps), "sh", *bwrap]
