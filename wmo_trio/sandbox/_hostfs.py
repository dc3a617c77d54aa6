"""The host's rule for paths a trial or a build wrote: never follow their links, never
read without a bound, never open what is not a regular file or a directory.

A trial's root (seen through ``/proc/<pid>/root``), a sandbox's upper directories and
an image's layer are all written by code we do not trust, and the host touches them as
root. Every host access to them goes through this module:

- :func:`open_in_root` resolves a path as the trial sees it, its links followed but
  clamped inside its root (``openat2``'s ``RESOLVE_IN_ROOT``);
- :func:`open_beneath` reaches an entry below a directory the host already holds,
  refusing any link on the way (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``);
- :func:`open_regular` opens a file for reading only once it is known to be a regular
  file, so a FIFO, a device or a socket is never opened for reading;
- :func:`kernel_filesystem` names the kernel's own filesystems (``/proc`` and its
  kin), whose files the host must not read for a trial: read with the host's
  credentials they say more than the trial may know (``/proc/keys``, ``kallsyms``);
- :func:`read_beneath` and :func:`read_tail` read such a file with a size bound;
- :func:`replace_beneath` writes a file under a temporary name and renames it into
  place, so a link already there is replaced, never written through;
- :func:`link_stays_inside` is the rule for links recreated on the host;
- :func:`remove_tree` and :func:`tree_size` walk a whole tree without recursion
  (Python's ``shutil.rmtree`` and ``os.walk`` recurse once per level: a tree a few
  thousand levels deep raises ``RecursionError``), and :func:`remove_or_set_aside` is
  the rule for a tree that will not go: moved out of every later trial's way.

These calls block; callers on an event loop run them in a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import posixpath
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wmo_trio.sandbox._errors import FileTooLarge

__all__ = [
    "FileTooLarge",
    "kernel_filesystem",
    "link_stays_inside",
    "open_beneath",
    "open_in_root",
    "open_regular",
    "read_beneath",
    "read_tail",
    "remove_beneath",
    "remove_or_set_aside",
    "remove_tree",
    "replace_beneath",
    "safe_mode",
    "tree_size",
]

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
# The same number on every architecture: openat2 came after the syscall tables merged.
_SYS_OPENAT2 = 437
# openat2 answers EAGAIN when a rename or a mount raced a RESOLVE_BENEATH/IN_ROOT walk.
_RACE_RETRIES = 16
_BENEATH = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
# Reading never blocks on what only looks like a file, never takes a terminal.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


# linux/magic.h: filesystems whose files are the kernel's, not a trial's data.
KERNEL_FILESYSTEMS = {
    0x9FA0: "proc", 0x62656572: "sysfs", 0x27E0EB: "cgroup", 0x63677270: "cgroup2",
    0x64626720: "debugfs", 0x74726163: "tracefs", 0x73636673: "securityfs",
    0xCAFE4A11: "bpf", 0x62656570: "configfs", 0xDE5E81E4: "efivarfs",
    0x6165676C: "pstore", 0xF97CFF8C: "selinuxfs", 0x42494E4D: "binfmt_misc",
    0x1CD1: "devpts", 0x65735543: "fusectl",
}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_fstatfs = _libc.fstatfs
_fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


def kernel_filesystem(fd: int) -> str | None:
    """The name of the kernel filesystem ``fd`` is on (``"proc"``...), or None."""
    buffer = ctypes.create_string_buffer(512)  # struct statfs, f_type first
    if _fstatfs(fd, buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return KERNEL_FILESYSTEMS.get(ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF)


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """``openat2(2)``: a new file descriptor (close-on-exec), or an ``OSError``."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    encoded = os.fsencode(path)
    for _ in range(_RACE_RETRIES):
        fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(encoded),
                      ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        code = ctypes.get_errno()
        if code == errno.ENOSYS:
            raise OSError(code, "this kernel has no openat2 (Linux 5.6 or later is needed)")
        if code != errno.EAGAIN:
            raise OSError(code, os.strerror(code), path)
    raise OSError(errno.EAGAIN, "the directory kept changing while it was walked", path)


def open_in_root(root_fd: int, path: str, flags: int) -> int:
    """Open ``path`` as a process whose root is ``root_fd`` would: absolute links and
    ``..`` stay inside that root; magic links (``/proc/<pid>/fd/...``) are refused."""
    return openat2(root_fd, path.lstrip("/") or ".", flags, _IN_ROOT)


def open_beneath(dirfd: int, relative: str, flags: int, mode: int = 0) -> int:
    """Open ``relative`` below ``dirfd``; a link anywhere on the way, ``..`` out of it
    or an absolute path is an error (``ELOOP``, ``EXDEV``)."""
    return openat2(dirfd, relative, flags | os.O_NOFOLLOW, _BENEATH, mode)


def open_regular(path_fd: int) -> int | None:
    """A descriptor to read the file ``path_fd`` (an ``O_PATH`` descriptor) names, or
    None when it is not a regular file: only a checked regular file is ever opened for
    reading, by reopening that very inode."""
    if not stat.S_ISREG(os.fstat(path_fd).st_mode):
        return None
    return os.open(f"/proc/self/fd/{path_fd}", READ_FLAGS)


def read_beneath(base: Path, relative: str, limit: int) -> bytes | None:
    """The contents of the regular file ``relative`` below ``base``, or None if there
    is none there (missing, a link on the way, a directory, a FIFO...). Raises
    :class:`FileTooLarge` past ``limit`` bytes."""
    base_fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            path_fd = open_beneath(base_fd, relative, os.O_PATH)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                return None
            raise
        try:
            fd = open_regular(path_fd)
        finally:
            os.close(path_fd)
    finally:
        os.close(base_fd)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(errno.EFBIG, f"larger than {limit} bytes", str(base / relative))
    return data


def read_tail(path: Path, limit: int) -> bytes:
    """The last ``limit`` bytes of the regular file at ``path`` (empty if there is no
    such file); its final component is never followed."""
    try:
        path_fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    try:
        fd = open_regular(path_fd)
    finally:
        os.close(path_fd)
    if fd is None:
        return b""
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        handle.seek(max(0, size - limit))
        return handle.read(limit)


def remove_beneath(base: Path, relative: str) -> None:
    """Remove the entry ``relative`` below ``base`` (a link itself, never its target);
    nothing if the way to it holds a link or it is missing."""
    parent, name = posixpath.split(relative)
    base_fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            dir_fd = open_beneath(base_fd, parent or ".", os.O_PATH | os.O_DIRECTORY)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                return
            raise
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dir_fd)
    finally:
        os.close(base_fd)


def safe_mode(mode: int, *, directory: bool = False) -> int:
    """A host copy's mode: no setuid, setgid or sticky bit, no write for group or
    others, always readable and writable (and, for a directory, searchable) by its
    owner."""
    kept = stat.S_IMODE(mode) & 0o755
    return kept | (0o700 if directory else 0o600)


def replace_beneath(dir_fd: int, name: str, write: Callable[[int], None], mode: int) -> None:
    """Create ``name`` in ``dir_fd`` with what ``write(fd)`` writes: under a temporary
    name first, then renamed over whatever is there (a link there is replaced, never
    written through; a directory there is an ``IsADirectoryError``). A failed write
    leaves nothing behind."""
    temporary = f".{name[:32]}.{uuid.uuid4().hex[:12]}.part"
    fd = open_beneath(dir_fd, temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            write(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        _rename_over(dir_fd, temporary, name)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def replace_link_beneath(dir_fd: int, name: str, target: str) -> None:
    """Create the link ``name -> target`` in ``dir_fd``, replacing a file or link there."""
    temporary = f".{name[:32]}.{uuid.uuid4().hex[:12]}.part"
    os.symlink(target, temporary, dir_fd=dir_fd)
    try:
        _rename_over(dir_fd, temporary, name)
    except BaseException:
        os.unlink(temporary, dir_fd=dir_fd)
        raise


def _rename_over(dir_fd: int, temporary: str, name: str) -> None:
    try:
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as error:
        if error.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            raise IsADirectoryError(errno.EISDIR, "a directory of that name is there",
                                    name) from None
        raise


def make_dir_beneath(dir_fd: int, name: str, mode: int) -> int:
    """Open the directory ``name`` in ``dir_fd``, made with ``mode`` if missing; a file
    or link of that name is replaced by the directory."""
    for _ in range(_RACE_RETRIES):
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
        try:
            return open_beneath(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as error:
            if error.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
        os.unlink(name, dir_fd=dir_fd)
    raise OSError(errno.EAGAIN, "the entry kept changing", name)


def link_stays_inside(link: str, target: str) -> bool:
    """Whether the link at ``link`` (a relative path inside a copied tree) pointing to
    ``target`` resolves inside that tree on the host, whatever the other links there
    are.

    A target is accepted when it is relative and its ``..`` components all come first,
    no more of them than the link's depth: they then climb real directories only (a
    copy's directories are real directories), and every link reached afterwards obeys
    the same rule. A ``..`` after a name (``d/../x``) could climb out of whatever ``d``
    points to, so it is refused even when it cancels out lexically.
    """
    if not target or target.startswith("/") or "\0" in target:
        return False
    depth = len([part for part in link.split("/") if part not in ("", ".")]) - 1
    climbing = True
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not climbing:
                return False
            depth -= 1
            if depth < 0:
                return False
        else:
            climbing = False
    return True


# ---------------------------------------------------------------------- whole trees


@dataclass
class _Level:
    """A directory an iterative walk is inside: its name in its parent, its identity,
    and the subdirectories it has yet to enter (None until it is listed)."""

    name: str
    identity: tuple[int, int]
    pending: list[str] | None = None


def _walk_tree(top: Path, entry: Callable[[int, str, os.stat_result], bool],
               leave: Callable[[int, str], None]) -> None:
    """Visit the tree below the directory ``top`` depth first, without recursion and
    without following a link: ``entry(dir_fd, name, info)`` for each entry, which
    returns whether it is done with it; a directory of the same filesystem it is not
    done with is entered (never a link, nor another filesystem's directory), and
    ``leave(parent_fd, name)`` is called once all below it was visited.

    However deep the tree, two descriptors are open at a time: the walk climbs back
    through ``..``, checking that it reaches the directory it came from (nothing may
    move the tree meanwhile; an ``OSError`` says if something did). A directory's
    subdirectory names are kept while below it, so a walk holds as many names as the
    directories it has yet to enter."""
    fd = os.open(top, _WALK_FLAGS)
    try:
        info = os.fstat(fd)
        device = info.st_dev
        levels = [_Level("", (info.st_dev, info.st_ino))]
        while levels:
            level = levels[-1]
            if level.pending is None:
                level.pending = []
                with os.scandir(fd) as listing:
                    for item in listing:
                        found = item.stat(follow_symlinks=False)
                        if (not entry(fd, item.name, found) and stat.S_ISDIR(found.st_mode)
                                and found.st_dev == device):
                            level.pending.append(item.name)
            if level.pending:
                name = level.pending.pop()
                child = _open_child(fd, name)
                found = os.fstat(child)
                os.close(fd)
                fd = child
                levels.append(_Level(name, (found.st_dev, found.st_ino)))
                continue
            levels.pop()
            if not levels:
                return
            parent = os.open("..", _WALK_FLAGS, dir_fd=fd)
            found = os.fstat(parent)
            os.close(fd)
            fd = parent
            if (found.st_dev, found.st_ino) != levels[-1].identity:
                raise OSError(errno.ESTALE, "the tree moved while it was walked", str(top))
            leave(fd, level.name)
    finally:
        os.close(fd)


_WALK_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_child(dir_fd: int, name: str) -> int:
    """A subdirectory, never a link; one its mode closes (overlayfs leaves mode-000
    directories in its work directory) is opened once its owner may enter it."""
    try:
        return os.open(name, _WALK_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if not stat.S_ISDIR(os.fstat(path_fd).st_mode):
                raise
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
        finally:
            os.close(path_fd)
        return os.open(name, _WALK_FLAGS, dir_fd=dir_fd)


def remove_tree(path: Path) -> None:
    """Remove ``path`` and all below it, however deep, following no link (a link is
    removed, never its target) and entering no other filesystem (a mount point
    below it makes this fail). Nothing if it is missing; an ``OSError`` if something
    stays."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        path.unlink()
        return

    def entry(dir_fd: int, name: str, found: os.stat_result) -> bool:
        try:
            if not stat.S_ISDIR(found.st_mode):
                os.unlink(name, dir_fd=dir_fd)
            else:  # an empty directory needs no visit (most of a tree's are)
                os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:  # gone already
            pass
        except OSError as error:
            if error.errno != errno.ENOTEMPTY:
                raise  # another filesystem's directory (EBUSY), say
            return False
        return True

    def leave(dir_fd: int, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(name, dir_fd=dir_fd)

    _walk_tree(path, entry, leave)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def tree_size(path: Path) -> int:
    """The bytes of everything below the directory ``path`` (as ``lstat`` counts them),
    however deep, following no link."""
    total = 0

    def entry(dir_fd: int, name: str, found: os.stat_result) -> bool:
        nonlocal total
        total += found.st_size
        return False

    _walk_tree(path, entry, lambda dir_fd, name: None)
    return total


QUARANTINE = ".quarantine"


def remove_or_set_aside(path: Path, logger: logging.Logger) -> Path | None:
    """Remove ``path`` (:func:`remove_tree`); when some of it cannot go, move what is
    left out of the way, to ``.quarantine/`` beside it, and say so once in the log, so
    that nothing a trial or a build left there blocks a later one. Where it was set
    aside, or None once it is gone."""
    try:
        remove_tree(path)
        return None
    except OSError as error:
        reason = error
    aside_dir = path.parent / QUARANTINE
    aside_dir.mkdir(mode=0o700, exist_ok=True)
    aside = aside_dir / f"{path.name}.{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    logger.warning("could not remove %s (%s); set it aside as %s, which no later trial "
                   "or build touches: remove it by hand once whatever holds it is gone",
                   path, reason, aside)
    return aside
