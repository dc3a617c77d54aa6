"""What names a document, decided by one rule (`document_form`), and `harness_from`, which
gives the document so named, parsed once per content."""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import cast

from wmo_trio.file_cache import parse_file_once
from wmo_trio.harness._document import HarnessDoc, parse_harness
from wmo_trio.harness._files import Unreadable, load_harness
from wmo_trio.harness._json import parse_harness_json
from wmo_trio.harness._limits import HarnessError


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


_PARSED: OrderedDict[str, HarnessDoc] = OrderedDict()
_PARSED_KEPT = 64
_PARSED_LOCK = threading.Lock()


def _parsed_once(text: str, parse: Callable[[], HarnessDoc]) -> HarnessDoc:
    """The document of this JSON text, parsed once while it is among the last 64 asked for
    (a document is immutable, so every caller may share it; a failure is not kept)."""
    with _PARSED_LOCK:
        doc = _PARSED.get(text)
    if doc is not None:
        return doc
    doc = parse()
    with _PARSED_LOCK:
        _PARSED[text] = doc
        while len(_PARSED) > _PARSED_KEPT:
            _PARSED.popitem(last=False)
    return doc


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
        if canonical is None:
            return parse_harness(dict(fields), source=source)
        return _parsed_once(canonical, lambda: parse_harness(dict(fields), source=source))
    if form is DocumentForm.JSON_TEXT:
        text = cast(str, value)
        return _parsed_once(text, lambda: parse_harness_json(text, source=f"{source} (JSON text)"))
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
