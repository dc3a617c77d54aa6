"""Copying files and directories into a sandbox, by the host alone, under the rules of
:mod:`wmo_trio.sandbox._transfer` (the copy out): no program of the trial's root takes
part, a path harbor names is resolved as the trial sees it, clamped inside its root,
and below it no link is followed. What is copied in is root's, modes kept.

Copies run in a worker thread; a cancelled copy stops at its next file or chunk.
"""

from __future__ import annotations

import collections
import errno
import os
import posixpath
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from wmo_trio.sandbox import _hostfs
from wmo_trio.sandbox._transfer import DIR_FLAGS, Budget, Stopped, copy_data, in_thread

__all__ = ["upload_dir", "upload_file"]


def _make_dirs_in_root(root_fd: int, path: str) -> int:
    """``mkdir -p`` of ``path`` as the trial sees it (its links followed inside its
    root); a descriptor of the directory. Directories made here are root's, mode 755."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    fd = _hostfs.open_in_root(root_fd, "/", DIR_FLAGS)
    for index, part in enumerate(parts):
        prefix = "/".join(parts[: index + 1])
        made = False
        try:
            child = _hostfs.open_in_root(root_fd, prefix, DIR_FLAGS)
        except FileNotFoundError:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                made = True
            except FileExistsError:
                pass
            child = _hostfs.open_in_root(root_fd, prefix, DIR_FLAGS)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        fd = child
        if made:
            os.fchmod(fd, 0o755)
    return fd


def _write_from(source_fd: int, size: int, mode: int, mtime_ns: int,
                cancelled: threading.Event) -> Callable[[int], None]:
    def write(target_fd: int) -> None:
        copy_data(source_fd, target_fd, size, Budget(None, cancelled))
        os.fchown(target_fd, 0, 0)
        os.utime(target_fd, ns=(mtime_ns, mtime_ns))

    return write


async def upload_file(open_root: Callable[[], int], source: Path, target: str) -> None:
    """Copy a host file in, owned by root, mode kept. A target that is a directory (or
    ends with ``/``) receives the file under its own name; missing parent directories
    are made."""
    cancelled = threading.Event()

    def run() -> None:
        with source.open("rb") as handle:
            info = os.fstat(handle.fileno())
            root_fd = open_root()
            try:
                name = source.name
                if target.endswith("/"):
                    directory = _make_dirs_in_root(root_fd, target)
                else:
                    try:
                        directory = _hostfs.open_in_root(root_fd, target, DIR_FLAGS)
                    except OSError as error:
                        if error.errno not in (errno.ENOENT, errno.ENOTDIR):
                            raise
                        parent, name = posixpath.split(posixpath.normpath("/" + target))
                        directory = _make_dirs_in_root(root_fd, parent)
            finally:
                os.close(root_fd)
            try:
                mode = stat.S_IMODE(info.st_mode)
                _hostfs.replace_beneath(directory, name,
                                        _write_from(handle.fileno(), info.st_size, mode,
                                                    info.st_mtime_ns, cancelled), mode)
            finally:
                os.close(directory)

    await in_thread(run, cancelled=cancelled)


def _upload_tree(source_top: int, target_top: int, cancelled: threading.Event) -> None:
    pending: collections.deque[str] = collections.deque([""])
    while pending:
        relative = pending.popleft()
        source = _hostfs.open_beneath(source_top, relative or ".", DIR_FLAGS)
        try:
            target = _hostfs.open_beneath(target_top, relative or ".", DIR_FLAGS)
        except BaseException:
            os.close(source)
            raise
        try:
            with os.scandir(source) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    if cancelled.is_set():
                        raise Stopped("cancelled")
                    info = entry.stat(follow_symlinks=False)
                    path = f"{relative}/{entry.name}" if relative else entry.name
                    if stat.S_ISDIR(info.st_mode):
                        made = _hostfs.make_dir_beneath(target, entry.name, 0o755)
                        try:
                            os.fchmod(made, stat.S_IMODE(info.st_mode))
                            os.fchown(made, 0, 0)
                        finally:
                            os.close(made)
                        pending.append(path)
                    elif stat.S_ISLNK(info.st_mode):
                        _hostfs.replace_link_beneath(target, entry.name,
                                                     os.readlink(entry.name, dir_fd=source))
                    elif stat.S_ISREG(info.st_mode):
                        path_fd = _hostfs.open_beneath(source, entry.name, os.O_PATH)
                        try:
                            fd = _hostfs.open_regular(path_fd)
                        finally:
                            os.close(path_fd)
                        if fd is None:
                            continue
                        try:
                            mode = stat.S_IMODE(info.st_mode)
                            _hostfs.replace_beneath(target, entry.name,
                                                    _write_from(fd, info.st_size, mode,
                                                                info.st_mtime_ns, cancelled),
                                                    mode)
                        finally:
                            os.close(fd)
        finally:
            os.close(source)
            os.close(target)


async def upload_dir(open_root: Callable[[], int], source: Path, target: str) -> None:
    """Copy a host directory's contents into ``target`` (made if needed), owned by
    root, modes kept, replacing files there. Links in ``source`` are copied as links,
    never followed."""
    cancelled = threading.Event()

    def run() -> None:
        try:
            source_top = os.open(source, DIR_FLAGS | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{source} is not a directory") from None
        try:
            root_fd = open_root()
            try:
                target_top = _make_dirs_in_root(root_fd, target)
            finally:
                os.close(root_fd)
            try:
                _upload_tree(source_top, target_top, cancelled)
            finally:
                os.close(target_top)
        finally:
            os.close(source_top)

    await in_thread(run, cancelled=cancelled)
