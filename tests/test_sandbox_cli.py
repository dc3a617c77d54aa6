"""`wmo-trio` says when it falls back to the sandbox, and lists and prunes its images."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
from test_cli import ROOT, wmo_trio
from test_local_environment import (
    HARBOR_ENV,
    WAIT_BOUND_SEC,
    make_environment,
    pytestmark,
    reward,
    run_harbor,
    trial_results,
)
from typer.testing import CliRunner

from wmo_trio.cli import app
from wmo_trio.sandbox._rootfs import host_layers, prune_host_layers

__all__ = ["pytestmark"]

HELLO = ROOT / "examples" / "tasks" / "hello-file"


@pytest.mark.harbor
def test_run_says_once_on_stderr_that_it_falls_back_to_the_sandbox(tmp_path: Path) -> None:
    completed = wmo_trio("run", "-o", "jobs", "-p", str(HELLO), cwd=tmp_path,
                         env={**HARBOR_ENV, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert completed.returncode == 0, completed.stderr
    lines = [line for line in completed.stderr.splitlines() if "docker-free sandbox" in line]
    assert len(lines) == 1
    assert "no Docker daemon answers" in lines[0]


@pytest.mark.harbor
def test_sandbox_images_lists_a_built_image_and_prune_removes_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # Longer than the 32 characters the listing's task column once had.
    task = shutil.copytree(HELLO, tmp_path / "tasks" / "hello-file-with-a-name-longer-than-32")
    completed = run_harbor(tmp_path / "jobs", "-p", str(task), "-a", "oracle",
                           "--ek", f"cache_dir={cache}")
    assert completed.returncode == 0, completed.stderr
    assert [reward(r) for r in trial_results(tmp_path / "jobs").values()] == [1.0]

    listed = wmo_trio("sandbox", "images", "--cache-dir", str(cache), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    cache_line = rows.pop()
    # Every column starts where its heading does, whatever the task's name (the size, last
    # used and built-by columns followed a 32-character task column).
    assert rows[0].split()[1] == task.name
    assert rows[0].index("MiB") + 3 == header.index("size") + 4
    assert rows[0].index("20", header.index("last used")) == header.index("last used")
    # Whose it is, in a cache every user of the machine shares (before: not said): the
    # last column, wrapped where the job's path is long.
    built_by = header.index("built by")
    job = next(path for path in (tmp_path / "jobs").iterdir() if path.is_dir())
    shown = "".join(row[built_by:].strip() for row in rows)
    assert shown.replace(" ", "") == f"{getpass.getuser()},{job}"
    assert "shared: every job run with it, whoever runs it" in cache_line
    pruned = wmo_trio("sandbox", "prune", "--cache-dir", str(cache), cwd=tmp_path)
    assert pruned.returncode == 0, pruned.stderr
    assert "removed 1 image(s)" in pruned.stdout
    again = wmo_trio("sandbox", "images", "--cache-dir", str(cache), cwd=tmp_path)
    assert "hello-file" not in again.stdout
    assert not list((cache / "images").iterdir())


def _process_naming(token: str) -> int | None:
    """The pid of a process whose command line holds ``token``, if one runs."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    return int(name)
    return None


def test_prune_keeps_and_names_the_layers_a_running_build_or_trial_uses(
        tmp_path: Path) -> None:
    """A build step waits, mid-RUN, for a file this test makes once prune has run; then
    it imports a module from the host's layers. The layers stay while the build (and
    the trial it builds for) holds them, and prune says so; so do the trial's image and
    layers while the trial runs (`make test` once failed with "cannot run bash" and "No
    module named 'warnings'" in a trial while the docs' own prune command ran beside
    it); once the trial stops, the next prune removes them."""
    token = f"go-{uuid.uuid4().hex}"
    context = tmp_path / "task" / "environment"
    context.mkdir(parents=True)
    (context / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\n"
        f"RUN until [ -e /tmp/{token} ]; do sleep 0.05; done && python3 -c 'import json'\n")
    cache = tmp_path / "cache"
    prune = ["sandbox", "prune", "--cache-dir", str(cache)]

    async def scenario() -> str:
        environment = make_environment(tmp_path, context, cache_dir=str(cache))
        starting = asyncio.create_task(environment.start(force_build=False))
        deadline = time.monotonic() + WAIT_BOUND_SEC
        while (step := _process_naming(token)) is None:
            assert not starting.done(), starting.exception()
            assert time.monotonic() < deadline, "the build step never started"
            await asyncio.sleep(0.02)
        pruned = await asyncio.to_thread(CliRunner().invoke, app, prune)
        Path(f"/proc/{step}/root/tmp/{token}").touch()  # through the step's own root
        try:
            await starting
            during = await asyncio.to_thread(CliRunner().invoke, app, prune)
            ran = await environment.exec("python3 -c 'import warnings' && bash -c 'echo ok'")
            assert (ran.return_code, ran.stdout) == (0, "ok\n"), ran
        finally:
            await environment.stop(delete=True)
        return pruned.stdout + during.stdout

    output = asyncio.run(scenario())

    assert output.count("removed 0 image(s)") == 2
    layers = [line for line in output.splitlines() if line.startswith("kept host layer")]
    assert len(layers) == 2 and str(cache / "host") in layers[0], output
    assert all(line.endswith("a trial or build uses it") for line in layers)
    [image] = [line for line in output.splitlines() if line.startswith("kept image")]
    assert "a trial or build uses it" in image, output
    again = CliRunner().invoke(app, prune).stdout
    assert "removed 1 image(s)" in again and "kept" not in again
    assert [path.name for path in (cache / "host").iterdir()] == []


def test_a_host_layer_is_pruned_only_once_no_lease_holds_it(tmp_path: Path) -> None:
    first = host_layers(tmp_path, [])
    second = host_layers(tmp_path, [])  # another trial's lease on the same layers
    layer = first.skeleton.parent
    assert prune_host_layers(tmp_path) == ([], [layer])
    first.release()
    first.release()  # again: nothing (never another's descriptor)
    assert prune_host_layers(tmp_path) == ([], [layer])
    second.release()
    assert prune_host_layers(tmp_path) == ([layer], [])
    assert list((tmp_path / "host").iterdir()) == []
    third = host_layers(tmp_path, [])  # made again when next needed
    assert third.skeleton.is_dir() and third.skeleton.parent == layer
    third.release()
