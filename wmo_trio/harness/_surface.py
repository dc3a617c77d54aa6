"""A surface: one editable part of a candidate, checked field by field before it joins a
document (its text, its id against its kind, a code surface's path)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from wmo_trio._text import has_lone_surrogate, show
from wmo_trio.harness._limits import (
    MAX_CONTENT_CHARS,
    MAX_ID_CHARS,
    MAX_INTEGER,
    MAX_NAME_CHARS,
)
from wmo_trio.harness._validated import Validated

SLUG_PATTERN = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_PATH_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_PATH_BYTES = 1024
_RESERVED_PATHS = frozenset({"doc.json", "aliases.toml"})


class SurfaceKind(StrEnum):
    PROMPT = "prompt"
    SKILL = "skill"
    TOOL_POLICY = "tool_policy"
    PARAM = "param"
    CODE = "code"


def blake2b16(text: str) -> str:
    """Hex digest of 16-byte BLAKE2b over the UTF-8 bytes of `text`."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def code_surface_id(path: str) -> str:
    """The id a `code` surface with this path must have."""
    return "code:" + path.replace("/", "-").replace(".", "-")


# -- text fields ----------------------------------------------------------------------------
# Checked before pydantic reads the value: pydantic cannot read a str that holds a
# surrogate, and would only say "unable to parse raw data".


def _valid_text(value: Any) -> Any:
    # A str decoded from UTF-8, or from JSON with paired escapes, never holds a surrogate
    # code point: one present came from a lone "\ud800"-style escape and cannot be encoded.
    if isinstance(value, str) and has_lone_surrogate(value):
        raise ValueError(
            "is not valid text: it holds an unpaired surrogate (U+D800..U+DFFF); "
            "remove the lone \\ud800-\\udfff escape"
        )
    return value


def _valid_content(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) > MAX_CONTENT_CHARS:
            raise ValueError(f"is {len(value):,} characters, over the limit of "
                             f"{MAX_CONTENT_CHARS:,} per surface")
        if "\x00" in value:
            raise ValueError("may not contain NUL characters")
    return _valid_text(value)


def valid_keys(data: Any) -> Any:
    # pydantic cannot even read a key holding a lone surrogate; say which one it is.
    if isinstance(data, Mapping):
        for key in data:
            if isinstance(key, str) and has_lone_surrogate(key):
                raise ValueError(f"field name {show(key)} is not valid text (unpaired surrogate)")
    return data


Text = Annotated[str, BeforeValidator(_valid_text)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), BeforeValidator(_valid_text)]
SurfaceId = Annotated[str, Field(max_length=MAX_ID_CHARS), BeforeValidator(_valid_text)]
Content = Annotated[str, BeforeValidator(_valid_content)]


def _check_code_path(path: str) -> None:
    if len(path.encode("utf-8")) > _MAX_PATH_BYTES:
        raise ValueError(f"path is longer than {_MAX_PATH_BYTES} UTF-8 bytes")
    if path in _RESERVED_PATHS:
        raise ValueError(f"path {path!r} is reserved for the document store")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(
                f"path {show(path)} is not a canonical relative POSIX path "
                "(no leading or trailing '/', no empty, '.' or '..' segments)"
            )
        if not _PATH_SEGMENT.match(segment):
            raise ValueError(f"path segment {show(segment)} may only use [A-Za-z0-9._-]")


class Surface(Validated):
    """One editable part of a candidate. `id` is `<kind>:<slug>`."""

    # A Surface handed to a document is validated again, so a document never holds one
    # that was altered behind pydantic's back.
    model_config = ConfigDict(revalidate_instances="always")

    id: SurfaceId
    kind: SurfaceKind
    content: Content
    path: Text | None = None
    budget: Annotated[int, Field(ge=1, le=MAX_INTEGER)] | None = None

    @property
    def slug(self) -> str:
        return self.id.partition(":")[2]

    @model_validator(mode="before")
    @classmethod
    def _keys_are_text(cls, data: Any) -> Any:
        return valid_keys(data)

    @model_validator(mode="after")
    def _id_matches_kind(self) -> Self:
        prefix, sep, slug = self.id.partition(":")
        if not sep or prefix != self.kind.value:
            raise ValueError(f"id {show(self.id)} must start with {self.kind.value + ':'!r}")
        if not SLUG_PATTERN.match(slug):
            raise ValueError(
                f"id {show(self.id)}: slug {show(slug)} must be lowercase words of [a-z0-9] "
                "joined by single '-'"
            )
        if self.budget is not None and len(self.content) > self.budget:
            raise ValueError(
                f"content is {len(self.content)} characters, over its budget of {self.budget}"
            )
        if self.path is not None:
            if self.kind is not SurfaceKind.CODE:
                raise ValueError("only code surfaces may have a path")
            _check_code_path(self.path)
            expected = code_surface_id(self.path)
            if self.id != expected:
                raise ValueError(f"a code surface at path {show(self.path)} must have id "
                                 f"{show(expected)}")
        elif self.kind is SurfaceKind.CODE and self.id != "code:runtime":
            raise ValueError("a code surface without a path must be 'code:runtime'")
        return self

    def _copy_source(self) -> str:
        return f"copy of surface {self.id}"
