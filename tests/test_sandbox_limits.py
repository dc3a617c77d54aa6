"""``task.toml``'s ``cpus`` and ``memory_mb`` as ceilings of the docker-free sandbox.

The limits are a cgroup per trial; the tests read that cgroup from the host as the
kernel shows it, and check from inside the trial that the kernel holds the trial to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harbor.models.task.config import EnvironmentConfig
from test_local_environment import TASKS, make_environment, reward, run, run_harbor, running, trial_results

from wmo_trio.harbor import LocalEnvironment
from wmo_trio.sandbox._cgroup import (
    PREFIX,
    HostCgroups,
    Limits,
    find_hierarchies,
    host_cgroups,
    remove_stale_cgroups,
)

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
    assert not not_root.offers("cpu") and not not_root.offers("memory")
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

    (base / "cgroup.controllers").write_text("io\n")
    none = find_hierarchies(mountinfo, "0::/harbor.scope\n", root=True)
    assert none.hierarchies == () and "no cgroup hierarchy has" in (none.reason or "")


def test_limits_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="cpus must be a positive"):
        Limits(cpus=0)
    with pytest.raises(ValueError, match="memory_mb must be a positive"):
        Limits(memory_mb=-1)
    assert Limits().wanted == () and Limits(cpus=0.5, memory_mb=1).wanted == ("cpu", "memory")


# ---------------------------------------------------------------- real trials

def test_harbor_is_told_which_limits_are_enforced() -> None:
    capabilities = LocalEnvironment.resource_capabilities()
    assert capabilities.cpu_limit == HOST.offers("cpu")
    assert capabilities.memory_limit == HOST.offers("memory")
    assert capabilities.fractional_cpus and not capabilities.cpu_request


@pytest.mark.slow  # real sandboxes
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                    reason="LocalEnvironment is exercised here as root on Linux")
@pytest.mark.skipif(not (HOST.offers("cpu") and HOST.offers("memory")),
                    reason=f"this machine's cgroups cannot hold limits: {HOST.reason}")
class TestTrialLimits:
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
            environment = make_environment(tmp_path)
            async with running(environment):
                assert sandbox_cgroups(environment) == ()

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
                assert len(directories) == len(HOST.for_limits(Limits(cpus=1, memory_mb=256)))
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


@pytest.mark.harbor
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                    reason="LocalEnvironment is exercised here as root on Linux")
@pytest.mark.skipif(not HOST.offers("memory"),
                    reason=f"this machine's cgroups cannot hold limits: {HOST.reason}")
def test_harbor_trials_get_their_tasks_memory_mb(tmp_path: Path) -> None:
    # Through harbor's CLI: the same task and solution, whose solution needs 128 MiB on
    # its way, passes with memory_mb 512 and fails with memory_mb 64.
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
    completed = run_harbor(tmp_path / "jobs", "-p", str(tasks), "-a", "oracle", "-n", "2")
    assert completed.returncode == 0, completed.stderr
    rewards = {name.split("__")[0]: reward(result)
               for name, result in trial_results(tmp_path / "jobs").items()}
    assert rewards == {"hello-64": 0.0, "hello-512": 1.0}, rewards
