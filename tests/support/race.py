"""A race's candidates for tests: documents whose episodes solve a task at a given rate."""

from __future__ import annotations

import json
from pathlib import Path

PROGRAM = """import hashlib
ANSWER = {answer!r}
{preamble}
RATE = {rate}


def run(kit):
    share = int(hashlib.sha256(kit.instruction.encode()).hexdigest()[:8], 16) / 2**32
    {pause}
    if share < RATE:
        kit.execute("write_file", {{"path": ANSWER, "content": "ok\\n"}})
    kit.execute("submit", {{"answer": "done"}})
"""


def candidate(directory: Path, name: str, rate: float, *, broken: bool = False,
              pause: float = 0.0, answer: str = "/app/answer.txt") -> Path:
    """A document whose program passes a task when the task's hash falls under `rate`;
    `broken`: its program raises as it loads, before `run` is called."""
    code = PROGRAM.format(rate=rate, answer=answer, preamble='raise RuntimeError("broken at load")'
                          if broken else "",
                          pause=f'kit.execute("bash", {{"command": "sleep {pause}"}})'
                          if pause else "pass")
    doc = {"name": name, "surfaces": [
        {"id": "prompt:core", "kind": "prompt", "content": f"Candidate {name}."},
        {"id": "code:runtime", "kind": "code", "content": code}]}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path

