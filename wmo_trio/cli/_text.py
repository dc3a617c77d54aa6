"""Text from trials, tasks and argv, made safe to print on a terminal."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """`text` with every control character but newline and tab shown as an escape (and
    undecodable bytes of a file name as escapes too), so it cannot move the cursor,
    retitle the terminal or reorder the line."""
    shown = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")
