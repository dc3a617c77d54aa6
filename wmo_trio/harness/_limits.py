"""The limits of a harness document, its one error, and how a message shows what it was given."""

from __future__ import annotations

import os

from wmo_trio._text import show

# A real document is a few dozen surfaces and some kilobytes; these bounds are far above
# that and keep every check of a hostile document fast and bounded.

MAX_DOCUMENT_BYTES = 8 * 1024 * 1024
"""Largest document file or JSON text, in UTF-8 bytes."""
MAX_NESTING = 16
"""Deepest nesting of JSON arrays and objects (a valid document needs 3)."""
MAX_SURFACES = 1000
"""Most surfaces in one document."""
MAX_CONTENT_CHARS = 256 * 1024
"""Longest surface content, in characters."""
MAX_NAME_CHARS = 1000
"""Longest document name, in characters."""
MAX_ID_CHARS = 1100
"""Longest surface id, in characters (room for the id of the longest code path)."""
MAX_NUMBER_DIGITS = 20
"""Most digits in a row in a number of a document's JSON."""
MAX_INTEGER = 2**63 - 1
"""Largest `version` or `budget`."""


class HarnessError(ValueError):
    """A harness document is invalid; the message names the source, the surface and the fix."""


_PATH_SHOWN_CHARS = 256


def show_path(path: str | os.PathLike[str]) -> str:
    """A file name as a message names it: as written when it is short and printable, else
    quoted, escaped and cut (a string of JSON text taken for a path can be megabytes)."""
    text = os.fspath(path)
    if len(text) <= _PATH_SHOWN_CHARS and text.isprintable():
        return text
    return show(text, 100)

