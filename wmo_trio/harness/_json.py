"""A reader of hostile JSON text: bounded in size, nesting, containers and digits before a
parser sees it, and strict where parsers disagree (no NaN, no key given twice)."""

from __future__ import annotations

import json
import re
from typing import Any

from wmo_trio._text import show
from wmo_trio.harness._document import HarnessDoc, parse_harness
from wmo_trio.harness._limits import (
    MAX_DOCUMENT_BYTES,
    MAX_NESTING,
    MAX_NUMBER_DIGITS,
    MAX_SURFACES,
    HarnessError,
)

# A JSON string; an unterminated one runs to the end of the text. Possessive quantifiers
# keep the scan linear on any input.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_ALL_BUT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_LONG_NUMBER = re.compile(f"[0-9]{{{MAX_NUMBER_DIGITS + 1},}}")
# A document, its surface list and one object per surface.
_MAX_CONTAINERS = MAX_SURFACES + 2


def _json_shape_problem(text: str) -> str | None:
    """What makes `text` too big a job for a JSON parser, if anything: nesting deeper than
    `MAX_NESTING`, more arrays and objects than a document can hold, over-long numbers.

    Read from the text outside JSON strings, the way a parser reads it up to the point where
    it would stop on malformed JSON, so that `json.loads` never meets any of these.
    """
    outside = _JSON_STRING.sub("", text)
    skeleton = outside.encode("utf-8", "surrogatepass").translate(None, _ALL_BUT_BRACKETS)
    # Each pass removes the innermost level of every balanced group ("x" marks a removed
    # pair so that no new pair forms within a pass).
    passes = 0
    while skeleton:
        reduced = skeleton.replace(b"[]", b"x").replace(b"{}", b"x")
        if len(reduced) == len(skeleton):
            break
        skeleton = reduced.replace(b"x", b"")
        passes += 1
        if passes > MAX_NESTING:
            break
    # What is left has no adjacent pair: a parser opens brackets up to its first closer,
    # which cannot match, and stops there.
    if passes + len(skeleton) - len(skeleton.lstrip(b"[{")) > MAX_NESTING:
        return (f"nests arrays and objects more than {MAX_NESTING} levels deep (a harness "
                "document needs 3)")
    containers = outside.count("[") + outside.count("{")
    if containers > _MAX_CONTAINERS:
        return (f"holds {containers:,} JSON arrays and objects; a harness document holds at "
                f"most {_MAX_CONTAINERS:,} (its limit is {MAX_SURFACES:,} surfaces, one object "
                "each)")
    number = _LONG_NUMBER.search(outside)
    if number:
        return (f"holds a number of {len(number.group()):,} digits, over the limit of "
                f"{MAX_NUMBER_DIGITS}")
    return None


class _JsonRefused(Exception):
    """Raised from inside `json.loads` to stop at something it would accept but we do not."""


def _no_constants(name: str) -> Any:
    raise _JsonRefused(f"it holds {name}, which is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                # Parsers disagree on which copy wins; refuse rather than pick one.
                raise _JsonRefused(f"key {show(key)} appears twice in one object")
            seen.add(key)
    return result


def parse_harness_json(text: str | bytes, *, source: str = "harness document") -> HarnessDoc:
    """Parse and validate a document from JSON text (bytes must be UTF-8).

    Within the module's limits (`MAX_DOCUMENT_BYTES`, `MAX_NESTING`, `MAX_NUMBER_DIGITS`,
    then the model's own); raises `HarnessError` naming `source` for anything else.
    """
    if isinstance(text, bytes):
        size = len(text)
    else:
        # A character is at least one byte: the cheap count refuses the hopeless at once.
        size = len(text) if len(text) > MAX_DOCUMENT_BYTES \
            else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_DOCUMENT_BYTES:
        raise HarnessError(f"{source} is {size:,} bytes, over the limit of "
                           f"{MAX_DOCUMENT_BYTES:,} bytes for a harness document")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise HarnessError(
                f"{source} is not UTF-8 text: byte 0x{text[error.start]:02x} at offset "
                f"{error.start} ({error.reason}); save it as UTF-8"
            ) from None
    problem = _json_shape_problem(text)
    if problem:
        raise HarnessError(f"{source} is not a harness document: it {problem}")
    try:
        data = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise HarnessError(
            f"{source} is not JSON: line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    except _JsonRefused as refused:
        raise HarnessError(f"{source} is not a harness document: {refused}") from None
    return parse_harness(data, source=source)
