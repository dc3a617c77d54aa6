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
- :func:`link_stays_inside` is the rule for links recreated on the host.

These calls block; callers on an event loop run them in a thread.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

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
    "replace_beneath",
    "safe_mode",
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


class FileTooLarge(OSError):
    """A file is larger than the bound its reader allowed."""


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
