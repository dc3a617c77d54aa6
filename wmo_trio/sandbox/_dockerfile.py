"""Reading a task's Dockerfile: its instructions, the stage to build, and the variable
expansion Docker applies to them."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["DockerfileError", "Instruction", "expand", "final_stage", "parse"]

# Instructions that change nothing a running trial sees.
IGNORED = frozenset({"EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME",
                     "ONBUILD"})
SUPPORTED = frozenset({"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER",
                       "ENTRYPOINT", "CMD", "SHELL"}) | IGNORED


class DockerfileError(ValueError):
    """The Dockerfile cannot be read or built here; the message names the line."""


@dataclass(frozen=True)
class Instruction:
    keyword: str
    argument: str
    line: int
    flags: dict[str, str] = field(default_factory=dict)
    heredoc: str | None = None
    origin: str = ""  # where it comes from when not from the task's Dockerfile

    def describe(self) -> str:
        text = f"{self.keyword} {self.argument}".strip()
        where = self.origin or f"line {self.line}"
        return f"{where}: {text if len(text) <= 120 else text[:117] + '...'}"

    def json_list(self) -> list[str] | None:
        """The exec-form argument (a JSON array of strings), or None for shell form."""
        text = self.argument.strip()
        if not text.startswith("["):
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        return None


# Task base images built on an official one, by name prefix, and what they add to it as
# Dockerfile lines. The host's userland stands in for the official image; these lines
# rebuild the rest, since tasks rely on it (files copied to the WORKDIR their base set).
DERIVED_BASES = {
    # terminal-bench's images: the official one, tmux, curl, asciinema, WORKDIR /app.
    "ghcr.io/laude-institute/t-bench/": (
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
        "--no-install-recommends tmux curl asciinema && rm -rf /var/lib/apt/lists/*\n"
        "RUN echo 'debconf debconf/frontend select Noninteractive' | debconf-set-selections\n"
        "WORKDIR /app\n"
    ),
}

_HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")
_FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?")


def _logical_lines(text: str) -> Iterator[tuple[int, str, str | None]]:
    """(first line number, instruction text, heredoc body) with continuations joined."""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        start = index
        raw = lines[index].strip()
        index += 1
        if not raw or raw.startswith("#"):
            continue
        parts = []
        while raw.endswith("\\"):
            parts.append(raw[:-1])
            raw = ""
            while index < len(lines):
                candidate = lines[index].strip()
                index += 1
                if candidate.startswith("#"):
                    continue  # comments inside a continued instruction are dropped
                raw = candidate
                break
        parts.append(raw)
        joined = " ".join(part.strip() for part in parts if part.strip())
        heredoc = None
        match = _HEREDOC.search(joined)
        if match:
            body = []
            while index < len(lines) and lines[index].strip() != match.group(3):
                line = lines[index]
                body.append(line.lstrip("\t") if match.group(1) else line)
                index += 1
            index += 1  # the terminator
            heredoc = "\n".join(body) + "\n"
            joined = (joined[: match.start()] + joined[match.end():]).strip()
        yield start + 1, joined, heredoc


def parse(text: str) -> list[Instruction]:
    """Every instruction of a Dockerfile, flags (``--chown=...``) split off."""
    instructions = []
    for line, content, heredoc in _logical_lines(text):
        keyword, _, argument = content.partition(" ")
        keyword = keyword.upper()
        argument = argument.strip()
        if keyword not in SUPPORTED:
            raise DockerfileError(f"line {line}: unknown instruction {keyword}")
        flags: dict[str, str] = {}
        if keyword in ("COPY", "ADD", "RUN", "FROM"):
            while match := _FLAG.match(argument):
                flags[match.group(1)] = match.group(2) or ""
                argument = argument[match.end():].lstrip()
        instructions.append(Instruction(keyword, argument, line, flags, heredoc))
    return instructions


def final_stage(instructions: list[Instruction], build_args: Mapping[str, str]) -> list[Instruction]:
    """The instructions that make the last stage, with the stages it is built ``FROM``
    put first, and the global ``ARG``s its ``FROM`` lines may use."""
    stages: list[tuple[str, str, list[Instruction]]] = []  # (name, base, body)
    global_args: list[Instruction] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.argument.split()
            if not words:
                raise DockerfileError(f"{instruction.describe()}: FROM names no image")
            name = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else ""
            stages.append((name, words[0].lower(), []))
        elif not stages:
            if instruction.keyword != "ARG":
                raise DockerfileError(f"{instruction.describe()}: only ARG may come before FROM")
            global_args.append(instruction)
        else:
            stages[-1][2].append(instruction)
    if not stages:
        raise DockerfileError("the Dockerfile has no FROM instruction")
    by_name = {name: (base, body) for name, base, body in stages if name}
    chain: list[Instruction] = []
    _, base, body = stages[-1]
    seen = set()
    while True:
        chain[:0] = body
        if base not in by_name or base in seen:
            break
        seen.add(base)
        base, body = by_name[base]
    if base == "scratch":
        raise DockerfileError("FROM scratch cannot be built here: the host's userland is the "
                              "base image of every task")
    for prefix, lines in DERIVED_BASES.items():
        if base.startswith(prefix):
            chain[:0] = [replace(step, origin=f"base image {base}") for step in parse(lines)]
    for instruction in chain:
        source = instruction.flags.get("from")
        if instruction.keyword in ("COPY", "ADD") and source is not None:
            raise DockerfileError(f"{instruction.describe()}: COPY --from (another stage or "
                                  "image) is not supported by the docker-free environment")
    return chain


_VARIABLE = re.compile(r"\\\$|\$(?:\{(\w+)(?:(:[-+])([^}]*))?\}|(\w+))")


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Docker's ``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alternative}``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        name = match.group(1) or match.group(4)
        value = variables.get(name, "")
        if match.group(2) == ":-":
            return value or match.group(3)
        if match.group(2) == ":+":
            return match.group(3) if value else ""
        return value

    return _VARIABLE.sub(replace, text)


def assignments(instruction: Instruction, variables: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``(name, value)`` pairs of an ENV or ARG line (value None: an ARG without
    default)."""
    try:
        words = shlex.split(instruction.argument, posix=True)
    except ValueError as error:
        raise DockerfileError(f"{instruction.describe()}: {error}") from None
    if not words:
        raise DockerfileError(f"{instruction.describe()}: nothing to set")
    if instruction.keyword == "ENV" and "=" not in words[0]:
        # The legacy form: ENV NAME the rest of the line
        name, _, rest = instruction.argument.strip().partition(" ")
        return [(name, expand(rest.strip(), variables))]
    pairs: list[tuple[str, str | None]] = []
    for word in words:
        name, has_value, value = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise DockerfileError(f"{instruction.describe()}: {name!r} is not a variable name")
        pairs.append((name, expand(value, variables) if has_value else None))
    return pairs


def read(dockerfile: Path) -> list[Instruction]:
    try:
        text = dockerfile.read_text(errors="replace")
    except OSError as error:
        raise DockerfileError(f"cannot read {dockerfile}: {error.strerror}") from None
    return parse(text)
