"""The harness document: one serialized agent candidate, and the views derived from it.

A document is a named, versioned set of *surfaces* (prompts, skills, the tool policy,
parameters, agent code). It is JSON-compatible with the original wmo documents: the same
JSON validates here and has the same `doc_hash`, so an optimizer can key results on it.

Validation happens entirely at construction: every derived view (tools, parameters,
skills, code) is parsed once, so a document that validates can always be run.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import math
import re
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SLUG_PATTERN = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_PATH_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_PATH_BYTES = 1024
_RESERVED_PATHS = frozenset({"doc.json", "aliases.toml"})

ENVIRONMENT_TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file")
KNOWN_TOOLS: tuple[str, ...] = (*ENVIRONMENT_TOOLS, "submit", "read_skill")
DEFAULT_TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file", "submit")

# The runtimes wmo_trio has. The original also had "pi-node" (a TypeScript agent loop);
# running such a document with the Python loop would score a different candidate than
# the one submitted, so it is refused instead.
SUPPORTED_RUNTIME_KINDS: tuple[str, ...] = ("python",)


class HarnessError(ValueError):
    """A harness document is invalid; the message names the surface and what to change."""


class SurfaceKind(StrEnum):
    PROMPT = "prompt"
    SKILL = "skill"
    TOOL_POLICY = "tool_policy"
    PARAM = "param"
    CODE = "code"


def blake2b16(text: str) -> str:
    """Hex digest of 16-byte BLAKE2b over the UTF-8 bytes of `text`."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _has_unpaired_surrogate(text: str) -> bool:
    # A Python str decoded from valid UTF-8 or JSON pairs never holds a surrogate code
    # point, so any one present is unpaired.
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def code_surface_id(path: str) -> str:
    """The id a `code` surface with this path must have."""
    return "code:" + path.replace("/", "-").replace(".", "-")


def _check_code_path(path: str) -> None:
    if len(path.encode("utf-8")) > _MAX_PATH_BYTES:
        raise ValueError(f"path is longer than {_MAX_PATH_BYTES} UTF-8 bytes")
    if path in _RESERVED_PATHS:
        raise ValueError(f"path {path!r} is reserved for the document store")
    segments = path.split("/")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise ValueError(
                f"path {path!r} is not a canonical relative POSIX path "
                "(no leading or trailing '/', no empty, '.' or '..' segments)"
            )
        if not _PATH_SEGMENT.match(segment):
            raise ValueError(f"path segment {segment!r} may only use [A-Za-z0-9._-]")


class Surface(BaseModel):
    """One editable part of a candidate. `id` is `<kind>:<slug>`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    kind: SurfaceKind
    content: str
    path: str | None = None
    budget: Annotated[int, Field(ge=1)] | None = None

    @property
    def slug(self) -> str:
        return self.id.partition(":")[2]

    @field_validator("content")
    @classmethod
    def _content_is_clean_text(cls, content: str) -> str:
        if "\x00" in content:
            raise ValueError("content may not contain NUL characters")
        if _has_unpaired_surrogate(content):
            raise ValueError("content may not contain an unpaired surrogate (U+D800..U+DFFF)")
        return content

    @model_validator(mode="after")
    def _id_matches_kind(self) -> Self:
        prefix, sep, slug = self.id.partition(":")
        if not sep or prefix != self.kind.value:
            raise ValueError(f"id {self.id!r} must start with {self.kind.value + ':'!r}")
        if not SLUG_PATTERN.match(slug):
            raise ValueError(
                f"id {self.id!r}: slug {slug!r} must be lowercase words of [a-z0-9] "
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
                raise ValueError(f"a code surface at path {self.path!r} must have id {expected!r}")
        elif self.kind is SurfaceKind.CODE and self.id != "code:runtime":
            raise ValueError("a code surface without a path must be 'code:runtime'")
        return self


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


def _parse_positive_int(text: str) -> int:
    value = text.strip()
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise ValueError(f"{value!r} is not an integer >= 1")
    return int(value)


def _parse_temperature(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a number") from None
    if not math.isfinite(value) or not 0.0 <= value <= 2.0:
        raise ValueError(f"{text.strip()!r} is not in [0, 2]")
    return value


_PARAM_PARSERS: dict[str, tuple[str, Any]] = {
    "param:max-turns": ("max_turns", _parse_positive_int),
    "param:max-output-tokens": ("max_output_tokens", _parse_positive_int),
    "param:temperature": ("temperature", _parse_temperature),
    "param:max-env-actions": ("max_env_actions", _parse_positive_int),
}


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


class HarnessDoc(BaseModel):
    """A harness document. Surfaces are kept sorted by id, so input order never matters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: Annotated[int, Field(ge=0)] = 0
    surfaces: list[Surface]

    @field_validator("surfaces")
    @classmethod
    def _sorted_and_unique(cls, surfaces: list[Surface]) -> list[Surface]:
        ordered = sorted(surfaces, key=lambda surface: surface.id)
        for before, after in itertools.pairwise(ordered):
            if before.id == after.id:
                raise ValueError(f"surface id {before.id!r} appears more than once")
        return ordered

    @model_validator(mode="after")
    def _views_parse(self) -> Self:
        if not any(s.kind is SurfaceKind.PROMPT for s in self.surfaces):
            raise ValueError("a document needs at least one prompt surface")
        # Touch every derived view once so that errors surface here, not mid-episode.
        for view in ("tools", "params", "skills", "runtime_kind", "runtime_code"):
            try:
                getattr(self, view)
            except HarnessError as error:
                raise ValueError(str(error)) from None
        return self

    # -- lookup -------------------------------------------------------------------------

    def surface(self, surface_id: str) -> Surface | None:
        for surface in self.surfaces:
            if surface.id == surface_id:
                return surface
        return None

    def of_kind(self, kind: SurfaceKind) -> list[Surface]:
        return [surface for surface in self.surfaces if surface.kind is kind]

    # -- derived views ------------------------------------------------------------------

    @cached_property
    def doc_hash(self) -> str:
        lines = []
        for surface in self.surfaces:
            line = surface.id + "\x00" + blake2b16(surface.content)
            if surface.path is not None:
                line += "\x00path=" + surface.path
            lines.append(line)
        return blake2b16("\n".join(lines))

    @cached_property
    def system_prompt(self) -> str:
        return "\n\n".join(s.content for s in self.of_kind(SurfaceKind.PROMPT))

    @cached_property
    def skills(self) -> tuple[Skill, ...]:
        skills = []
        for surface in self.of_kind(SurfaceKind.SKILL):
            try:
                front = _parse_front_matter(surface.content)
            except ValueError as error:
                raise HarnessError(f"surface {surface.id}: {error}") from None
            if front.get("name") != surface.slug:
                raise HarnessError(
                    f"surface {surface.id}: front-matter name {front.get('name')!r} must "
                    f"equal the slug {surface.slug!r}"
                )
            skills.append(Skill(name=surface.slug, description=front.get("description", ""),
                                content=surface.content))
        return tuple(skills)

    @cached_property
    def tools(self) -> tuple[str, ...]:
        """The tools the agent may call, in policy order; `read_skill` joins when skills exist."""
        policy = self.surface("tool_policy:main")
        if policy is None:
            tools = list(DEFAULT_TOOLS)
        else:
            tools = []
            for line in policy.content.splitlines():
                name = line.strip()
                if not name:
                    continue
                if name not in KNOWN_TOOLS:
                    raise HarnessError(
                        f"surface tool_policy:main: unknown tool {name!r}; known tools are "
                        + ", ".join(KNOWN_TOOLS)
                    )
                if name in tools:
                    raise HarnessError(f"surface tool_policy:main: tool {name!r} is listed twice")
                tools.append(name)
            if "submit" not in tools:
                raise HarnessError("surface tool_policy:main: the 'submit' tool is mandatory")
        has_skills = bool(self.of_kind(SurfaceKind.SKILL))
        if "read_skill" in tools and not has_skills:
            raise HarnessError(
                "surface tool_policy:main: 'read_skill' needs at least one skill surface"
            )
        if has_skills and "read_skill" not in tools:
            tools.append("read_skill")
        return tuple(tools)

    @cached_property
    def params(self) -> Params:
        values: dict[str, Any] = {}
        for surface_id, (field, parse) in _PARAM_PARSERS.items():
            surface = self.surface(surface_id)
            if surface is None:
                continue
            try:
                values[field] = parse(surface.content)
            except ValueError as error:
                raise HarnessError(f"surface {surface_id}: {error}") from None
        return Params(**values)

    @cached_property
    def runtime_kind(self) -> str:
        surface = self.surface("param:runtime-kind")
        if surface is None:
            return "python"
        kind = surface.content.strip()
        if kind not in SUPPORTED_RUNTIME_KINDS:
            hint = (
                " (the original's TypeScript runtime)" if kind == "pi-node" else ""
            )
            raise HarnessError(
                f"surface param:runtime-kind asks for runtime {kind!r}{hint}, which wmo_trio "
                f"cannot run; supported: {', '.join(SUPPORTED_RUNTIME_KINDS)}. Remove the "
                "surface or set it to 'python'."
            )
        return kind

    @cached_property
    def runtime_code(self) -> str | None:
        """The source of `code:runtime`, checked to compile and to define a top-level `run`."""
        surface = self.surface("code:runtime")
        if surface is None:
            return None
        try:
            tree = ast.parse(surface.content, filename="code:runtime")
        except SyntaxError as error:
            raise HarnessError(
                f"surface code:runtime does not compile: line {error.lineno}: {error.msg}"
            ) from None
        defines_run = any(
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run"
            for node in tree.body
        )
        if not defines_run:
            raise HarnessError("surface code:runtime must define a top-level function 'run'")
        return surface.content

    @property
    def unknown_params(self) -> list[str]:
        """Parameter surfaces this implementation does not read (kept, and hashed)."""
        known = {*_PARAM_PARSERS, "param:runtime-kind"}
        return [s.id for s in self.of_kind(SurfaceKind.PARAM) if s.id not in known]


def _describe_validation_error(error: ValidationError, data: Any) -> str:
    """One line per problem, naming the surface id where the problem is inside one."""
    problems = []
    for item in error.errors():
        location = list(item["loc"])
        where = ".".join(str(part) for part in location)
        if len(location) >= 2 and location[0] == "surfaces" and isinstance(location[1], int):
            try:
                surface_id = data["surfaces"][location[1]]["id"]
                where = f"surface {surface_id}" + "".join(f".{p}" for p in location[2:])
            except (KeyError, IndexError, TypeError):
                pass
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if location else message)
    return "; ".join(problems)


def parse_harness(data: Any, *, source: str = "harness document") -> HarnessDoc:
    """Validate JSON-like data as a document; errors become one `HarnessError`."""
    try:
        return HarnessDoc.model_validate(data)
    except ValidationError as error:
        raise HarnessError(f"{source} is invalid: {_describe_validation_error(error, data)}") from None


def load_harness(path: str | Path) -> HarnessDoc:
    """Read and validate a document from a JSON file; errors name the file and surface."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise HarnessError(f"cannot read harness document {file}: {error.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise HarnessError(
            f"{file} is not JSON: line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    return parse_harness(data, source=str(file))
