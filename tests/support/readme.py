"""The fenced blocks of README.md and docs/, and a clone of the checkout to run them in as
a reader would."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


README = ROOT / "README.md"


_FENCE = re.compile(r"(?P<skip><!-- readme-test: skip: (?P<why>[^>]*?) -->\s*\n)?"
                    r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```\s*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    file: Path
    line: int
    lang: str
    body: str
    skip: str | None

    @property
    def where(self) -> str:
        name = self.file.relative_to(ROOT) if self.file.is_relative_to(ROOT) else self.file
        return f"{name} line {self.line}"


def all_blocks(file: Path) -> list[Block]:
    """Every code block of `file`, fenced (`lang` as written) or indented (`lang` "indented")."""
    text = file.read_text()
    found = [Block(file, text[: m.start("body")].count("\n") + 1, m["lang"], m["body"], m["why"])
             for m in _FENCE.finditer(text)]
    fenced = [range(m.start(), m.end()) for m in _FENCE.finditer(text)]
    offset, previous_blank, current = 0, True, None
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        inside_fence = any(offset in span for span in fenced)
        offset += len(line)
        indented = line.startswith("    ") and line.strip() != ""
        if not inside_fence and indented and (previous_blank or current is not None):
            current = current or Block(file, number, "indented", "", None)
            current = Block(file, current.line, "indented", current.body + line[4:], None)
        elif current is not None and line.strip():
            found.append(current)
            current = None
        previous_blank = not line.strip() or (previous_blank and inside_fence)
    if current is not None:
        found.append(current)
    return found


# The fences of the blocks that run: a shell block, and Python under either name.
RUN_AS = {"sh": "sh", "python": "python", "py": "python"}


def blocks(file: Path = README) -> list[Block]:
    """The blocks of `file` that are run: ```sh, ```python and ```py."""
    return [block for block in all_blocks(file) if block.lang in RUN_AS]


def make_clone(where: Path) -> Path:
    """What a user's working copy holds after `make demo`, made in `where`: the virtualenv
    and the files the docs' commands name."""
    for name in (".venv", "examples", "wmo_trio", "README.md", "docs"):
        (where / name).symlink_to(ROOT / name)
    return where


def run_as_written(block: Block, clone: Path, telemetry: bool = False,
                   ) -> subprocess.CompletedProcess[str]:
    """Run `block` from `clone` as a user would paste it, with nothing of the project on
    PATH and none of the test run's harbor or litellm settings (harbor's telemetry off
    unless `telemetry`); fail unless it exits 0 without litellm's cost-map warnings."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("VIRTUAL_ENV", "LITELLM", "HARBOR_TELEMETRY"))
                   and name.lower() != "no_proxy"}
    environment["PATH"] = os.defpath  # nothing of the project on PATH: the README says where
    if not telemetry:
        environment["HARBOR_TELEMETRY"] = "0"
    # The telemetry event, where it is on, goes to a closed port.
    environment["HTTPS_PROXY"] = environment["https_proxy"] = "http://127.0.0.1:9"
    if RUN_AS[block.lang] == "sh":
        argv = ["bash", "-euo", "pipefail", "-c", block.body]
    else:
        argv = [str(clone / ".venv" / "bin" / "python"), "-c", block.body]
    completed = subprocess.run(argv, cwd=clone, env=environment, capture_output=True, text=True,
                               timeout=600, stdin=subprocess.DEVNULL)
    assert completed.returncode == 0, (
        f"{block.where} failed ({completed.returncode}):\n{block.body}\n"
        f"--- stdout\n{completed.stdout[-3000:]}\n--- stderr\n{completed.stderr[-3000:]}")
    # The commands are billed as offline: harbor's litellm, left to itself, spends seconds
    # retrying the download of a price list and warns about it (what the README's
    # `export LITELLM_LOCAL_MODEL_COST_MAP=True` is there to stop).
    for warning in _COST_MAP_WARNINGS:
        assert warning not in completed.stdout + completed.stderr, (
            f"{block.where}: litellm tried to download its cost map:\n"
            f"{completed.stderr[-3000:]}")
    return completed


_COST_MAP_WARNINGS = ("LiteLLM: model cost map fetch attempt",
                      "LiteLLM: Failed to fetch remote model cost map")

