"""The docker-free sandbox's tests' kit: the trial sandbox's marks (root on Linux, slow),
an environment built and started, harbor jobs run on it and their results read, and the
processes and mounts a trial leaves."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from wmo_trio.harbor import LocalEnvironment

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "tasks"
HARBOR = Path(sys.executable).parent / "harbor"
HOST_PATHS = (Path("/app"), Path("/logs"), Path("/tests"))

# How long a test waits for something that takes milliseconds on an idle machine: only
# a bound on a hang, far above what the busiest machine needs.
WAIT_BOUND_SEC = 60.0

SANDBOX_MARKS = [
    pytest.mark.skipif(
        sys.platform != "linux" or shutil.which("unshare") is None or os.geteuid() != 0,
        reason="LocalEnvironment is exercised here as root on Linux",
    ),
    pytest.mark.slow,  # real sandboxes: processes, namespaces, image builds
]


def snapshot(paths: tuple[Path, ...] = HOST_PATHS) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``paths`` with its mode, size and mtime (absent: nothing)."""
    entries: dict[str, tuple[int, int, int]] = {}
    for root in paths:
        if not os.path.lexists(root):
            continue
        for path in [root, *root.rglob("*")]:
            info = path.lstat()
            entries[str(path)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return entries


# Every `sleep <seconds>` process seen so far, by pid and start time: a zombie's command
# line reads empty, so one that died unreaped is known by what it was when alive.
_SEEN_SLEEPERS: dict[int, set[tuple[int, bytes]]] = {}


def sleepers(seconds: int) -> list[int]:
    """Processes whose command line is exactly ``sleep <seconds>``, and the zombies
    of those seen before: leftovers, alive or unreaped."""
    wanted = f"sleep\0{seconds}\0".encode()
    seen = _SEEN_SLEEPERS.setdefault(seconds, set())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        identity = (int(name), fields[19])  # field 22 of stat: the start time
        if cmdline == wanted and fields[0] != b"X":
            seen.add(identity)
        if identity in seen and fields[0] != b"X":
            found.append(int(name))
    return found


def trial_processes(environment: LocalEnvironment) -> list[int]:
    """Every process of a running trial but its helper, zombies included."""
    assert environment._sandbox is not None
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"X":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, pending = [], [environment._sandbox.helper_pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return sorted(found)


async def until_sleeping(seconds: int, count: int) -> list[int]:
    """``sleepers(seconds)`` once ``count`` of them run (background starts race the
    return of the exec that launched them); whatever runs after a minute otherwise."""
    deadline = time.monotonic() + WAIT_BOUND_SEC
    while True:
        found = sleepers(seconds)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.01)


def mounts_mentioning(fragment: str) -> list[str]:
    """Mount table lines, from every process's mount namespace, that name ``fragment``."""
    lines: set[str] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/mountinfo").read_text()
        except OSError:
            continue
        lines.update(line for line in text.splitlines() if fragment in line)
    return sorted(lines)


def unique_seconds() -> int:
    return random.randint(100_000, 999_999)
# Harbor's job-end telemetry imports litellm (seconds of CPU per job) to describe the
# models, and would try to reach its server; no test needs it.
HARBOR_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "HARBOR_TELEMETRY": "0"}


def run_harbor(jobs_dir: Path, *args: str, timeout: float = 600,
               cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **HARBOR_ENV}
    return subprocess.run(
        [str(HARBOR), "run", "-e", "wmo_trio.harbor:LocalEnvironment", "-o", str(jobs_dir),
         "--job-name", "job", "-y", "-q", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def trial_results(jobs_dir: Path) -> dict[str, dict[str, Any]]:
    """Each trial's result.json of the job, by trial name."""
    return {
        path.parent.name: json.loads(path.read_text())
        for path in sorted((jobs_dir / "job").glob("*/result.json"))
    }


def reward(result: dict[str, Any]) -> float | None:
    verifier = result.get("verifier_result") or {}
    value = (verifier.get("rewards") or {}).get("reward")
    return None if value is None else float(value)


def make_environment(
    tmp_path: Path,
    environment_dir: Path = TASKS / "hello-file" / "environment",
    config: EnvironmentConfig | None = None,
    **kwargs: Any,
) -> LocalEnvironment:
    trial_paths = TrialPaths(tmp_path / f"trial-{uuid.uuid4().hex[:8]}")
    trial_paths.mkdir()
    return LocalEnvironment(
        environment_dir=environment_dir,
        environment_name="test",
        session_id=f"test__{uuid.uuid4().hex[:8]}__env",
        trial_paths=trial_paths,
        task_env_config=config or EnvironmentConfig(),
        state_dir=tmp_path / "state",
        **kwargs,
    )


@asynccontextmanager
async def running(environment: LocalEnvironment) -> AsyncIterator[LocalEnvironment]:
    await environment.start(force_build=False)
    try:
        yield environment
    finally:
        await environment.stop(delete=True)


def run(coroutine: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(coroutine())


def slow_task(path: Path, seconds: int) -> Path:
    """A copy of hello-file whose solution leaves `sleep <seconds>` processes (one of them
    in a session of its own) running past the agent's short timeout."""
    shutil.copytree(TASKS / "hello-file", path)
    (path / "solution" / "solve.sh").write_text(
        f"#!/bin/sh\nsleep {seconds} &\nsetsid sleep {seconds} &\nsleep {seconds}\n"
    )
    config = (path / "task.toml").read_text()
    (path / "task.toml").write_text(
        config.replace("[agent]\ntimeout_sec = 60.0", "[agent]\ntimeout_sec = 2.0")
    )
    return path

