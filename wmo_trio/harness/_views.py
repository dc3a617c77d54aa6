"""The views of a document: what its surfaces mean (the prompt, skills, tools, parameters,
runtime code, `doc_hash`), read once from the sorted surfaces when the document is built.

Each function raises ValueError naming the surface; the document's validator calls them
once and keeps what they return.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from wmo_trio._text import show
from wmo_trio.harness._surface import Surface, SurfaceKind, blake2b16

ENVIRONMENT_TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file")
KNOWN_TOOLS: tuple[str, ...] = (*ENVIRONMENT_TOOLS, "submit", "read_skill")
DEFAULT_TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file", "submit")

# The runtimes wmo_trio has. The original also had "pi-node" (a TypeScript agent loop);
# running such a document with the Python loop would score a different candidate than
# the one submitted, so it is refused instead.
SUPPORTED_RUNTIME_KINDS: tuple[str, ...] = ("python",)


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
    # Bounded before int(): Python refuses to convert more than 4300 digits.
    if not re.fullmatch(r"[0-9]{1,18}", value) or int(value) < 1:
        raise ValueError(f"{show(value)} is not an integer in [1, 10^18)")
    return int(value)


def _parse_temperature(text: str) -> float:
    value = text.strip()
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{show(value)} is not a number") from None
    if not math.isfinite(number) or not 0.0 <= number <= 2.0:
        raise ValueError(f"{show(value)} is not in [0, 2]")
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
class Views:
    ids: tuple[str, ...]
    doc_hash: str
    system_prompt: str
    skills: tuple[Skill, ...]
    tools: tuple[str, ...]
    params: Params
    runtime_kind: str
    runtime_code: str | None
    unknown_params: tuple[str, ...]


def views_of(surfaces: tuple[Surface, ...]) -> Views:
    by_id = {surface.id: surface for surface in surfaces}
    prompts = [s for s in surfaces if s.kind is SurfaceKind.PROMPT]
    if not prompts:
        raise ValueError("a document needs at least one prompt surface")
    skills = _skills([s for s in surfaces if s.kind is SurfaceKind.SKILL])
    return Views(
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
            shown = "missing" if name is None else show(name)
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
                raise ValueError(f"surface tool_policy:main: unknown tool {show(name)}; known "
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
            f"surface param:runtime-kind asks for runtime {show(kind)}{hint}, which wmo_trio "
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
