"""The `wmo-trio` command run as a user runs it: a fresh interpreter, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


CLI = [sys.executable, "-c", "from wmo_trio.cli import main; main()"]


def wmo_trio(*args: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 300, cli: list[str] = CLI) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    return subprocess.run([*cli, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**environment, **(env or {})})

