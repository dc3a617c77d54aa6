"""Copying files and directories out of a sandbox, by the host alone (the copy in:
:mod:`wmo_trio.sandbox._upload`, under the same rules).

No program of the trial's root takes part: a trial may have replaced its ``tar``,
``cat`` or ``sh``. The host reaches the trial's files through its root
(``/proc/<helper>/root``, its mounts included) with the rules of
:mod:`wmo_trio.sandbox._hostfs`: a path harbor names is resolved as the trial sees it,
clamped inside its root; below it no link is followed. A copy out writes beneath its
target only, never through a link, with modes stripped of setuid and setgid bits,
owned by harbor's user. It keeps links as links only when they stay inside the copied
tree, and is bounded in size and time (:class:`TransferLimits`): what fits is copied,
then :class:`TransferIncomplete` says what was left out.

Copies run in a worker thread; a cancelled copy stops at its next file or chunk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fnmatch
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wmo_trio.sandbox._errors import TransferIncomplete
from wmo_trio.sandbox._hostfs import (
    kernel_filesystem,
    link_stays_inside,
    make_dir_beneath,
    open_beneath,
    open_in_root,
    open_regular,
    replace_beneath,
    replace_link_beneath,
    safe_mode,
)

__all__ = [
    "DEFAULT_DOWNLOAD_LIMIT_MB",
    "DEFAULT_DOWNLOAD_TIMEOUT_SEC",
    "TransferLimits",
    "download_dir",
    "download_file",
    "tar_excluded",
]

DEFAULT_DOWNLOAD_LIMIT_MB = 1024
DEFAULT_DOWNLOAD_TIMEOUT_SEC = 300.0
# Each entry costs at least a block: a million empty files fill a disk's inodes.
BLOCK = 4096
CHUNK = 1 << 20
# A host path must stay usable by harbor's path-based code (PATH_MAX is 4096 bytes).
MAX_RELATIVE_PATH = 2048
# And a host tree must stay usable by harbor's tree walks, which recurse once per level
# (`harbor jobs resume` removes a trial's directory with shutil.rmtree: RecursionError
# near 1,000 levels). Honest tasks' outputs nest a few dozen levels at most.
MAX_DEPTH = 256
LISTED_LEFT_OUT = 10
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
# Read with the host's credentials, such files say more than the trial may know.
_KERNEL_FILE = "it is on the kernel's {} filesystem, which the host does not read for a trial"


@dataclass(frozen=True)
class TransferLimits:
    """Bounds of one copy out of a sandbox: its size (each file's length rounded up to
    whole 4 KiB blocks, holes included, each directory and link one block) and its
    duration."""

    max_bytes: int = DEFAULT_DOWNLOAD_LIMIT_MB << 20
    timeout_sec: float = DEFAULT_DOWNLOAD_TIMEOUT_SEC


class Stopped(Exception):
    """A copy ended early: ``cancelled``, ``time`` (its time limit) or ``cap`` (its size
    cap)."""


class Budget:
    """What one copy may still spend: bytes under its limits' cap, time before their
    deadline (no limits: no bound); and whether its caller was cancelled."""

    def __init__(self, limits: TransferLimits | None, cancelled: threading.Event) -> None:
        self.limits = limits
        self.deadline = None if limits is None else time.monotonic() + limits.timeout_sec
        self.cancelled = cancelled
        self.used = 0

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Stopped("cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Stopped("time")

    def fits(self, cost: int) -> bool:
        return self.limits is None or self.used + cost <= self.limits.max_bytes

    def take(self, cost: int) -> bool:
        if not self.fits(cost):
            return False
        self.used += cost
        return True


@dataclass
class Outcome:
    """What a copy out did: what it copied, left out and did not recreate."""

    source: str
    target: Path
    limits: TransferLimits
    files: int = 0
    left_out: list[tuple[str, str]] = field(default_factory=list)
    dropped_links: list[tuple[str, str]] = field(default_factory=list)
    stopped: str | None = None

    def check(self) -> None:
        """Raise :class:`TransferIncomplete` if anything was left out."""
        if not self.left_out and self.stopped is None:
            return
        parts = []
        if self.left_out:
            shown = "; ".join(f"{path} ({why})" for path, why in self.left_out[:LISTED_LEFT_OUT])
            more = len(self.left_out) - LISTED_LEFT_OUT
            parts.append(f"left out {len(self.left_out)} entr"
                         f"{'y' if len(self.left_out) == 1 else 'ies'}: {shown}"
                         + (f"; and {more} more" if more > 0 else ""))
        if self.stopped == "time":
            parts.append(f"stopped at its time limit of {self.limits.timeout_sec:g} s, so "
                         "what it had not reached was not copied (raise it with "
                         "--ek download_timeout_sec=N)")
        elif self.stopped == "cap":
            parts.append("stopped once the download cap was full, so what it had not "
                         "reached was not copied")
        if any("download cap" in why for _, why in self.left_out) or self.stopped == "cap":
            parts.append(f"the cap is {self.limits.max_bytes >> 20} MB per download (raise "
                         "it with --ek download_limit_mb=N)")
        raise TransferIncomplete(
            f"download of {self.source} into {self.target} "
            + "; ".join(parts) + f"; {self.files} files were copied")

    def warning(self) -> str | None:
        """One line naming the links that were not recreated, if any."""
        if not self.dropped_links:
            return None
        shown = ", ".join(f"{path} -> {target}"
                          for path, target in self.dropped_links[:LISTED_LEFT_OUT])
        more = len(self.dropped_links) - LISTED_LEFT_OUT
        return (f"download of {self.source}: {len(self.dropped_links)} link(s) pointing "
                f"outside the copied directory were not created: {shown}"
                + (f" and {more} more" if more > 0 else ""))


async def in_thread(function: Callable[[], None], *, cancelled: threading.Event) -> None:
    """Run a copy in a worker thread. Cancelled, it sets ``cancelled`` and returns at
    once; the thread stops at its next check."""
    try:
        await asyncio.to_thread(function)
    except asyncio.CancelledError:
        cancelled.set()  # the thread stops at its next check
        raise


def _blocks(size: int) -> int:
    return max(BLOCK, -(-size // BLOCK) * BLOCK)


def copy_data(source_fd: int, target_fd: int, size: int, budget: Budget) -> None:
    """Copy at most ``size`` bytes (a file growing meanwhile is cut where it was)."""
    offset = 0
    while offset < size:
        budget.check()
        count = min(CHUNK, size - offset)
        try:
            sent = os.sendfile(target_fd, source_fd, offset, count)
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            chunk = os.pread(source_fd, count, offset)
            sent = len(chunk)
            os.write(target_fd, chunk)
        if sent == 0:
            break
        offset += sent


def _copy_file(source_dir: int, name: str, target_dir: int, budget: Budget,
               limit: int | None) -> str | None:
    """Copy the regular file ``name``; why it was not copied, or None."""
    try:
        path_fd = open_beneath(source_dir, name, os.O_PATH)
    except OSError as error:
        if error.errno in _GONE:
            return "it changed while it was copied"
        raise
    try:
        fd = open_regular(path_fd)
    finally:
        os.close(path_fd)
    if fd is None:
        return "it changed while it was copied"  # no longer a regular file
    try:
        kernel = kernel_filesystem(fd)
        if kernel is not None:
            return _KERNEL_FILE.format(kernel)
        info = os.fstat(fd)
        if limit is not None and info.st_size > limit:
            return f"{info.st_size:,} bytes, more than the download cap allows"
        if not budget.take(_blocks(info.st_size)):
            return f"{info.st_size:,} bytes, over what the download cap had left"

        def write(target_fd: int) -> None:
            copy_data(fd, target_fd, info.st_size, budget)
            os.utime(target_fd, ns=(info.st_atime_ns, info.st_mtime_ns))

        try:
            replace_beneath(target_dir, name, write, safe_mode(info.st_mode))
        except IsADirectoryError:
            return "a directory of that name is on the host"
        return None
    finally:
        os.close(fd)


def _open_tree(target_top: int, relative: str) -> int:
    """The host directory ``relative`` below the target, made (beneath it only, a link
    there replaced) if needed."""
    fd = os.dup(target_top)
    for part in relative.split("/") if relative else ():
        try:
            child = make_dir_beneath(fd, part, 0o755)
        finally:
            os.close(fd)
        fd = child
    return fd


class _Download:
    """One directory copy out, breadth first (what is near the top comes first). With
    ``select``, only the regular files it selects are copied, their directories made as
    needed (harbor's filtered download); ``exclude`` prunes entries and directories
    (tar's ``--exclude``)."""

    def __init__(self, outcome: Outcome, budget: Budget,
                 exclude: Callable[[str], bool] | None,
                 select: Callable[[str], bool] | None) -> None:
        self.outcome = outcome
        self.budget = budget
        self.exclude = exclude
        self.select = select
        self.pending: collections.deque[str] = collections.deque([""])

    def run(self, root_fd: int) -> None:
        try:
            source_top = open_in_root(root_fd, self.outcome.source, DIR_FLAGS)
        except OSError as error:
            if error.errno in _GONE:
                raise FileNotFoundError(f"no such directory: {self.outcome.source}") from None
            raise
        try:
            self.outcome.target.mkdir(parents=True, exist_ok=True)
            target_top = os.open(self.outcome.target, DIR_FLAGS | os.O_CLOEXEC)
            try:
                while self.pending:
                    self._directory(source_top, target_top, self.pending.popleft())
            except Stopped as stop:
                if str(stop) == "cancelled":
                    raise
                self.outcome.stopped = str(stop)
            finally:
                os.close(target_top)
        finally:
            os.close(source_top)

    def _directory(self, source_top: int, target_top: int, relative: str) -> None:
        try:
            source = open_beneath(source_top, relative or ".", DIR_FLAGS)
        except OSError as error:
            if error.errno not in _GONE:
                raise
            self.outcome.left_out.append((relative, "it changed while it was copied"))
            return
        with contextlib.ExitStack() as held:
            held.callback(os.close, source)
            kernel = kernel_filesystem(source)
            if kernel is not None:
                self.outcome.left_out.append((relative or ".", _KERNEL_FILE.format(kernel)))
                return
            target = _TargetDirectory(target_top, relative, held)
            if self.select is None:  # every directory comes out, empty ones too
                target.fd()
            with os.scandir(source) as entries:
                for entry in entries:
                    self.budget.check()
                    path = f"{relative}/{entry.name}" if relative else entry.name
                    if self._admitted(path):
                        self._entry(source, target, entry, path)

    def _admitted(self, path: str) -> bool:
        """Whether ``path`` is copied at all: not excluded, and not too long a path."""
        if self.exclude is not None and self.exclude(path):
            return False
        if len(os.fsencode(path)) > MAX_RELATIVE_PATH:
            self.outcome.left_out.append(
                (path[:80] + "...", f"its path is longer than {MAX_RELATIVE_PATH} bytes"))
            return False
        return True

    def _entry(self, source: int, target: _TargetDirectory, entry: os.DirEntry[str],
               path: str) -> None:
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
            self._subdirectory(path)
        elif stat.S_ISLNK(mode) and self.select is None:
            self._link(source, target.fd(), entry.name, path)
        elif stat.S_ISREG(mode) and (self.select is None or self.select(path)):
            if not self.budget.fits(BLOCK):
                raise Stopped("cap")
            self._file(source, target.fd(), entry.name, path)
        # FIFOs, sockets and devices carry no content: skipped, as harbor's own
        # transfers skip them (and links, in a filtered download).

    def _subdirectory(self, path: str) -> None:
        """Queue the directory ``path``, breadth first, unless it is too deep."""
        if path.count("/") + 1 > MAX_DEPTH:
            self.outcome.left_out.append(
                (path[:80] + "...", f"it is more than {MAX_DEPTH} directories "
                 "deep, which harbor's own tools cannot walk"))
            return
        if self.select is None:
            self._take(BLOCK)
        self.pending.append(path)

    def _take(self, cost: int) -> None:
        """Charge ``cost``; once it does not fit, the copy ends here."""
        if not self.budget.take(cost):
            raise Stopped("cap")

    def _link(self, source: int, target: int, name: str, path: str) -> None:
        link = os.readlink(name, dir_fd=source)
        if not link_stays_inside(path, link):
            self.outcome.dropped_links.append((path, link))
            return
        self._take(BLOCK)
        try:
            replace_link_beneath(target, name, link)
        except IsADirectoryError:
            self.outcome.left_out.append((path, "a directory of that name is on the host"))

    def _file(self, source: int, target: int, name: str, path: str) -> None:
        limits = self.budget.limits
        why = _copy_file(source, name, target, self.budget,
                         limits.max_bytes if limits is not None else None)
        if why is None:
            self.outcome.files += 1
        else:
            self.outcome.left_out.append((path, why))


class _TargetDirectory:
    """The host directory a copied directory's entries go to, made and opened when first
    needed (a filtered download makes only the directories its files are in) and closed
    with ``held``."""

    def __init__(self, target_top: int, relative: str, held: contextlib.ExitStack) -> None:
        self._top = target_top
        self._relative = relative
        self._held = held
        self._fd: int | None = None

    def fd(self) -> int:
        if self._fd is None:
            self._fd = _open_tree(self._top, self._relative)
            self._held.callback(os.close, self._fd)
        return self._fd


def tar_excluded(path: str, patterns: Sequence[str]) -> bool:
    """Whether tar's ``--exclude`` patterns leave out ``path``: a pattern matches any
    trailing part of it."""
    parts = path.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[index:]), pattern.strip("/"))
               for index in range(len(parts)) for pattern in patterns)


async def download_dir(open_root: Callable[[], int], source: str, target: Path,
                       limits: TransferLimits,
                       exclude: Callable[[str], bool] | None = None,
                       select: Callable[[str], bool] | None = None) -> Outcome:
    """Copy the directory ``source`` of the trial into ``target`` (made if needed),
    replacing files there. ``open_root`` gives a descriptor of the trial's root.

    Raises ``FileNotFoundError`` if there is no such directory. The returned
    :class:`Outcome` says what was left out (``Outcome.check`` raises for it) and
    which links were not recreated (``Outcome.warning``).
    """
    cancelled = threading.Event()
    outcome = Outcome(source=source, target=target, limits=limits)

    def run() -> None:
        root_fd = open_root()
        try:
            _Download(outcome, Budget(limits, cancelled), exclude, select).run(root_fd)
        finally:
            os.close(root_fd)

    await in_thread(run, cancelled=cancelled)
    return outcome


async def download_file(open_root: Callable[[], int], source: str, target: Path,
                        limits: TransferLimits) -> None:
    """Copy the trial's file ``source`` (its links followed inside the trial's root)
    to ``target``, making its parent directories; the host copy belongs to harbor's
    user. Raises ``FileNotFoundError`` if there is no such regular file and
    :class:`TransferIncomplete` if it does not fit the limits."""
    cancelled = threading.Event()

    def run() -> None:
        budget = Budget(limits, cancelled)
        root_fd = open_root()
        try:
            try:
                path_fd = open_in_root(root_fd, source, os.O_PATH)
            except OSError as error:
                if error.errno in _GONE:
                    raise FileNotFoundError(f"cannot download {source}: no such file") from None
                raise
        finally:
            os.close(root_fd)
        try:
            fd = open_regular(path_fd)
        finally:
            os.close(path_fd)
        if fd is None:
            raise FileNotFoundError(f"cannot download {source}: not a regular file")
        try:
            kernel = kernel_filesystem(fd)
            if kernel is not None:
                raise PermissionError(f"cannot download {source}: {_KERNEL_FILE.format(kernel)}")
            info = os.fstat(fd)
            if not budget.take(_blocks(info.st_size)):
                raise TransferIncomplete(
                    f"download of {source}: {info.st_size:,} bytes, over the download cap "
                    f"of {limits.max_bytes >> 20} MB (raise it with --ek download_limit_mb=N)")
            target.parent.mkdir(parents=True, exist_ok=True)
            parent = os.open(target.parent, DIR_FLAGS | os.O_CLOEXEC)
            try:
                replace_beneath(parent, target.name,
                                lambda out: copy_data(fd, out, info.st_size, budget),
                                safe_mode(info.st_mode))
            finally:
                os.close(parent)
        except Stopped as stop:
            if str(stop) == "cancelled":
                raise
            raise TransferIncomplete(
                f"download of {source} stopped at its time limit of {limits.timeout_sec:g} s "
                "and was not copied (raise it with --ek download_timeout_sec=N)") from None
        finally:
            os.close(fd)

    await in_thread(run, cancelled=cancelled)
