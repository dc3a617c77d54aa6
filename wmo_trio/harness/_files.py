"""Reading a document's file: only a regular file, never waiting on a FIFO or device, at
most `MAX_DOCUMENT_BYTES`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from wmo_trio.harness._document import HarnessDoc
from wmo_trio.harness._json import parse_harness_json
from wmo_trio.harness._limits import MAX_DOCUMENT_BYTES, HarnessError, show_path

_FILE_TYPES = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket"}


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


def _read_regular_file(file: Path) -> bytes:
    data = b""
    try:
        # Looked at before opening: opening a FIFO for reading waits for a writer.
        info = os.stat(file)
        if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_DOCUMENT_BYTES:
            # O_NONBLOCK: should the path have become a FIFO since, open returns at once.
            fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode):
                    data = _read_at_most(fd, MAX_DOCUMENT_BYTES + 1)
            finally:
                os.close(fd)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise Unreadable(f"cannot read harness document {show_path(file)}: {reason}") from None
    except ValueError as error:  # a NUL in the path, or a path that cannot be encoded
        raise Unreadable(f"cannot read harness document {show_path(file)}: {error}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = _FILE_TYPES.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise HarnessError(f"cannot read harness document {show_path(file)}: it is {kind}, "
                           "not a regular file; give the path of a JSON file")
    size = max(info.st_size, len(data))
    if size > MAX_DOCUMENT_BYTES:
        raise HarnessError(f"{show_path(file)} is {size:,} bytes, over the limit of "
                           f"{MAX_DOCUMENT_BYTES:,} bytes for a harness document")
    return data


class Unreadable(HarnessError):
    """No file could be opened at the path (missing, not permitted, not a path at all)."""


def load_harness(path: str | os.PathLike[str]) -> HarnessDoc:
    """Read and validate a document from a JSON file; errors name the file and the surface.

    Only regular files are read (a FIFO, directory or device is refused without waiting on
    it), at most `MAX_DOCUMENT_BYTES` of them. Raises `HarnessError`.
    """
    file = Path(path)
    return parse_harness_json(_read_regular_file(file), source=show_path(file))
