"""A trial's CPU, memory and process ceilings (``task.toml``'s ``cpus`` and
``memory_mb``, the environment's ``pids_limit``) as a cgroup of its own.

A trial's cgroup is made beside nothing of anyone else's: a child of the harbor
process's own cgroup, in every hierarchy that holds the ``cpu``, ``memory`` or ``pids``
controller its limits need, named ``wmo-trio.<owner pid>.<random>``. The sandbox's launch
script writes its own PID into it before it starts bubblewrap, so every process of the
sandbox is in it from the first, and the sandbox's cgroup namespace makes it the
sandbox's root.

Where that works: as root under cgroup v1 (each controller's hierarchy is writable by
root), and under cgroup v2 where the controllers are enabled for the children of the
process's cgroup (or can be: the root cgroup). A v2 cgroup that holds processes cannot
give its children controllers (the kernel's no-internal-process rule), and moving
harbor's processes elsewhere is not this environment's business; there the limits are
not enforced and :attr:`HostCgroups.reason` says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Self

__all__ = ["HostCgroups", "Limits", "TrialCgroup", "host_cgroups", "remove_stale_cgroups"]

log = logging.getLogger(__name__)

PREFIX = "wmo-trio."
CPU_PERIOD_US = 100_000
# The kernel's smallest CFS quota.
MIN_CPU_QUOTA_US = 1_000
CONTROLLERS = ("cpu", "memory", "pids")
# How long a stop waits for the kernel to empty a cgroup whose processes were killed;
# one left busy is removed by a later start.
REMOVE_PATIENCE_SEC = 2.0


@dataclass(frozen=True)
class Limits:
    """Ceilings for one trial: CPUs (fractions allowed), memory in MiB and processes
    (threads count); None is no ceiling."""

    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None

    def __post_init__(self) -> None:
        if self.cpus is not None and not self.cpus > 0:
            raise ValueError(f"cpus must be a positive number of CPUs, not {self.cpus!r}")
        if self.memory_mb is not None and not self.memory_mb > 0:
            raise ValueError(f"memory_mb must be a positive number of MiB, not {self.memory_mb!r}")
        if self.pids is not None and not self.pids > 0:
            raise ValueError(f"pids must be a positive number of processes, not {self.pids!r}")

    @property
    def wanted(self) -> tuple[str, ...]:
        """The controllers these limits need."""
        return tuple(name for name, value in (("cpu", self.cpus), ("memory", self.memory_mb),
                                              ("pids", self.pids))
                     if value is not None)


@dataclass(frozen=True)
class Hierarchy:
    """Where trials' cgroups go in one cgroup hierarchy: ``base`` is the harbor
    process's own cgroup there."""

    version: int
    base: Path
    controllers: frozenset[str]


@dataclass(frozen=True)
class HostCgroups:
    """What this machine lets a trial's limits use."""

    hierarchies: tuple[Hierarchy, ...]
    reason: str | None = None  # why a controller is missing, if one is

    def offers(self, controller: str) -> bool:
        return any(controller in h.controllers for h in self.hierarchies)

    def for_limits(self, limits: Limits) -> tuple[Hierarchy, ...]:
        """The hierarchies a trial's cgroup goes in: those of its limits."""
        return tuple(h for h in self.hierarchies if set(limits.wanted) & h.controllers)


@cache
def host_cgroups() -> HostCgroups:
    """This process's cgroups, read once: which hierarchies offer ``cpu``, ``memory``
    and ``pids`` for trials' cgroups."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        membership = Path("/proc/self/cgroup").read_text()
    except OSError as error:
        return HostCgroups((), f"cannot read this process's cgroups ({error})")
    return find_hierarchies(mountinfo, membership, root=os.geteuid() == 0)


def find_hierarchies(mountinfo: str, membership: str, *, root: bool) -> HostCgroups:
    """Read ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` (their texts): for each
    controller wanted, the hierarchy that has it and this process's cgroup there."""
    paths: dict[str, str] = {}  # controller ("" for v2) -> this process's cgroup path
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    hierarchies: list[Hierarchy] = []
    reasons: list[str] = []
    for mount_root, mount_point, fstype, options in _cgroup_mounts(mountinfo):
        if fstype == "cgroup2":
            found = _v2_hierarchy(mount_root, mount_point, paths.get(""), reasons)
        else:
            controllers = [name for name in CONTROLLERS if name in options]
            found = _v1_hierarchy(mount_root, mount_point, controllers, paths, root, reasons)
        if found is not None and not any(h.base == found.base for h in hierarchies):
            hierarchies.append(found)
    missing = [name for name in CONTROLLERS
               if not any(name in h.controllers for h in hierarchies)]
    reason = None
    if missing:
        reason = "; ".join(reasons) or "no cgroup hierarchy has the {} controller".format(
            " or ".join(missing))
    return HostCgroups(tuple(hierarchies), reason)


def _cgroup_mounts(mountinfo: str) -> Iterable[tuple[str, Path, str, set[str]]]:
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if len(fields) < 5 or len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        yield (_unescape(fields[3]), Path(_unescape(fields[4])), after[0],
               set(after[2].split(",")))


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _inside(mount_root: str, mount_point: Path, path: str) -> Path | None:
    """Where the cgroup ``path`` (as /proc/self/cgroup names it) is under this mount."""
    relative = os.path.relpath(path, mount_root) if mount_root != "/" else path.lstrip("/")
    if relative.startswith(".."):
        return None
    directory = mount_point / relative if relative not in ("", ".") else mount_point
    return directory if directory.is_dir() else None


def _v1_hierarchy(mount_root: str, mount_point: Path, controllers: list[str],
                  paths: dict[str, str], root: bool, reasons: list[str]) -> Hierarchy | None:
    usable = []
    for name in controllers:
        path = paths.get(name)
        base = None if path is None else _inside(mount_root, mount_point, path)
        if base is None:
            reasons.append(f"this process's {name} cgroup is not under {mount_point}")
            continue
        if not root or not os.access(base, os.W_OK):
            reasons.append(f"{base} is not writable (cgroup v1 limits need root)")
            continue
        usable.append((name, base))
    if not usable:
        return None
    return Hierarchy(1, usable[0][1], frozenset(name for name, _ in usable))


def _v2_hierarchy(mount_root: str, mount_point: Path, path: str | None,
                  reasons: list[str]) -> Hierarchy | None:
    base = None if path is None else _inside(mount_root, mount_point, path)
    if base is None:
        return None
    try:
        available = set((base / "cgroup.controllers").read_text().split())
        enabled = set((base / "cgroup.subtree_control").read_text().split())
    except OSError:
        return None
    offered = [name for name in CONTROLLERS if name in available]
    if not offered:
        return None
    missing = [name for name in offered if name not in enabled]
    if missing:
        try:
            (base / "cgroup.subtree_control").write_text(" ".join(f"+{n}" for n in missing))
        except OSError as error:
            reasons.append(
                f"cgroup v2 offers {', '.join(missing)} but cannot enable them for the "
                f"children of {base} ({error.strerror}: a cgroup holding processes "
                "cannot; run harbor in a cgroup of its own whose parent delegates them)")
            offered = [name for name in offered if name in enabled]
    if not offered:
        return None
    return Hierarchy(2, base, frozenset(offered))


@dataclass
class TrialCgroup:
    """One trial's cgroups (one per hierarchy used), with its limits written; none when
    there is nothing to limit or nowhere to do it. Removed at the end of its ``with``
    block, once the processes in it were killed."""

    directories: tuple[Path, ...] = ()
    memory: Path | None = None  # the trial's cgroup in the hierarchy with ``memory``

    @classmethod
    def create(cls, limits: Limits) -> TrialCgroup:
        """Make the cgroups ``limits`` need and write the limits."""
        name = f"{PREFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}"
        made = cls()
        with contextlib.ExitStack() as on_fail:
            on_fail.enter_context(made)  # what was made so far goes if a step fails
            for hierarchy in host_cgroups().for_limits(limits):
                directory = hierarchy.base / name
                directory.mkdir()
                made.directories += (directory,)
                _write_limits(directory, hierarchy, limits)
                if "memory" in hierarchy.controllers:
                    made.memory = directory
            on_fail.pop_all()
        return made

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the cgroups (blocks until the kernel emptied them, or a while); one
        still busy then is left to a later start, with a warning."""
        if not self.remove():
            log.warning("the sandbox's cgroup %s was not empty in time; a later start "
                        "removes it", ", ".join(map(str, self.directories)))

    @property
    def procs_files(self) -> tuple[Path, ...]:
        """Where a process writes its PID to join (its children follow)."""
        return tuple(directory / "cgroup.procs" for directory in self.directories)

    def oom_kills(self) -> int | None:
        """How many processes the kernel killed for want of memory in the trial, as
        its memory cgroup counts them; None when that cannot be read."""
        if self.memory is None:
            return None
        for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
            with contextlib.suppress(OSError, ValueError):
                for line in (self.memory / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return None

    def remove(self, patience: float = REMOVE_PATIENCE_SEC) -> bool:
        """Remove the cgroups once the kernel has emptied them (their processes
        were killed); True when all are gone."""
        deadline = time.monotonic() + patience
        left = list(self.directories)
        while left:
            for directory in list(left):
                try:
                    directory.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                left.remove(directory)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return not left


def _write_limits(directory: Path, hierarchy: Hierarchy, limits: Limits) -> None:
    def write(name: str, value: int | str) -> None:
        (directory / name).write_text(str(value))

    if limits.cpus is not None and "cpu" in hierarchy.controllers:
        quota = max(MIN_CPU_QUOTA_US, round(limits.cpus * CPU_PERIOD_US))
        if hierarchy.version == 2:
            write("cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            write("cpu.cfs_period_us", CPU_PERIOD_US)
            write("cpu.cfs_quota_us", quota)
    if limits.pids is not None and "pids" in hierarchy.controllers:
        write("pids.max", limits.pids)
    if limits.memory_mb is not None and "memory" in hierarchy.controllers:
        memory = limits.memory_mb << 20
        # As Docker's --memory alone: as much swap again as memory, no more.
        if hierarchy.version == 2:
            write("memory.max", memory)
            if (directory / "memory.swap.max").exists():
                write("memory.swap.max", memory)
        else:
            write("memory.limit_in_bytes", memory)
            if (directory / "memory.memsw.limit_in_bytes").exists():
                write("memory.memsw.limit_in_bytes", 2 * memory)
    if limits.pids is not None and "pids" in hierarchy.controllers:
        write("pids.max", limits.pids)


def remove_stale_cgroups(host: HostCgroups | None = None) -> list[Path]:
    """Remove trials' cgroups whose owning process is gone (a SIGKILLed harbor); a
    cgroup still holding processes is never removed (the kernel refuses)."""
    removed = []
    for hierarchy in (host or host_cgroups()).hierarchies:
        for directory in hierarchy.base.glob(PREFIX + "*"):
            try:
                owner = int(directory.name.split(".")[1])
            except (IndexError, ValueError):
                continue
            if _alive(owner):
                continue
            # Children first (earlier versions made one, ``services``), then the cgroup.
            with contextlib.suppress(OSError):
                for child in directory.iterdir():
                    if child.is_dir():
                        child.rmdir()
            with contextlib.suppress(OSError):
                directory.rmdir()
                removed.append(directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True
