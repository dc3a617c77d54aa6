"""The harness document: one serialized agent candidate, and the views derived from it.

A document is a named, versioned set of *surfaces* (prompts, skills, the tool policy,
parameters, agent code). It is JSON-compatible with the original wmo documents: the same
JSON validates here and has the same `doc_hash`, so an optimizer can key results on it.

A document exists only validated. Its views (tools, parameters, skills, code, prompt,
`doc_hash`) are parsed once, when it is built, into immutable values; there is no way to
change its surfaces afterwards. A new candidate is derived with `derive`,
`with_surfaces` or `without_surfaces` (or `model_copy(update=...)`, which does the
same): the result is validated from scratch like any other document.

Untrusted input (a file, JSON text, a mapping) comes in through `load_harness`,
`parse_harness_json`, `parse_harness` or `harness_from`. Each refuses a bad or hostile
document with one `HarnessError` that names the source and what to change, within the
limits below, before anything expensive is built.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import itertools
import json
import math
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from wmo_trio.file_cache import parse_file_once

# -- limits -------------------------------------------------------------------------------
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

SLUG_PATTERN = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_PATH_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_PATH_BYTES = 1024
_RESERVED_PATHS = frozenset({"doc.json", "aliases.toml"})
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")

ENVIRONMENT_TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file")
KNOWN_TOOLS: tuple[str, ...] = (*ENVIRONMENT_TOOLS, "submit", "read_skill")
DEFAULT_TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file", "submit")

# The runtimes wmo_trio has. The original also had "pi-node" (a TypeScript agent loop);
# running such a document with the Python loop would score a different candidate than
# the one submitted, so it is refused instead.
SUPPORTED_RUNTIME_KINDS: tuple[str, ...] = ("python",)


class HarnessError(ValueError):
    """A harness document is invalid; the message names the source, the surface and the fix."""


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


def _show(value: str, limit: int = 60) -> str:
    """A user-supplied string as it may appear in a one-line message: quoted, escaped, short."""
    if len(value) <= limit and len(repr(value)) <= limit + 2:
        return repr(value)
    kept = limit
    while kept > 1 and len(repr(value[:kept])) > limit + 2:  # escapes take several characters
        kept //= 2
    return f"{value[:kept]!r}... ({len(value):,} characters)"


_PATH_SHOWN_CHARS = 256


def _show_path(path: str | os.PathLike[str]) -> str:
    """A file name as a message names it: as written when it is short and printable, else
    quoted, escaped and cut (a string of JSON text taken for a path can be megabytes)."""
    text = os.fspath(path)
    if len(text) <= _PATH_SHOWN_CHARS and text.isprintable():
        return text
    return _show(text, 100)


# -- text fields ----------------------------------------------------------------------------
# Checked before pydantic reads the value: pydantic cannot read a str that holds a
# surrogate, and would only say "unable to parse raw data".


def _valid_text(value: Any) -> Any:
    # A str decoded from UTF-8, or from JSON with paired escapes, never holds a surrogate
    # code point: one present came from a lone "\ud800"-style escape and cannot be encoded.
    if isinstance(value, str) and _SURROGATE.search(value):
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


def _valid_keys(data: Any) -> Any:
    # pydantic cannot even read a key holding a lone surrogate; say which one it is.
    if isinstance(data, Mapping):
        for key in data:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise ValueError(f"field name {_show(key)} is not valid text (unpaired surrogate)")
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
                f"path {_show(path)} is not a canonical relative POSIX path "
                "(no leading or trailing '/', no empty, '.' or '..' segments)"
            )
        if not _PATH_SEGMENT.match(segment):
            raise ValueError(f"path segment {_show(segment)} may only use [A-Za-z0-9._-]")


# -- models that exist only validated ----------------------------------------------------------


class _Validated(BaseModel):
    """A frozen model whose every instance went through validation.

    pydantic builds instances around validation in four places: `model_construct` and the
    deprecated `copy`, both refused here; `model_copy(update=...)` (and `copy.replace`),
    which here validates the copy as a new instance; and unpickling, which here validates
    the pickled fields as a new instance, so that a pickle edited or written by an older
    version gives the views of its own data, or a `HarnessError`. A copy without `update`
    (`copy.copy`, `copy.deepcopy`) has the data of a valid instance, so it stays valid.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __getstate__(self) -> dict[Any, Any]:
        # Only the fields: what is derived from them is derived again when loaded.
        return {**super().__getstate__(), "__pydantic_private__": None}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        name = type(self).__name__
        fields = state.get("__dict__") if isinstance(state, Mapping) else None
        if not isinstance(fields, Mapping):
            raise HarnessError(f"unpickled {name} is invalid: its pickle holds no fields; "
                               f"pickle a {name} as pickle.dumps gives it")
        fresh = _validate(type(self), dict(fields), f"unpickled {name}")
        super().__setstate__(fresh.__getstate__() | {
            "__pydantic_private__": fresh.__pydantic_private__,
            "__pydantic_fields_set__": _set_fields(state, fresh)})

    @classmethod
    def model_construct(cls, _fields_set: set[str] | None = None, **values: Any) -> Self:
        raise TypeError(
            f"{cls.__name__}.model_construct would build an unvalidated {cls.__name__}; "
            f"use {cls.__name__}.model_validate(...) (or, for a document, parse_harness or "
            "HarnessDoc.derive)"
        )

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with `update`, validated from scratch like a new instance (`HarnessError`)."""
        if not update:
            return super().model_copy(deep=deep)
        data = {name: getattr(self, name) for name in type(self).model_fields}
        return _validate(type(self), {**data, **update}, self._copy_source())

    def copy(self, *, include: Any = None, exclude: Any = None,
             update: dict[str, Any] | None = None, deep: bool = False) -> Self:
        """Refused: pydantic's deprecated `copy` sets fields without validating them."""
        raise TypeError(
            f"{type(self).__name__}.copy is pydantic's deprecated copy, which skips "
            "validation; use model_copy(update=...) (or, for a document, derive)"
        )

    def _copy_source(self) -> str:
        return f"copy of {type(self).__name__}"


def _set_fields(state: Mapping[Any, Any], fresh: BaseModel) -> set[str]:
    """The fields an unpickled instance was given explicitly (what `exclude_unset` leaves
    out), as pickled when that is a set of its field names."""
    given = state.get("__pydantic_fields_set__")
    if isinstance(given, set) and given <= fresh.__pydantic_fields_set__:
        return set(given)
    return set(fresh.__pydantic_fields_set__)


class Surface(_Validated):
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
        return _valid_keys(data)

    @model_validator(mode="after")
    def _id_matches_kind(self) -> Self:
        prefix, sep, slug = self.id.partition(":")
        if not sep or prefix != self.kind.value:
            raise ValueError(f"id {_show(self.id)} must start with {self.kind.value + ':'!r}")
        if not SLUG_PATTERN.match(slug):
            raise ValueError(
                f"id {_show(self.id)}: slug {_show(slug)} must be lowercase words of [a-z0-9] "
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
                raise ValueError(f"a code surface at path {_show(self.path)} must have id "
                                 f"{_show(expected)}")
        elif self.kind is SurfaceKind.CODE and self.id != "code:runtime":
            raise ValueError("a code surface without a path must be 'code:runtime'")
        return self

    def _copy_source(self) -> str:
        return f"copy of surface {self.id}"


class Skill(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    content: str


class Params(BaseModel):
    """The numeric parameters a document can set, with their defaults."""

    model_config = ConfigDict(frozen=True)

    max_turns: int = 20
    max_output_tokens: int = 4096
    temperature: float = 0.7
    max_env_actions: int = 40


# -- derived views ------------------------------------------------------------------------------
# Each function reads the sorted surfaces and raises ValueError naming the surface; the
# document's validator calls them once and keeps what they return.


def _parse_positive_int(text: str) -> int:
    value = text.strip()
    # Bounded before int(): Python refuses to convert more than 4300 digits.
    if not re.fullmatch(r"[0-9]{1,18}", value) or int(value) < 1:
        raise ValueError(f"{_show(value)} is not an integer in [1, 10^18)")
    return int(value)


def _parse_temperature(text: str) -> float:
    value = text.strip()
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{_show(value)} is not a number") from None
    if not math.isfinite(number) or not 0.0 <= number <= 2.0:
        raise ValueError(f"{_show(value)} is not in [0, 2]")
    return number


_PARAM_PARSERS: dict[str, tuple[str, Any]] = {
    "param:max-turns": ("max_turns", _parse_positive_int),
    "param:max-output-tokens": ("max_output_tokens", _parse_positive_int),
    "param:temperature": ("temperature", _parse_temperature),
    "param:max-env-actions": ("max_env_actions", _parse_positive_int),
}
_KNOWN_PARAMS = frozenset({*_PARAM_PARSERS, "param:runtime-kind"})


def _parse_front_matter(content: str) -> dict[str, str]:
    lines = content.splitlines()
    if not lines or lines[0].strip() != "---":
        raise ValueError("a skill must start with front matter ('---', 'name: ...', '---')")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line.strip() == "---":
            return fields
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields[key.strip()] = value.strip().strip("'\"")
    raise ValueError("the skill's front matter is not closed by a '---' line")


@dataclass(frozen=True, slots=True)
class _Views:
    ids: tuple[str, ...]
    doc_hash: str
    system_prompt: str
    skills: tuple[Skill, ...]
    tools: tuple[str, ...]
    params: Params
    runtime_kind: str
    runtime_code: str | None
    unknown_params: tuple[str, ...]


def _views_of(surfaces: tuple[Surface, ...]) -> _Views:
    by_id = {surface.id: surface for surface in surfaces}
    prompts = [s for s in surfaces if s.kind is SurfaceKind.PROMPT]
    if not prompts:
        raise ValueError("a document needs at least one prompt surface")
    skills = _skills([s for s in surfaces if s.kind is SurfaceKind.SKILL])
    return _Views(
        ids=tuple(by_id),
        doc_hash=_doc_hash(surfaces),
        system_prompt="\n\n".join(s.content for s in prompts),
        skills=skills,
        tools=_tools(by_id.get("tool_policy:main"), has_skills=bool(skills)),
        params=_params(by_id),
        runtime_kind=_runtime_kind(by_id.get("param:runtime-kind")),
        runtime_code=_runtime_code(by_id.get("code:runtime")),
        unknown_params=tuple(s.id for s in surfaces
                             if s.kind is SurfaceKind.PARAM and s.id not in _KNOWN_PARAMS),
    )


def _doc_hash(surfaces: tuple[Surface, ...]) -> str:
    lines = []
    for surface in surfaces:
        line = surface.id + "\x00" + blake2b16(surface.content)
        if surface.path is not None:
            line += "\x00path=" + surface.path
        lines.append(line)
    return blake2b16("\n".join(lines))


def _skills(surfaces: list[Surface]) -> tuple[Skill, ...]:
    skills = []
    for surface in surfaces:
        try:
            front = _parse_front_matter(surface.content)
        except ValueError as error:
            raise ValueError(f"surface {surface.id}: {error}") from None
        name = front.get("name")
        if name != surface.slug:
            shown = "missing" if name is None else _show(name)
            raise ValueError(f"surface {surface.id}: front-matter name {shown} must equal the "
                             f"slug {surface.slug!r}")
        skills.append(Skill(name=surface.slug, description=front.get("description", ""),
                            content=surface.content))
    return tuple(skills)


def _tools(policy: Surface | None, *, has_skills: bool) -> tuple[str, ...]:
    if policy is None:
        tools = list(DEFAULT_TOOLS)
    else:
        tools = []
        for line in policy.content.splitlines():
            name = line.strip()
            if not name:
                continue
            if name not in KNOWN_TOOLS:
                raise ValueError(f"surface tool_policy:main: unknown tool {_show(name)}; known "
                                 "tools are " + ", ".join(KNOWN_TOOLS))
            if name in tools:
                raise ValueError(f"surface tool_policy:main: tool {name!r} is listed twice")
            tools.append(name)
        if "submit" not in tools:
            raise ValueError("surface tool_policy:main: the 'submit' tool is mandatory")
    if "read_skill" in tools and not has_skills:
        raise ValueError("surface tool_policy:main: 'read_skill' needs at least one skill surface")
    if has_skills and "read_skill" not in tools:
        tools.append("read_skill")
    return tuple(tools)


def _params(by_id: Mapping[str, Surface]) -> Params:
    values: dict[str, Any] = {}
    for surface_id, (field, parse) in _PARAM_PARSERS.items():
        surface = by_id.get(surface_id)
        if surface is None:
            continue
        try:
            values[field] = parse(surface.content)
        except ValueError as error:
            raise ValueError(f"surface {surface_id}: {error}") from None
    return Params(**values)


def _runtime_kind(surface: Surface | None) -> str:
    if surface is None:
        return "python"
    kind = surface.content.strip()
    if kind not in SUPPORTED_RUNTIME_KINDS:
        hint = " (the original's TypeScript runtime)" if kind == "pi-node" else ""
        raise ValueError(
            f"surface param:runtime-kind asks for runtime {_show(kind)}{hint}, which wmo_trio "
            f"cannot run; supported: {', '.join(SUPPORTED_RUNTIME_KINDS)}. Remove the "
            "surface or set it to 'python'."
        )
    return kind


def _runtime_code(surface: Surface | None) -> str | None:
    """The source of `code:runtime`, checked to compile and to define a top-level `run`."""
    if surface is None:
        return None
    try:
        tree = ast.parse(surface.content, filename="code:runtime")
    except SyntaxError as error:
        raise ValueError(
            f"surface code:runtime does not compile: line {error.lineno}: {error.msg}"
        ) from None
    except (MemoryError, RecursionError):
        # CPython's parser gives up on deeply nested source with these, not SyntaxError.
        raise ValueError("surface code:runtime is nested too deeply for Python to compile; "
                         "flatten its expressions") from None
    defines_run = any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run"
        for node in tree.body
    )
    if not defines_run:
        raise ValueError("surface code:runtime must define a top-level function 'run'")
    return surface.content


# -- the document ---------------------------------------------------------------------------------


class HarnessDoc(_Validated):
    """A harness document: one candidate, validated whole, immutable, hashable.

    Surfaces are kept as a tuple sorted by id (a list in JSON), so input order never
    matters. Two documents are equal when their data (name, version, surfaces) is equal;
    equal documents hash equal. `doc_hash` is the candidate's identity: name, version,
    budgets and surface order do not enter it.

    Derive a candidate with `derive(name=..., version=..., surfaces=...)`,
    `with_surfaces(...)` or `without_surfaces(...)`; each validates the result from
    scratch and raises `HarnessError` when it is not a valid document.
    `model_copy(update=...)` does the same, and so does loading a pickle (it is validated
    again from its fields); `model_construct` is refused.
    """

    name: Name
    version: Annotated[int, Field(ge=0, le=MAX_INTEGER)] = 0
    surfaces: tuple[Surface, ...]

    _views: _Views = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _keys_are_text(cls, data: Any) -> Any:
        return _valid_keys(data)

    @field_validator("surfaces", mode="before")
    @classmethod
    def _not_too_many(cls, value: Any) -> Any:
        # Counted before any surface is validated, so a huge document costs nothing.
        if isinstance(value, Iterator):
            value = list(itertools.islice(value, MAX_SURFACES + 1))
            if len(value) > MAX_SURFACES:
                raise ValueError(f"more than {MAX_SURFACES:,} surfaces, the limit per document")
        if isinstance(value, Sized) and not isinstance(value, str | bytes | Mapping):
            if len(value) > MAX_SURFACES:
                raise ValueError(f"{len(value):,} surfaces, over the limit of {MAX_SURFACES:,} "
                                 "per document")
        return value

    @field_validator("surfaces")
    @classmethod
    def _sorted_and_unique(cls, surfaces: tuple[Surface, ...]) -> tuple[Surface, ...]:
        ordered = tuple(sorted(surfaces, key=lambda surface: surface.id))
        for before, after in itertools.pairwise(ordered):
            if before.id == after.id:
                raise ValueError(f"surface id {before.id!r} appears more than once")
        return ordered

    @model_validator(mode="after")
    def _parse_views(self) -> Self:
        self._views = _views_of(self.surfaces)
        return self

    # -- deriving candidates ------------------------------------------------------------------

    def derive(self, *, name: str | None = None, version: int | None = None,
               surfaces: Iterable[Surface | Mapping[str, Any]] | None = None) -> Self:
        """A new document with the given fields replaced (`surfaces` replaces all of them),
        validated from scratch; with no change, this document.

        Raises `HarnessError` when the result is not a valid document.
        """
        update: dict[str, Any] = {}
        if name is not None:
            update["name"] = name
        if version is not None:
            update["version"] = version
        if surfaces is not None:
            update["surfaces"] = tuple(surfaces)
        return self.model_copy(update=update) if update else self

    def with_surfaces(self, *surfaces: Surface | Mapping[str, Any]) -> Self:
        """This candidate with `surfaces` put in: each replaces the surface with its id, or joins.

        Raises `HarnessError` when an id is given twice or the result is not a valid document.
        """
        merged: dict[object, Surface | Mapping[str, Any]] = {s.id: s for s in self.surfaces}
        given: set[object] = set()
        for surface in surfaces:
            key: object = surface.id if isinstance(surface, Surface) else surface.get("id")
            if not isinstance(key, str):
                key = object()  # no usable id: it joins, and validation says what is wrong
            elif key in given:
                raise HarnessError(f"{self._copy_source()}: surface {_show(key)} is given twice")
            given.add(key)
            merged[key] = surface
        return self.derive(surfaces=merged.values())

    def without_surfaces(self, *surface_ids: str) -> Self:
        """This candidate without the surfaces with these ids (each must exist).

        Raises `HarnessError` when an id is not in the document or the result is not valid.
        """
        missing = [surface_id for surface_id in surface_ids if self.surface(surface_id) is None]
        if missing:
            raise HarnessError(f"{self._copy_source()}: no surface {_show(missing[0])} to remove")
        dropped = set(surface_ids)
        return self.derive(surfaces=[s for s in self.surfaces if s.id not in dropped])

    def _copy_source(self) -> str:
        return f"candidate derived from {_show(self.name)}"

    # -- lookup ----------------------------------------------------------------------------------

    def surface(self, surface_id: str) -> Surface | None:
        index = bisect.bisect_left(self._views.ids, surface_id)
        if index < len(self.surfaces) and self._views.ids[index] == surface_id:
            return self.surfaces[index]
        return None

    # -- derived views -----------------------------------------------------------------------

    @property
    def doc_hash(self) -> str:
        """The candidate's identity (CONTRACT section 2): BLAKE2b over the surfaces in id order."""
        return self._views.doc_hash

    @property
    def system_prompt(self) -> str:
        """The prompt surfaces' contents in id order, joined by a blank line."""
        return self._views.system_prompt

    @property
    def skills(self) -> tuple[Skill, ...]:
        return self._views.skills

    @property
    def tools(self) -> tuple[str, ...]:
        """The tools the agent may call, in policy order; `read_skill` joins when skills exist."""
        return self._views.tools

    @property
    def params(self) -> Params:
        return self._views.params

    @property
    def runtime_kind(self) -> str:
        return self._views.runtime_kind

    @property
    def runtime_code(self) -> str | None:
        """The source of `code:runtime` (checked to compile and define `run`), if any."""
        return self._views.runtime_code

    @property
    def unknown_params(self) -> tuple[str, ...]:
        """Parameter surfaces this implementation does not read (kept, and hashed)."""
        return self._views.unknown_params


# -- from untrusted input to a document --------------------------------------------------------

_MAX_PROBLEMS_SHOWN = 5


def _surface_label(data: Any, index: int) -> str:
    try:
        item = data["surfaces"][index]
        raw = item.id if isinstance(item, Surface) else item["id"]
    except (KeyError, IndexError, TypeError):
        return f"surfaces.{index}"
    if isinstance(raw, str) and len(raw) <= MAX_ID_CHARS and raw.isprintable() \
            and not _SURROGATE.search(raw):
        return f"surface {raw}"
    return f"surface {_show(raw) if isinstance(raw, str) else index}"


def _describe_validation_error(error: ValidationError, data: Any) -> str:
    """The problems on one line, each naming its surface; at most a few, then a count."""
    problems = []
    for item in error.errors():
        location = list(item["loc"])
        if len(location) >= 2 and location[0] == "surfaces" and isinstance(location[1], int):
            head, rest = _surface_label(data, location[1]), location[2:]
        else:
            head, rest = "", location
        parts = [str(p) if isinstance(p, int) or _PLAIN_NAME.fullmatch(p) else _show(p)
                 for p in rest]
        where = ".".join([head, *parts] if head else parts)
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    shown = problems[:_MAX_PROBLEMS_SHOWN]
    if len(problems) > len(shown):
        shown.append(f"and {len(problems) - len(shown)} more problems")
    return "; ".join(shown)


def _validate[M: BaseModel](model: type[M], data: Any, source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise HarnessError(f"{source} is invalid: {_describe_validation_error(error, data)}") from None


def parse_harness(data: Any, *, source: str = "harness document") -> HarnessDoc:
    """Validate JSON-like data (a mapping, as `json.loads` gives it) as a document.

    Raises `HarnessError` naming `source` when it is not a valid document.
    """
    return _validate(HarnessDoc, data, source)


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
                raise _JsonRefused(f"key {_show(key)} appears twice in one object")
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


_FILE_TYPES = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket"}


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = os.read(fd, min(limit - total, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _read_regular_file(file: Path) -> bytes:
    data = b""
    try:
        # Looked at before opening: opening a FIFO for reading waits for a writer.
        info = os.stat(file)
        if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_DOCUMENT_BYTES:
            # O_NONBLOCK: should the path have become a FIFO since, open returns at once.
            fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode):
                    data = _read_at_most(fd, MAX_DOCUMENT_BYTES + 1)
            finally:
                os.close(fd)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise _Unreadable(f"cannot read harness document {_show_path(file)}: {reason}") from None
    except ValueError as error:  # a NUL in the path, or a path that cannot be encoded
        raise _Unreadable(f"cannot read harness document {_show_path(file)}: {error}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = _FILE_TYPES.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise HarnessError(f"cannot read harness document {_show_path(file)}: it is {kind}, "
                           "not a regular file; give the path of a JSON file")
    size = max(info.st_size, len(data))
    if size > MAX_DOCUMENT_BYTES:
        raise HarnessError(f"{_show_path(file)} is {size:,} bytes, over the limit of "
                           f"{MAX_DOCUMENT_BYTES:,} bytes for a harness document")
    return data


class _Unreadable(HarnessError):
    """No file could be opened at the path (missing, not permitted, not a path at all)."""


def load_harness(path: str | os.PathLike[str]) -> HarnessDoc:
    """Read and validate a document from a JSON file; errors name the file and the surface.

    Only regular files are read (a FIFO, directory or device is refused without waiting on
    it), at most `MAX_DOCUMENT_BYTES` of them. Raises `HarnessError`.
    """
    file = Path(path)
    return parse_harness_json(_read_regular_file(file), source=_show_path(file))


def _expand_user(path: str | os.PathLike[str]) -> Path:
    try:
        return Path(path).expanduser()
    except RuntimeError:  # no home directory to put for "~": the path is read as written
        return Path(path)


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


def harness_from(value: object, *, source: str = "the document") -> HarnessDoc:
    """A document from whatever names one: a `HarnessDoc` (returned as is), a mapping of
    its JSON fields, JSON text (a string starting with '{'), or the path of a JSON file.

    Raises `HarnessError` (the file or `source` named) for anything else.
    """
    if isinstance(value, HarnessDoc):
        return value
    # harbor builds an agent per trial, each with the same argument: a document is parsed
    # once per content (a mapping by its JSON text), a path once per version of its file.
    if isinstance(value, Mapping):
        try:
            key = json.dumps(value, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return parse_harness(dict(value), source=source)  # it says what is wrong
        return _parsed_once(key, lambda: parse_harness(dict(value), source=source))
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return _parsed_once(value, lambda: parse_harness_json(value, source=f"{source} (JSON text)"))
    if isinstance(value, str):
        try:
            return parse_file_once(_expand_user(value.strip()), load_harness)
        except _Unreadable as error:
            raise HarnessError(f"{error} (a string is read as the path of a JSON file unless "
                               "it starts with '{', as JSON text of a document does)") from None
    if isinstance(value, os.PathLike):
        return parse_file_once(_expand_user(value), load_harness)
    raise HarnessError(
        "expected a harness document: a JSON object, JSON text or the path of a JSON file; "
        f"got {type(value).__name__}"
    )
