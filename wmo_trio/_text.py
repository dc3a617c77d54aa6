"""Text that can always be sent, written and shown: lone surrogates found or replaced, and
a user's string as a one-line message quotes it.

A Python string can hold a lone surrogate (half of a JSON `\\ud800` escape pair, output an
environment decoded with `surrogateescape`), which cannot be encoded as UTF-8: it would
fail the next model request, a command, a trace. Whatever comes from outside passes here.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """Whether `text` holds a code point no UTF-8 text holds (one present came from a lone
    JSON escape or a `surrogateescape` decoding): such text cannot be encoded."""
    return _SURROGATE.search(text) is not None


def valid_text(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (as invalid bytes are)."""
    if not has_lone_surrogate(text):
        return text
    return _SURROGATE.sub("\ufffd", text)


def valid_json(value: Any) -> Any:
    """A JSON value with `valid_text` applied to every string in it, keys included."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {valid_json(key): valid_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [valid_json(item) for item in value]
    return value


def show(value: str, limit: int = 60) -> str:
    """A user-supplied string as it may appear in a one-line message: quoted, escaped, short."""
    if len(value) <= limit and len(repr(value)) <= limit + 2:
        return repr(value)
    kept = limit
    while kept > 1 and len(repr(value[:kept])) > limit + 2:  # escapes take several characters
        kept //= 2
    return f"{value[:kept]!r}... ({len(value):,} characters)"
