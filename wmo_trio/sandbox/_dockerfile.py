"""Reading a task's Dockerfile: its instructions, the stage to build, and the variable
expansion Docker applies to them."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from wmo_trio.sandbox._errors import DockerfileError

__all__ = ["Heredoc", "Instruction", "Stage", "build_plan", "expand", "parse"]

# Instructions that change nothing a running trial sees.
IGNORED = frozenset({"EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME",
                     "ONBUILD"})
SUPPORTED = frozenset({"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER",
                       "ENTRYPOINT", "CMD", "SHELL"}) | IGNORED


@dataclass(frozen=True)
class Heredoc:
    """A here-document: ``<<NAME`` (expanded), ``<<'NAME'`` (kept as written), ``<<-NAME``
    (leading tabs dropped)."""

    name: str
    body: str  # the lines as written, each ending in a newline
    marker: str  # as it stands in the instruction
    strip_tabs: bool = False
    quoted: bool = False

    @property
    def content(self) -> str:
        if not self.strip_tabs:
            return self.body
        return "".join(line.lstrip("\t") for line in self.body.splitlines(keepends=True))

    @property
    def script(self) -> str:
        """The document as a shell reads it after its marker: body, then the end line."""
        return f"{self.body}{self.name}\n"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    argument: str
    line: int
    flags: dict[str, str] = field(default_factory=dict)
    heredocs: tuple[Heredoc, ...] = ()
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

_HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z0-9_][A-Za-z0-9_.-]*)\2")
_FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?")
# Instructions whose arguments may hold here-documents, as BuildKit reads them.
HEREDOC_KEYWORDS = frozenset({"RUN", "COPY", "ADD"})


def _starts_word(text: str, index: int) -> bool:
    """Whether ``text[index:]`` begins a whitespace-separated word, after the digits of a
    file descriptor if any: BuildKit takes a word that starts with ``<<`` for a marker,
    so ``$((1<<4))`` is arithmetic."""
    start = index
    while start > 0 and text[start - 1].isdigit():
        start -= 1
    return start == 0 or text[start - 1].isspace()


def _heredoc_markers(text: str) -> list[re.Match[str]]:
    """The ``<<NAME`` markers of a shell-form line, outside quotes, each starting a word,
    in order (``<<<`` is a here-string, not a marker)."""
    found = []
    quote = ""
    index = 0
    while index < len(text):
        char = text[index]
        if char == "\\" and quote != "'":
            index += 2
            continue
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif text.startswith("<<", index) and not text.startswith("<<<", index) and (
                _starts_word(text, index)):
            match = _HEREDOC.match(text, index)
            if match:
                found.append(match)
                index = match.end()
                continue
        index += 1
    return found


def _logical_lines(text: str) -> Iterator[tuple[int, str, tuple[Heredoc, ...]]]:
    """(first line number, instruction text, its here-documents) with continuations
    joined; a here-document's body is the lines after the instruction, in the order of
    the markers."""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        start = index
        raw = lines[index].strip()
        index += 1
        if not raw or raw.startswith("#"):
            continue
        joined, index = _continued(lines, index, raw)
        keyword, _, rest = joined.partition(" ")
        heredocs: tuple[Heredoc, ...] = ()
        if keyword.upper() in HEREDOC_KEYWORDS and not rest.lstrip().startswith("["):
            heredocs, index = _heredoc_bodies(lines, index, joined, start + 1)
        yield start + 1, joined, heredocs


def _continued(lines: list[str], index: int, raw: str) -> tuple[str, int]:
    """The instruction that starts with ``raw``, its backslash continuations joined; and
    the index of the line after it."""
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
    return " ".join(part.strip() for part in parts if part.strip()), index


def _heredoc_bodies(lines: list[str], index: int, instruction: str,
                    line_number: int) -> tuple[tuple[Heredoc, ...], int]:
    """The here-documents ``instruction`` opens, read from ``lines[index:]`` in the order
    of its markers; and the index of the line after the last."""
    heredocs: list[Heredoc] = []
    for match in _heredoc_markers(instruction):
        strip_tabs, name = bool(match.group(1)), match.group(3)
        body = []
        while True:
            if index >= len(lines):
                raise DockerfileError(f"line {line_number}: the here-document {name} "
                                      f"never ends (no line {name!r} after it)")
            line = lines[index]
            index += 1
            if (line.lstrip("\t") if strip_tabs else line) == name:
                break
            body.append(line + "\n")
        heredocs.append(Heredoc(name=name, body="".join(body), marker=match.group(0),
                                strip_tabs=strip_tabs, quoted=bool(match.group(2))))
    return tuple(heredocs), index


def parse(text: str) -> list[Instruction]:
    """Every instruction of a Dockerfile, flags (``--chown=...``) split off. A RUN keeps
    its here-document markers where they stand (its shell reads them); a COPY or ADD
    has them taken out of its sources."""
    instructions = []
    for line, content, heredocs in _logical_lines(text):
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
        if keyword in ("COPY", "ADD"):
            for heredoc in heredocs:
                argument = argument.replace(heredoc.marker, "", 1)
            argument = " ".join(argument.split()) if heredocs else argument
        instructions.append(Instruction(keyword, argument, line, flags, heredocs))
    return instructions


@dataclass(frozen=True)
class Stage:
    """A stage to build: its own instructions after those of the stages it is built
    ``FROM``; each ``COPY --from`` names the index of the stage it reads."""

    index: int
    base: str  # the image its chain starts from
    instructions: tuple[Instruction, ...]
    # The ARGs declared before the first FROM: an ARG of the stage without a value takes
    # its value from these, as under Docker.
    global_args: Mapping[str, str] = field(default_factory=dict)


# A stage as the Dockerfile declares it: (its name or "", the image it names, its body).
_Declared = tuple[str, str, list[Instruction]]


def build_plan(instructions: list[Instruction], build_args: Mapping[str, str]) -> list[Stage]:
    """The stages that make the image, each after the stages it copies from; the last
    one is the image. Stages nothing needs are not built, as under BuildKit.

    Raises :class:`DockerfileError` for what cannot be built here: ``FROM scratch``, or
    a ``COPY --from`` naming an image rather than a stage of this Dockerfile.
    """
    declared, global_args = _declared_stages(instructions, build_args)
    by_name = {name: index for index, (name, _, _) in enumerate(declared) if name}
    plan: dict[int, Stage] = {}

    def visit(index: int) -> None:
        if index in plan:
            return
        base, body = _chain(declared, by_name, index)
        steps = []
        for instruction in body:
            if instruction.keyword in ("COPY", "ADD") and "from" in instruction.flags:
                read = _copied_stage(instruction, index, by_name)
                visit(read)
                instruction = replace(instruction, flags={**instruction.flags, "from": str(read)})
            steps.append(instruction)
        plan[index] = Stage(index=index, base=base, instructions=tuple(steps),
                            global_args=dict(global_args))

    visit(len(declared) - 1)
    return list(plan.values())


def _declared_stages(instructions: list[Instruction],
                     build_args: Mapping[str, str]) -> tuple[list[_Declared], dict[str, str]]:
    """The stages in the order the Dockerfile declares them, and the ARGs before the
    first FROM (a build argument given overrides a default)."""
    declared: list[_Declared] = []
    global_args: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.argument.split()
            if not words:
                raise DockerfileError(f"{instruction.describe()}: FROM names no image")
            name = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else ""
            declared.append((name, expand(words[0], global_args).lower(), []))
        elif declared:
            declared[-1][2].append(instruction)
        elif instruction.keyword != "ARG":
            raise DockerfileError(f"{instruction.describe()}: only ARG may come before FROM")
        else:
            for arg, default in assignments(instruction, global_args):
                value = build_args.get(arg, default)
                if value is not None:
                    global_args[arg] = value
    if not declared:
        raise DockerfileError("the Dockerfile has no FROM instruction")
    return declared, global_args


def _chain(declared: list[_Declared], by_name: Mapping[str, int],
           index: int) -> tuple[str, list[Instruction]]:
    """The image stage ``index`` starts from, at the end of its chain of ``FROM <stage>``,
    and the instructions of the chain in order (a derived base's own first)."""
    body: list[Instruction] = []
    seen = set()
    while True:
        _, base, own = declared[index]
        body[:0] = own
        if base not in by_name or base in seen:
            break
        seen.add(base)
        index = by_name[base]
    if base == "scratch":
        raise DockerfileError("FROM scratch cannot be built here: the host's userland is "
                              "the base image of every task")
    for prefix, lines in DERIVED_BASES.items():
        if base.startswith(prefix):
            body[:0] = [replace(step, origin=f"base image {base}") for step in parse(lines)]
    return base, body


def _copied_stage(instruction: Instruction, stage: int, by_name: Mapping[str, int]) -> int:
    """The index of the earlier stage a ``COPY --from`` in stage ``stage`` reads."""
    value = instruction.flags["from"]
    key = value.lower()
    index = int(key) if key.isdigit() else by_name.get(key)
    if index is None:
        raise DockerfileError(
            f"{instruction.describe()}: --from={value} names an image, not a stage of this "
            "Dockerfile; the docker-free environment builds only the Dockerfile's own "
            "stages (use -e docker for a task that copies from an image)")
    if index >= stage:
        raise DockerfileError(f"{instruction.describe()}: --from={value} must name a stage "
                              "defined before this one")
    return index


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
