"""Helpers to look at this machine's processes from tests."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


def command_lines() -> list[str]:
    """The command line of every process, arguments joined by spaces."""
    rows = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            rows.append(raw.replace(b"\0", b" ").decode(errors="replace"))
    return rows


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (its children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(name))
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found += children.get(current, [])
        pending += children.get(current, [])
    return found


def running(fragment: str) -> bool:
    return any(fragment in row for row in command_lines())


def when_written(fifo: Path, then: Callable[[], None]) -> None:
    """Make `fifo` a named pipe and, in a thread of its own, call `then()` once a process
    has written to it and closed it: a test's shell command says it is running with
    `echo > fifo`, and the test acts on that instead of guessing how long it takes."""
    os.mkfifo(fifo)

    def wait() -> None:
        with open(fifo, "rb") as pipe:  # blocks until the command opens it for writing
            pipe.read()
        then()

    threading.Thread(target=wait, daemon=True).start()
