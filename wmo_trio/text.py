"""Text that can always be sent and written: lone surrogates replaced.

A Python string can hold a lone surrogate (half of a JSON `\\ud800` escape pair, output an
environment decoded with `surrogateescape`), which cannot be encoded as UTF-8: it would
fail the next model request, a command, a trace. Whatever comes from outside passes here.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (as invalid bytes are)."""
    if _SURROGATE.search(text) is None:
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
