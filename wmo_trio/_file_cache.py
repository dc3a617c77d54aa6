"""Files read once per process: a candidate's document and a provider's script are parsed
the first time (harbor's preflight, before any trial) and then served from memory to every
trial, so that no trial reads them on harbor's event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Distinct file versions kept; a research loop that rewrites one file thousands of times
# must not grow the process without bound.
_KEPT = 64


# functools.lru_cache is the cache: its bookkeeping is thread-safe, it keeps no exception
# (a failure is said again to the next caller), and two threads that miss together may both
# parse, which costs time only. The file's version is part of the key, read by a `stat`
# before the call, so a rewritten file is a new entry and the old one ages out.
@functools.lru_cache(maxsize=_KEPT)
def _parsed(parse: Callable[[Path], Any], path: Path, version: tuple[int, ...]) -> Any:
    return parse(path)


def parse_file_once[T](path: Path, parse: Callable[[Path], T]) -> T:
    """`parse(path)`, computed once per version of the file (its identity, size and
    modification time; a `stat`, no read, tells them) and kept. A failure is not kept; a
    path that cannot be `stat`ed is left to `parse`, which says what is wrong with it."""
    try:
        stat = path.stat()
    except (OSError, ValueError):  # missing, or not a path the system can take
        return parse(path)  # let the parser say what is wrong, in its own words
    value: T = _parsed(parse, path, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return value
