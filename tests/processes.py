"""Helpers to look at this machine's processes from tests."""

from __future__ import annotations

import os
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


def running(fragment: str) -> bool:
    return any(fragment in row for row in command_lines())
