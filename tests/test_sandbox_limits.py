"""``task.toml``'s ``cpus`` and ``memory_mb``, and ``pids_limit``, as ceilings of the
docker-free sandbox; ``/dev/shm``'s size, a helper that dies, ``storage_mb``.

The limits are a cgroup per trial; the tests read that cgroup from the host as the
kernel shows it, and check from inside the trial that the kernel holds the trial to it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harbor.models.task.config import EnvironmentConfig
from harbor_jobs import run_oracle_job
from test_local_environment import (
    TASKS,
    WAIT_BOUND_SEC,
    make_environment,
    reward,
    run,
    running,
    trial_results,
    unique_seconds,
    until_sleeping,
)

from wmo_trio.harbor import LocalEnvironment
from wmo_trio.sandbox import _environment, _options, _storage
from wmo_trio.sandbox._cgroup import (
    PREFIX,
    HostCgroups,
    Limits,
    find_hierarchies,
    host_cgroups,
    remove_stale_cgroups,
)
from wmo_trio.sandbox._errors import ChannelClosed

HOST = host_cgroups()


def sandbox_cgroups(environment: LocalEnvironment) -> tuple[Path, ...]:
    sandbox = environment._sandbox
    assert sandbox is not None
    return () if sandbox.cgroup is None else sandbox.cgroup.directories


def hierarchy_dir(controller: str, directories: tuple[Path, ...]) -> Path:
    [base] = [h.base for h in HOST.hierarchies if controller in h.controllers]
    [directory] = [d for d in directories if d.parent == base]
    return directory


# ---------------------------------------------------------------- reading the host


def test_cgroup_v1_hierarchies_are_found_where_this_process_lives(tmp_path: Path) -> None:
    (tmp_path / "cpu" / "batch").mkdir(parents=True)
    (tmp_path / "memory" / "one").mkdir(parents=True)  # the mount shows /jobs
    (tmp_path / "pids").mkdir()
    mountinfo = "\n".join([
        "22 1 0:20 / /proc rw,nosuid - proc proc rw",
        f"30 25 0:26 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct",
        f"31 25 0:27 /jobs {tmp_path}/memory rw - cgroup cgroup rw,memory",
        f"32 25 0:28 / {tmp_path}/pids rw - cgroup cgroup rw,pids",
    ])
    membership = "4:memory:/jobs/one\n3:pids:/\n2:cpu,cpuacct:/batch\n0::/\n"
    found = find_hierarchies(mountinfo, membership, root=True)
    assert [(h.version, h.base, sorted(h.controllers)) for h in found.hierarchies] == [
        (1, tmp_path / "cpu" / "batch", ["cpu"]),
        (1, tmp_path / "memory" / "one", ["memory"]),  # the mount's root is /jobs
        (1, tmp_path / "pids", ["pids"]),
    ]
    assert found.reason is None
    not_root = find_hierarchies(mountinfo, membership, root=False)
    assert not any(not_root.offers(name) for name in ("cpu", "memory", "pids"))
    assert "need root" in (not_root.reason or "")


def test_cgroup_v2_controllers_are_used_when_the_cgroups_children_can_have_them(
        tmp_path: Path) -> None:
    base = tmp_path / "unified" / "harbor.scope"
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (base / "cgroup.subtree_control").write_text("memory\n")
    mountinfo = f"40 25 0:30 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n"
    found = find_hierarchies(mountinfo, "0::/harbor.scope\n", root=True)
    assert [(h.version, h.base, sorted(h.controllers)) for h in found.hierarchies] == [
        (2, base, ["cpu", "memory", "pids"])]
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +pids"  # for children

    (base / "cgroup.controllers").write_text("io rdma\n")
    none = find_hierarchies(mountinfo, "0::/harbor.scope\n", root=True)
    assert none.hierarchies == () and "no cgroup hierarchy has" in (none.reason or "")


def test_limits_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="cpus must be a positive"):
        Limits(cpus=0)
    with pytest.raises(ValueError, match="memory_mb must be a positive"):
        Limits(memory_mb=-1)
    with pytest.raises(ValueError, match="pids must be a positive"):
        Limits(pids=0)
    assert Limits().wanted == () and Limits(cpus=0.5, memory_mb=1).wanted == ("cpu", "memory")
    assert Limits(pids=64).wanted == ("pids",)


@pytest.mark.parametrize("kwargs", [{"pids_limit": -1}, {"pids_limit": "lots"},
                                    {"pids_limit": True}, {"shm_size_mb": 0}])
def test_bad_ceilings_are_refused_when_the_environment_is_made(
        tmp_path: Path, kwargs: dict[str, object]) -> None:
    [name] = kwargs
    with pytest.raises(ValueError, match=f"{name} must be a whole number"):
        make_environment(tmp_path, **kwargs)


# ---------------------------------------------------------------- real trials

def test_harbor_is_told_which_limits_are_enforced() -> None:
    capabilities = LocalEnvironment.resource_capabilities()
    assert capabilities.cpu_limit == HOST.offers("cpu")
    assert capabilities.memory_limit == HOST.offers("memory")
    assert capabilities.fractional_cpus and not capabilities.cpu_request


def sandbox_marks(*controllers: str) -> list[pytest.MarkDecorator]:
    """Real sandboxes, as root on Linux, whose cgroups hold ``controllers``."""
    return [
        pytest.mark.slow,
        pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                           reason="LocalEnvironment is exercised here as root on Linux"),
        pytest.mark.skipif(not all(HOST.offers(name) for name in controllers),
                           reason=f"this machine's cgroups cannot hold limits: {HOST.reason}"),
    ]


class TestTrialLimits:
    pytestmark = sandbox_marks("cpu", "memory")

    def test_memory_mb_is_a_ceiling_the_kernel_holds(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            environment = make_environment(tmp_path, config=EnvironmentConfig(memory_mb=64))
            async with running(environment):
                directory = hierarchy_dir("memory", sandbox_cgroups(environment))
                assert (directory / "memory.limit_in_bytes").read_text() == f"{64 << 20}\n"
                sandbox = environment._sandbox
                assert sandbox is not None
                assert str(sandbox.helper_pid) in (directory / "cgroup.procs").read_text().split()
                fits = await environment.exec(
                    "python3 -c 'b = b\"x\" * (16 << 20); print(len(b))'")
                assert (fits.return_code, fits.stdout) == (0, f"{16 << 20}\n")
                too_big = await environment.exec(
                    "python3 -c 'b = b\"x\" * (256 << 20); print(len(b))'")
                assert too_big.return_code == 137, too_big  # killed by the kernel
                assert (await environment.exec("echo alive")).stdout == "alive\n"

        run(scenario)

    def test_cpus_is_a_ceiling_the_kernel_holds(self, tmp_path: Path) -> None:
        busy = ("python3 -c 'import os, time\n"
                "start = time.monotonic()\n"
                "while time.monotonic() - start < 1.5: pass\n"
                "t = os.times(); print(t.user + t.system, time.monotonic() - start)'")

        async def scenario() -> None:
            environment = make_environment(tmp_path, config=EnvironmentConfig(cpus=0.25))
            async with running(environment):
                directory = hierarchy_dir("cpu", sandbox_cgroups(environment))
                assert (directory / "cpu.cfs_quota_us").read_text() == "25000\n"
                assert (directory / "cpu.cfs_period_us").read_text() == "100000\n"
                result = await environment.exec(busy)
                cpu, wall = map(float, result.stdout.split())
                # A quarter of a CPU, one period's quota of slack; a busy machine
                # only gives it less.
                assert cpu <= 0.25 * wall + 0.1, (cpu, wall)

        run(scenario)

    def test_a_trial_without_limits_has_no_cgroup(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            environment = make_environment(tmp_path, pids_limit=0)
            async with running(environment):
                assert sandbox_cgroups(environment) == ()
                assert (await environment.exec("echo alive")).stdout == "alive\n"

        run(scenario)

    def test_a_trials_cgroups_go_with_it_and_a_dead_owners_at_the_next_start(
            self, tmp_path: Path) -> None:
        dead = subprocess.Popen(["true"])
        dead.wait()  # a PID that no process has now
        stale = [h.base / f"{PREFIX}{dead.pid}.leftover" for h in HOST.hierarchies]
        for directory in stale:
            directory.mkdir()

        async def scenario() -> None:
            environment = make_environment(
                tmp_path, config=EnvironmentConfig(cpus=1, memory_mb=256))
            async with running(environment):
                assert not any(directory.exists() for directory in stale)
                directories = sandbox_cgroups(environment)
                assert len(directories) == len(HOST.for_limits(Limits(
                    cpus=1, memory_mb=256, pids=_options.DEFAULT_PIDS_LIMIT)))
                assert all(directory.is_dir() for directory in directories)
                await environment.exec("sleep 30 > /dev/null 2>&1 &")  # killed with it
            assert not any(directory.exists() for directory in directories)

        try:
            run(scenario)
        finally:
            for directory in stale:
                if directory.exists():
                    directory.rmdir()

    def test_a_cgroup_with_processes_is_never_removed_as_stale(self, tmp_path: Path) -> None:
        dead = subprocess.Popen(["true"])
        dead.wait()
        [memory] = [h for h in HOST.hierarchies if "memory" in h.controllers]
        directory = memory.base / f"{PREFIX}{dead.pid}.busy"
        directory.mkdir()
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            (directory / "cgroup.procs").write_text(str(sleeper.pid))
            assert directory not in remove_stale_cgroups(HostCgroups((memory,)))
            assert directory.is_dir()
        finally:
            sleeper.kill()
            sleeper.wait()  # the cgroup is empty once it is reaped
            directory.rmdir()


@pytest.fixture(scope="module")
def limits_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One harbor job for the limits harbor passes: two tasks differing only in
    ``memory_mb``, and one whose solution forks past ``pids_limit``. Each test reads its
    own trials; the pids ceiling is far above what the memory tasks start, and the
    fork-bomb task asks for no memory ceiling."""
    tmp_path = tmp_path_factory.mktemp("limits-job")
    tasks = tmp_path / "tasks"
    for memory_mb in (64, 512):
        task = tasks / f"hello-{memory_mb}"
        shutil.copytree(TASKS / "hello-file", task)
        toml = (task / "task.toml").read_text()
        (task / "task.toml").write_text(
            toml.replace("[environment]\n", f"[environment]\nmemory_mb = {memory_mb}\n"))
        solve = task / "solution" / "solve.sh"
        solve.write_text("#!/bin/sh\nset -e\n"
                         "python3 -c 'b = b\"x\" * (128 << 20)'\n" + solve.read_text())
    task = tasks / "fork-bomb"
    shutil.copytree(TASKS / "hello-file", task)
    (task / "solution" / "solve.sh").write_text(f"#!/bin/sh\n{FORK_BOMB} > /app/forks\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/sh\nmkdir -p /logs/verifier\nread forked refused < /app/forks\n"
        "cp /app/forks /logs/verifier/forks\n"
        'if [ "$refused" -gt 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')

    results = run_oracle_job(tmp_path / "jobs", tasks, concurrency=3, pids_limit=64)

    assert sorted(result["task_name"] for result in results.values()
                  ) == ["fork-bomb", "hello-512", "hello-64"]
    return tmp_path / "jobs"


@pytest.mark.harbor
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                    reason="LocalEnvironment is exercised here as root on Linux")
@pytest.mark.skipif(not HOST.offers("memory"),
                    reason=f"this machine's cgroups cannot hold limits: {HOST.reason}")
def test_harbor_trials_get_their_tasks_memory_mb(limits_job: Path) -> None:
    # Through harbor's job: the same task and solution, whose solution needs 128 MiB on
    # its way, passes with memory_mb 512 and fails with memory_mb 64.
    rewards = {name.split("__")[0]: reward(result)
               for name, result in trial_results(limits_job).items()
               if name.startswith("hello-")}
    assert rewards == {"hello-64": 0.0, "hello-512": 1.0}, rewards


# ---------------------------------------------------------------- processes, /dev/shm, storage

FORK_BOMB = (
    "python3 -c 'import os, signal, time\n"
    "children, refused = [], 0\n"
    "for _ in range(200):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except BlockingIOError:\n"
    "        refused += 1\n"
    "        continue\n"
    "    if pid == 0:\n"
    "        time.sleep(600)\n"
    "        os._exit(0)\n"
    "    children.append(pid)\n"
    "for pid in children: os.kill(pid, signal.SIGKILL)\n"
    "print(len(children), refused)'"
)


class TestProcessAndMemoryFaults:
    pytestmark = sandbox_marks("pids", "memory")

    def test_a_fork_bomb_is_refused_at_the_pids_ceiling_and_the_trial_goes_on(
            self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with running(make_environment(tmp_path, pids_limit=64)) as environment:
                result = await environment.exec(FORK_BOMB)
                assert result.return_code == 0, result
                forked, refused = map(int, (result.stdout or "").split())
                assert forked < 64 and refused == 200 - forked, result.stdout
                assert (await environment.exec("echo alive")).stdout == "alive\n"
                directory = hierarchy_dir("pids", sandbox_cgroups(environment))
                assert (directory / "pids.max").read_text() == "64\n"

        run(scenario)

    def test_commands_fail_clearly_while_the_ceiling_is_full_until_the_filler_is_cancelled(
            self, tmp_path: Path) -> None:
        bomb = ("python3 -c 'import os, time\n"
                "while True:\n"
                "    try:\n"
                "        pid = os.fork()\n"
                "    except BlockingIOError:\n"
                "        break\n"
                "    if pid == 0:\n"
                "        break\n"
                "time.sleep(600)'")

        async def scenario() -> None:
            async with running(make_environment(tmp_path, pids_limit=32)) as environment:
                directory = hierarchy_dir("pids", sandbox_cgroups(environment))
                agent = asyncio.create_task(environment.exec(bomb))
                deadline = time.monotonic() + WAIT_BOUND_SEC
                while True:  # until every process the ceiling allows runs
                    current = (directory / "pids.current").read_text().strip()
                    if current == "32" or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.01)
                refused = await environment.exec("echo alive")
                assert refused.return_code == 126, refused
                assert "pids_limit" in (refused.stderr or ""), refused
                # As harbor's agent timeout cancels a command: its whole tree goes.
                agent.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await agent
                assert (await environment.exec("echo alive")).stdout == "alive\n"

        run(scenario)

    def test_the_pids_ceiling_is_1024_unless_pids_limit_says_otherwise(
            self, tmp_path: Path) -> None:
        async def pids_max(**kwargs: object) -> str | None:
            """The trial's pids.max; None when it has no pids cgroup."""
            async with running(make_environment(tmp_path, **kwargs)) as environment:
                directories = sandbox_cgroups(environment)
                if not any("pids" in h.controllers and d.parent == h.base
                           for h in HOST.hierarchies for d in directories):
                    return None
                directory = hierarchy_dir("pids", directories)
                return (directory / "pids.max").read_text().strip()

        async def scenario() -> None:
            assert await pids_max() == "1024"
            assert await pids_max(pids_limit="4096") == "4096"  # as --ek passes it
            assert await pids_max(pids_limit=0) is None  # none

        run(scenario)

    def test_dev_shm_is_bounded_so_filling_it_fails_and_the_helper_lives(
            self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with running(make_environment(tmp_path)) as environment:
                size = await environment.exec(
                    "df -k --output=size /dev/shm | tail -n 1; stat -c %a /dev/shm")
                assert (size.stdout or "").split() == ["65536", "1777"]  # as Docker's
                # /dev itself, an in-memory filesystem of no size, takes no files.
                beside = await environment.exec("echo x > /dev/fill")
                assert "Read-only file system" in (beside.stderr or ""), beside
                assert (await environment.exec("echo x > /dev/null")).return_code == 0
            constrained = make_environment(tmp_path, config=EnvironmentConfig(memory_mb=64))
            async with running(constrained) as environment:
                fill = await environment.exec("head -c 200000000 /dev/zero > /dev/shm/fill")
                assert fill.return_code != 0
                assert "No space left on device" in (fill.stderr or ""), fill
                size = await environment.exec("du -k /dev/shm/fill | cut -f1")
                assert int(size.stdout or 0) <= 32 << 10  # half of memory_mb
                assert (await environment.exec("echo alive")).stdout == "alive\n"

        run(scenario)

    def test_commands_start_above_the_helper_for_the_oom_killer_and_cannot_go_below(
            self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with running(make_environment(tmp_path)) as environment:
                sandbox = environment._sandbox
                assert sandbox is not None
                helper = int(Path(f"/proc/{sandbox.helper_pid}/oom_score_adj").read_text())
                score = await environment.exec("cat /proc/self/oom_score_adj")
                assert int(score.stdout or "") == min(1000, helper + 500)
                lower = await environment.exec(f"echo {helper - 1} > /proc/self/oom_score_adj")
                assert lower.return_code != 0, lower

        run(scenario)

    def test_a_trial_whose_helper_dies_says_how_and_what_the_kernel_killed(
            self, tmp_path: Path) -> None:
        async def scenario() -> None:
            environment = make_environment(tmp_path, config=EnvironmentConfig(memory_mb=64))
            async with running(environment):
                too_big = await environment.exec(
                    "python3 -c 'b = b\"x\" * (256 << 20)'")
                assert too_big.return_code == 137, too_big
                sandbox = environment._sandbox
                assert sandbox is not None
                seconds = unique_seconds()
                command = asyncio.create_task(environment.exec(f"sleep {seconds}"))
                assert len(await until_sleeping(seconds, 1)) == 1
                os.kill(sandbox.helper_pid, signal.SIGKILL)
                with pytest.raises(ChannelClosed) as failure:
                    await command
                message = str(failure.value)
                assert "helper (PID 1) was killed by SIGKILL" in message, message
                assert re.search(r"killed [1-9]\d* process\(es\) of the trial for want of "
                                 "memory", message), message

        run(scenario)


def test_storage_mb_where_it_cannot_be_held_is_said_once_per_task_to_be_unenforced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A machine without loop devices; the probe itself is tested in test_sandbox_storage.
    monkeypatch.setattr(_environment, "_WARNED_UNENFORCED", set())
    monkeypatch.setattr(_storage, "problem", lambda: "this machine offers no loop devices")
    config = EnvironmentConfig(storage_mb=512)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            ceilings = make_environment(tmp_path, config=config)._ceilings()
    warnings = [r.getMessage() for r in caplog.records if "not enforced" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "storage_mb=512" in warnings[0] and "no loop devices" in warnings[0]
    assert ceilings.storage_bytes is None
    assert ceilings.limits.pids == (1024 if HOST.offers("pids") else None)


def test_storage_mb_is_a_ceiling_where_it_can_be_held_and_must_be_positive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_environment, "_WARNED_UNENFORCED", set())
    monkeypatch.setattr(_storage, "problem", lambda: None)
    with caplog.at_level(logging.WARNING):
        ceilings = make_environment(
            tmp_path, config=EnvironmentConfig(storage_mb=512))._ceilings()
    assert ceilings.storage_bytes == 512 << 20
    assert not [r for r in caplog.records if "storage_mb" in r.getMessage()]
    with pytest.raises(ValueError, match="storage_mb must be a positive number of MiB"):
        make_environment(tmp_path, config=EnvironmentConfig(storage_mb=0))._ceilings()


@pytest.mark.harbor
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                    reason="LocalEnvironment is exercised here as root on Linux")
@pytest.mark.skipif(not HOST.offers("pids"),
                    reason=f"this machine's cgroups cannot hold limits: {HOST.reason}")
def test_harbors_cli_passes_pids_limit_and_a_solutions_fork_bomb_is_refused(
        limits_job: Path) -> None:
    [(name, result)] = [(name, result) for name, result in trial_results(limits_job).items()
                        if name.startswith("fork-bomb__")]
    assert result["exception_info"] is None, result["exception_info"]
    forks = limits_job / "job" / name / "verifier" / "forks"
    assert reward(result) == 1.0, forks.read_text() if forks.exists() else None
    forked, refused = map(int, forks.read_text().split())
    assert forked < 64 and forked + refused == 200
