"""``storage_mb`` (task.toml's, and harbor's override) as a ceiling of what a trial of the
docker-free environment writes: a filesystem of that size under its overlays, whose
first write past it fails with ENOSPC while the trial goes on, and which leaves no loop
device or mount behind, whether the trial is stopped or its owner killed."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harbor.models.task.config import EnvironmentConfig
from harbor_jobs import run_oracle_job
from test_local_environment import (
    REPO,
    TASKS,
    WAIT_BOUND_SEC,
    make_environment,
    mounts_mentioning,
    pytestmark,
    reward,
    run,
    running,
)

from wmo_trio.sandbox import _storage, wait_for_removals

__all__ = ["pytestmark"]

MIB = 1 << 20
# Fills /app until the filesystem refuses, then says how far it got and why it stopped.
FILL = ("dd if=/dev/zero of=/app/fill bs=1M count={count} 2> /app/fill.err; "
        "echo $(stat -c %s /app/fill) $(grep -c 'No space left on device' /app/fill.err)")


def loop_devices_under(path: Path) -> list[str]:
    """The loop devices whose backing file lies under ``path``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip().startswith(str(path)):
                found.append(backing.parent.parent.name)
        except OSError:  # detached meanwhile
            continue
    return found


def until_no_loop_device_under(path: Path) -> list[str]:
    """``loop_devices_under(path)`` once empty, or after a minute: a device detaches
    itself once its last mount is gone, as the kernel gets to it."""
    deadline = time.monotonic() + WAIT_BOUND_SEC
    while (found := loop_devices_under(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


needs_storage = pytest.mark.skipif(_storage.problem() is not None,
                                   reason=f"storage_mb cannot be held here: {_storage.problem()}")


@needs_storage
def test_harbors_storage_mb_override_is_a_ceiling_and_the_trial_goes_on(tmp_path: Path) -> None:
    async def scenario() -> None:
        environment = make_environment(tmp_path, override_storage_mb=32)
        async with running(environment):
            filled = await environment.exec(FILL.format(count=64))
            size, refused = map(int, (filled.stdout or "").split())
            assert refused == 1, filled  # dd's first write past the ceiling
            assert 32 * MIB <= size <= 40 * MIB, size
            # The trial goes on: what is freed can be written again.
            again = await environment.exec("rm /app/fill && " + FILL.format(count=16))
            assert again.stdout == f"{16 * MIB} 0\n", again
            assert loop_devices_under(tmp_path / "state") != []

    run(scenario)


@needs_storage
def test_a_stopped_trial_leaves_no_loop_device_mount_or_image(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    async def scenario() -> None:
        environment = make_environment(tmp_path, config=EnvironmentConfig(storage_mb=16))
        async with running(environment):
            await environment.exec("echo written > /app/file")
            assert loop_devices_under(state_dir) != []
        await asyncio.to_thread(wait_for_removals)

    run(scenario)
    assert until_no_loop_device_under(state_dir) == []
    assert mounts_mentioning(str(state_dir)) == []
    assert list(state_dir.iterdir()) == []


@needs_storage
def test_a_kept_trial_keeps_its_changes_in_its_image(tmp_path: Path) -> None:
    async def scenario() -> None:
        environment = make_environment(tmp_path, config=EnvironmentConfig(storage_mb=16))
        await environment.start(force_build=False)
        try:
            await environment.exec("echo kept > /app/kept.txt")
        finally:
            await environment.stop(delete=False)

    run(scenario)
    [trial_state] = (tmp_path / "state").iterdir()
    # fstab names the lower layers by the links of layers/, kept with it.
    assert sorted(path.name for path in trial_state.iterdir()) == ["fstab", "layers",
                                                                    _storage.IMAGE]
    assert until_no_loop_device_under(trial_state) == []
    read = subprocess.run(
        ["unshare", "--mount", "sh", "-c", 'mount -o loop,ro "$1" "$2" && '
         'cat "$2/upper/_root/app/kept.txt"', "sh", str(trial_state / _storage.IMAGE),
         str(tmp_path)], capture_output=True, text=True, check=False)
    assert read.stdout == "kept\n", read.stderr


# Runs one trial with storage_mb and says so, then waits to be killed.
OWNER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from harbor.models.task.config import EnvironmentConfig
    from test_local_environment import make_environment

    async def main() -> None:
        environment = make_environment(Path(sys.argv[2]), config=EnvironmentConfig(storage_mb=16))
        await environment.start(force_build=False)
        await environment.exec("echo written > /app/file")
        print("started", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


@needs_storage
def test_a_killed_owner_leaves_no_loop_device_or_mount_and_the_next_start_sweeps_it(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "state"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(REPO / "tests"), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline() == "started\n"
        assert loop_devices_under(state_dir) != []
        [dead_trial] = [path for path in state_dir.iterdir() if path.is_dir()]
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert until_no_loop_device_under(state_dir) == []
    assert mounts_mentioning(str(state_dir)) == []

    async def next_start() -> None:
        async with running(make_environment(tmp_path)):
            assert not dead_trial.exists()

    run(next_start)


@needs_storage
@pytest.mark.harbor
def test_task_tomls_storage_mb_holds_in_harbors_job(tmp_path: Path) -> None:
    """Through harbor's own job: the solution fills its disk past the task's storage_mb,
    sees ENOSPC, and still writes its answer; the verifier checks both."""
    task = tmp_path / "tasks" / "fills-its-disk"
    shutil.copytree(TASKS / "hello-file", task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace("[environment]\n",
                                                 "[environment]\nstorage_mb = 48\n"))
    solve = task / "solution" / "solve.sh"
    solve.write_text("#!/bin/sh\n" + FILL.format(count=128) + " > /app/filled\n"
                     "rm /app/fill\n" + solve.read_text().removeprefix("#!/bin/sh\n"))
    test = task / "tests" / "test.sh"
    test.write_text("#!/bin/sh\nread size refused < /app/filled\n"
                    f'[ "$refused" = 1 ] && [ "$size" -ge {48 * MIB} ] && '
                    f'[ "$size" -le {56 * MIB} ] || {{ mkdir -p /logs/verifier; '
                    "echo 0 > /logs/verifier/reward.txt; exit 0; }\n"
                    + test.read_text().removeprefix("#!/bin/sh\n"))
    [result] = run_oracle_job(tmp_path / "jobs", task).values()
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0, json.dumps(result.get("verifier_result"))
