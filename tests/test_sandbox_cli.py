"""`wmo-trio` says when it falls back to the sandbox, and lists and prunes its images."""

from __future__ import annotations

import getpass
import shutil
from pathlib import Path

import pytest
from test_cli import ROOT, wmo_trio
from test_local_environment import HARBOR_ENV, pytestmark, reward, run_harbor, trial_results

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
