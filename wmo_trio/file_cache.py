"""Files read once per process: a candidate's document and a provider's script are parsed
the first time (harbor's preflight, before any trial) and then served from memory to every
trial, so that no trial reads them on harbor's event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Distinct file versions kept; a research loop that rewrites one file thousands of times
# must not grow the process without bound.
_KEPT = 64
_lock = threading.Lock()
_parsed: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def parse_file_once[T](path: Path, parse: Callable[[Path], T]) -> T:
    """`parse(path)`, computed once per version of the file (its identity, size and
    modification time; a `stat`, no read, tells them) and kept. A failure is not kept; a
    path that cannot be `stat`ed is left to `parse`, which says what is wrong with it."""
    try:
        stat = path.stat()
    except (OSError, ValueError):  # missing, or not a path the system can take
        return parse(path)  # let the parser say what is wrong, in its own words
    key = (parse, str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _lock:
        if key in _parsed:
            _parsed.move_to_end(key)
            cached: T = _parsed[key]
            return cached
    value = parse(path)
    with _lock:
        _parsed[key] = value
        while len(_parsed) > _KEPT:
            _parsed.popitem(last=False)
    return value
