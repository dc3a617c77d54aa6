"""Reading a file wmo_trio did not write (a harness document, harbor's records, a trial's
trace): a regular file only, looked at before it is opened (opening a FIFO waits for a
writer, opening a device may act on it), never more than a bound, and through a symbolic
link only when the caller says so (a trial's directory is the trial's to fill).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FILE_TYPES = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket"}


class NotARegularFile(ValueError):
    """The path names a directory, a FIFO, a device or a socket; the message says which."""


class TooLarge(ValueError):
    """The file holds more than the bound: `size` bytes (at least), against `limit`."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"it is {size:,} bytes, over the limit of {limit:,}")
        self.size, self.limit = size, limit


def read_bounded(path: Path | str, limit: int, *, follow: bool = False) -> bytes:
    """The bytes of the regular file at `path`, of at most `limit` bytes.

    Raises `OSError` when it cannot be looked at or opened (`errno.ELOOP` for a link not
    followed), `NotARegularFile` or `TooLarge` saying what it is, and `ValueError` for a
    path the system cannot take (a NUL in it)."""
    info = os.stat(path, follow_symlinks=follow)
    if stat.S_ISLNK(info.st_mode):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    _check(info, limit)
    # O_NONBLOCK: should the path have become a FIFO since, open returns at once.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                 | (0 if follow else os.O_NOFOLLOW))
    try:
        info = os.fstat(fd)
        _check(info, limit)
        data = _read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(len(data), limit)
    return data


def _check(info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = _FILE_TYPES.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise NotARegularFile(f"it is {kind}, not a regular file")
    if info.st_size > limit:
        raise TooLarge(info.st_size, limit)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = os.read(fd, min(limit - total, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
