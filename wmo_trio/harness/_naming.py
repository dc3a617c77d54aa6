"""What names a document, decided by one rule (`document_form`), and `harness_from`, which
gives the document so named, parsed once per content."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import cast

from wmo_trio._file_cache import parse_file_once
from wmo_trio.harness._document import HarnessDoc, parse_harness
from wmo_trio.harness._files import Unreadable, load_harness
from wmo_trio.harness._json import parse_harness_json
from wmo_trio.harness._limits import MAX_DOCUMENT_BYTES, HarnessError


class DocumentForm(StrEnum):
    """The ways a value names a harness document."""

    DOCUMENT = "document"
    MAPPING = "mapping"
    JSON_TEXT = "JSON text"
    PATH = "path"


def document_form(value: object) -> DocumentForm | None:
    """How `value` names a harness document, or None when it names none.

    A `HarnessDoc` is the document; a mapping holds its JSON fields; a string whose first
    character other than white space is '{' is its JSON text (a document is a JSON object,
    so its text always starts so); any other string, and any `os.PathLike`, is the path of
    its JSON file. A file whose name starts with '{' is named by a `Path`, or by a string
    with a directory in front (`./{name}.json`).
    """
    if isinstance(value, HarnessDoc):
        return DocumentForm.DOCUMENT
    if isinstance(value, Mapping):
        return DocumentForm.MAPPING
    if isinstance(value, str):
        return DocumentForm.JSON_TEXT if value.lstrip().startswith("{") else DocumentForm.PATH
    if isinstance(value, os.PathLike):
        return DocumentForm.PATH
    return None


# The parse cache is functools.lru_cache, as wmo_trio._file_cache's is: its bookkeeping is
# thread-safe; it keeps no exception, so a refusal is said again to the next caller; two
# threads that miss together may both parse, which costs time only (a document is immutable
# and equal ones are interchangeable). A key is a document's JSON text, so what is kept is
# bounded in number here and in size by MAX_DOCUMENT_BYTES (a mapping whose text is larger
# is parsed every time, not kept).
_KEPT = 64


@functools.lru_cache(maxsize=_KEPT)
def _document_of_text(text: str, source: str) -> HarnessDoc:
    return parse_harness_json(text, source=source)


@functools.lru_cache(maxsize=_KEPT)
def _document_of_fields(canonical: str, source: str) -> HarnessDoc:
    # Built from the canonical text's own data, so that the document is a function of the key.
    return parse_harness(json.loads(canonical), source=source)


def _expand_user(path: str | os.PathLike[str]) -> Path:
    try:
        return Path(path).expanduser()
    except RuntimeError:  # no home directory to put for "~": the path is read as written
        return Path(path)


def harness_from(value: object, *, source: str = "the document") -> HarnessDoc:
    """The document `value` names (by `document_form`'s rule): a `HarnessDoc` (returned as
    is), a mapping of its JSON fields, its JSON text, or the path of its JSON file (`~`
    expanded).

    Raises `HarnessError` (the file or `source` named) for anything else.
    """
    # harbor builds an agent per trial, each with the same argument: a document is parsed
    # once per content (a mapping by its JSON text), a path once per version of its file.
    form = document_form(value)
    if form is DocumentForm.DOCUMENT:
        return cast(HarnessDoc, value)
    if form is DocumentForm.MAPPING:
        fields = cast(Mapping[str, object], value)
        try:
            canonical = json.dumps(fields, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            canonical = None  # not JSON data: parse_harness says what is wrong with it
        if canonical is None or len(canonical) > MAX_DOCUMENT_BYTES:
            return parse_harness(dict(fields), source=source)
        return _document_of_fields(canonical, source)
    if form is DocumentForm.JSON_TEXT:
        return _document_of_text(cast(str, value), f"{source} (JSON text)")
    if isinstance(value, str):
        try:
            return parse_file_once(_expand_user(value.strip()), load_harness)
        except Unreadable as error:
            raise HarnessError(f"{error} (a string is read as the path of a JSON file unless "
                               "it starts with '{', as JSON text of a document does)") from None
    if form is DocumentForm.PATH:
        return parse_file_once(_expand_user(cast(os.PathLike[str], value)), load_harness)
    raise HarnessError(
        "expected a harness document: a JSON object, JSON text or the path of a JSON file; "
        f"got {type(value).__name__}"
    )
