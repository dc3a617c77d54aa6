"""A trial is hostile: it runs as root and tries to leave its sandbox, read what it must
not read, flood harbor, or outlive a killed harbor."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harbor_jobs import run_oracle_job
from test_local_environment import (
    HARBOR,
    HARBOR_ENV,
    REPO,
    TASKS,
    WAIT_BOUND_SEC,
    make_environment,
    pytestmark,
    reward,
    run,
    running,
    sleepers,
    trial_processes,
    trial_results,
    unique_seconds,
    until_sleeping,
)

from wmo_trio.sandbox import ImageCache

__all__ = ["pytestmark"]

CHROOT_ESCAPE = textwrap.dedent("""
    import os
    os.makedirs("/tmp/jail", exist_ok=True)
    outside = os.open("/", os.O_RDONLY)
    os.chroot("/tmp/jail")
    os.fchdir(outside)
    for _ in range(64):
        os.chdir("..")
    os.chroot(".")
    print(sorted(os.listdir("/")))
    with open(os.environ["TARGET"], "w") as handle:
        handle.write("escaped")
""")


def test_the_classic_chroot_escape_stays_in_the_sandbox(tmp_path: Path) -> None:
    target = tmp_path / f"escaped-{uuid.uuid4().hex}"

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec(f"python3 -c '{CHROOT_ESCAPE}'",
                                            env={"TARGET": str(target)})
            assert result.stdout is not None
            assert "'work'" not in result.stdout and "'app'" in result.stdout
            assert result.return_code != 0  # tmp_path does not exist in there

    run(scenario)
    assert not target.exists()


def test_no_host_process_or_environment_variable_is_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("WMO_TRIO_PROBE_API_KEY", secret)

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            own = await environment.exec(f"cat /proc/{os.getpid()}/environ; "
                                         "cat /proc/[0-9]*/environ | tr '\\0' '\\n'; "
                                         "ls /proc | grep -c '^[0-9]'")
            assert own.stdout is not None
            assert secret not in own.stdout + (own.stderr or "")
            assert int(own.stdout.strip().splitlines()[-1]) <= 5  # helper, shell, pipeline

    run(scenario)


def test_the_tasks_solution_tests_and_project_are_not_readable(tmp_path: Path) -> None:
    solution = TASKS / "hello-file" / "solution" / "solve.sh"
    verifier = TASKS / "hello-file" / "tests" / "test.sh"

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            for path in (solution, verifier, REPO / "README.md", tmp_path):
                probe = await environment.exec(f"ls -d '{path}' || cat '{path}'")
                assert probe.return_code != 0, path
                assert probe.stdout is None, path

    run(scenario)


def test_proc_sys_hostname_cgroups_and_disks_stay_out_of_reach(tmp_path: Path) -> None:
    host_hostname = Path("/proc/sys/kernel/hostname").read_text()
    swappiness = Path("/proc/sys/vm/swappiness").read_text()
    cgroups = sorted(os.listdir("/sys/fs/cgroup"))
    probes = {
        "echo 7 > /proc/sys/vm/swappiness": "sysctl",
        "mkdir /sys/fs/cgroup/probe": "cgroup",
        "mknod /tmp/disk b 254 0": "mknod",
        "ls /dev | grep -E '^(vd|sd|nvme|loop|kvm|mem|kmsg)'": "devices",
        "mount -t tmpfs none /mnt": "mount",
        "hostname probe-host": "hostname",
        "echo h > /proc/sysrq-trigger": "sysrq",  # h: harmless, if it ever got through
    }

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            for command, what in probes.items():
                assert (await environment.exec(command)).return_code != 0, what

    run(scenario)
    assert Path("/proc/sys/kernel/hostname").read_text() == host_hostname
    assert Path("/proc/sys/vm/swappiness").read_text() == swappiness
    assert sorted(os.listdir("/sys/fs/cgroup")) == cgroups


# Sixteen times what a stream keeps and twice the growth of memory the test allows: output
# held whole would grow memory past that bound, a log without its cap would be many times
# its size, and past that the size changes nothing but the time it takes.
FLOOD_BYTES = 64_000_000
FLOOD = f"head -c {FLOOD_BYTES} /dev/zero | tr '\\0' a"
FLOODS = {
    # scenario: (what the Dockerfile adds, the command run in the trial, the log it fills)
    "exec-stdout": ("", FLOOD, None),
    "exec-stderr": ("", f"{FLOOD} >&2", None),
    "entrypoint": ('COPY flood.sh /flood.sh\nENTRYPOINT ["/bin/sh", "/flood.sh"]\n', None,
                   "sandbox-entrypoint.log"),
    "build-step": (f"RUN {FLOOD}; {FLOOD} >&2\n", None, "sandbox-build.log"),
}
FLOOD_SCRIPT = textwrap.dedent("""
    import asyncio, json, resource, sys, time, traceback
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from test_local_environment import WAIT_BOUND_SEC, make_environment, running

    async def flood(tmp, name, command, entrypoint, before):
        flood = make_environment(tmp, tmp / name / "environment", cache_dir=tmp / "cache")
        result = {}
        async with running(flood) as environment:
            if command:
                done = await environment.exec(command)
                result = {"stdout": len(done.stdout or ""), "stderr": len(done.stderr or ""),
                          "note": done.stderr.strip().splitlines()[-1]}
            # An ENTRYPOINT floods as the trial runs, until it says it is done.
            deadline = time.monotonic() + 5 * WAIT_BOUND_SEC
            while entrypoint and time.monotonic() < deadline:
                if (await environment.exec("test -e /tmp/flooded")).return_code == 0:
                    break
                await asyncio.sleep(0.1)
        # The peak since before the first flood: no earlier flood can hide this one's.
        result["growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        result["logs"] = {path.name: path.stat().st_size
                          for path in flood.trial_paths.trial_dir.glob("sandbox-*.log")}
        return result

    async def main(tmp, scenarios):
        async with running(make_environment(tmp, cache_dir=tmp / "cache")) as environment:
            await environment.exec("echo warm-up")  # a build, a start, an exec: all imported
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        results = {}
        for name, command in scenarios.items():
            try:
                results[name] = await flood(tmp, name, command, name == "entrypoint", before)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
        print(json.dumps(results))

    asyncio.run(main(Path(sys.argv[2]), json.loads(sys.argv[3])))
""")


@pytest.fixture(scope="module")
def floods(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every flood scenario, one after another in one fresh process: its imports and
    warm-up are paid once, and each scenario's peak is read against the same start."""
    tmp_path = tmp_path_factory.mktemp("floods")
    for scenario, (dockerfile, _, _) in FLOODS.items():
        environment_dir = tmp_path / scenario / "environment"
        environment_dir.mkdir(parents=True)
        (environment_dir / "Dockerfile").write_text(
            f"FROM debian:bookworm-slim\nWORKDIR /app\n{dockerfile}")
        (environment_dir / "flood.sh").write_text(
            f'{FLOOD}; {FLOOD} >&2; touch /tmp/flooded; exec "$@"\n')
    commands = {scenario: command or "" for scenario, (_, command, _) in FLOODS.items()}
    completed = subprocess.run(
        [sys.executable, "-c", FLOOD_SCRIPT, str(REPO / "tests"), str(tmp_path),
         json.dumps(commands)],
        capture_output=True, text=True, timeout=600, check=False, cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr
    results: dict[str, dict[str, Any]] = json.loads(completed.stdout.splitlines()[-1])
    return results


@pytest.mark.parametrize("scenario", sorted(FLOODS))
def test_a_flood_of_output_is_cut_while_it_streams(
    floods: dict[str, dict[str, Any]], scenario: str
) -> None:
    """A command's stdout or stderr, an ENTRYPOINT's output, a build step's: measured in a
    fresh process, peak memory stays within a few MB of what it was before, a command's
    result says how much was cut, and a log holds no more than its cap."""
    _, command, log = FLOODS[scenario]
    result = floods[scenario]
    assert "error" not in result, result.get("error")
    assert result["growth_kib"] < 32 * 1024
    if command is not None:
        stream = "stderr" if scenario == "exec-stderr" else "stdout"
        assert result[stream] <= (4 << 20) + 200
        assert f"{stream} was {FLOOD_BYTES:,} bytes" in result["note"]
        assert "not kept" in result["note"]
    else:
        assert 0 < result["logs"][log] < 9 << 20  # at most 4 MiB a stream, and its notes
    assert all(size < 9 << 20 for size in result["logs"].values()), result["logs"]


def test_sigkill_of_harbor_leaves_nothing_once_the_next_job_ran(tmp_path: Path) -> None:
    """Killed while one trial runs and another's image builds; the next job's image is
    built already, so nothing but its start cleans up."""
    seconds, build_seconds = unique_seconds(), unique_seconds()
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "hello-file", tasks / "hog")  # the same image as hello-file's
    (tasks / "hog" / "solution" / "solve.sh").write_text(
        f"#!/bin/sh\nhead -c 50000000 /dev/urandom > /app/blob\nsleep {seconds} &\nsleep {seconds}\n"
    )
    shutil.copytree(TASKS / "hello-file", tasks / "hog-build")
    (tasks / "hog-build" / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\n"
        f"RUN head -c 50000000 /dev/urandom > /build-blob && sleep {build_seconds}\n"
    )
    state_dir, cache_dir = tmp_path / "state", tmp_path / "cache"
    environment = {**os.environ, **HARBOR_ENV}
    harbor = subprocess.Popen(
        [str(HARBOR), "run", "-e", "wmo_trio.harbor:LocalEnvironment", "-p", str(tasks), "-a",
         "oracle", "-n", "2", "-o", str(tmp_path / "jobs"), "-y", "-q",
         "--ek", f"state_dir={state_dir}", "--ek", f"cache_dir={cache_dir}"],
        env=environment, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600  # the trial runs and the build is under way
        while ((len(sleepers(seconds)), len(sleepers(build_seconds))) != (2, 1)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert (len(sleepers(seconds)), len(sleepers(build_seconds))) == (2, 1)
        assert any(state_dir.rglob("blob"))
        assert any((cache_dir / "builds").rglob("build-blob"))
    finally:
        harbor.send_signal(signal.SIGKILL)
        harbor.wait()
    deadline = time.monotonic() + WAIT_BOUND_SEC  # the sandbox dies with its parent, asynchronously
    while (sleepers(seconds) or sleepers(build_seconds)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleepers(seconds) == sleepers(build_seconds) == []

    [result] = run_oracle_job(tmp_path / "next", TASKS / "hello-file", state_dir=str(state_dir),
                              cache_dir=str(cache_dir)).values()
    assert reward(result) == 1.0
    assert list(state_dir.iterdir()) == []
    assert list((cache_dir / "builds").iterdir()) == []
    [image] = ImageCache(cache_dir).entries()  # hello-file's, and no lock of another
    assert sorted(path.name for path in (cache_dir / "images").iterdir()) == [
        image.key, f"{image.key}.lock"]
    assert not (tmp_path / "next" / "job" / result["trial_name"] / "sandbox-build.log").exists()


def test_the_leftover_check_sees_a_zombie(tmp_path: Path) -> None:
    """The check every test here makes for leftover processes: a zombie counts."""
    seconds = unique_seconds()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            # The sleeper's parent becomes a program that never reaps it.
            await environment.exec(
                f"sh -c 'sleep {seconds} & exec sleep {seconds + 1}' > /dev/null 2>&1 &")
            [pid] = await until_sleeping(seconds, 1)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + WAIT_BOUND_SEC
            while _state(pid) != b"Z":  # dying takes a moment on a busy machine
                assert time.monotonic() < deadline, _state(pid)
                await asyncio.sleep(0.01)
            assert sleepers(seconds) == [pid]
            assert pid in trial_processes(environment)

    run(scenario)
    assert sleepers(seconds) == []


def _state(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_cancelled_command_leaves_no_process_and_no_zombie(tmp_path: Path) -> None:
    """Its shell left background children: once the cancellation propagated, every one
    of them and the shell are gone, reaped, while the trial runs on."""
    seconds = unique_seconds()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            task = asyncio.create_task(
                environment.exec(f"sleep {seconds} & sleep {seconds} & wait"))
            assert len(await until_sleeping(seconds, 2)) == 2
            assert len(trial_processes(environment)) == 3  # the shell and its children
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sleepers(seconds) == []
            assert trial_processes(environment) == []
            assert (await environment.exec("echo alive")).stdout == "alive\n"

    run(scenario)


# ---------------------------------------------------------------------- system directories
# Harbor's datasets and jobs may live inside a host directory that is a layer of every
# image (/opt here; /usr, /var and /etc alike): the tests make one of their own there.


@contextmanager
def _directory_in_opt() -> Iterator[Path]:
    path = Path("/opt") / f"wmo-trio-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def opt_dir() -> Iterator[Path]:
    with _directory_in_opt() as path:
        yield path


def _by_task(jobs_dir: Path) -> dict[str, dict[str, Any]]:
    return {result["task_name"]: result for result in trial_results(jobs_dir).values()}


@pytest.fixture(scope="module")
def opt_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Two jobs under /opt, one image cache: the first run from /opt with its tasks and
    jobs inside its working directory, the second with a dataset of two tasks beside
    its jobs, run from elsewhere. Each test reads the job it is about."""
    with _directory_in_opt() as path:
        yield {"opt": path, "cache": tmp_path_factory.mktemp("opt-cache")}


@pytest.fixture(scope="module")
def job_from_opt(opt_jobs: dict[str, Path]) -> dict[str, Any]:
    """Harbor's working directory, its tasks and its jobs: hidden paths inside one
    another, all in a system directory."""
    home = opt_jobs["opt"] / "from-opt"
    shutil.copytree(TASKS / "hello-file", home / "tasks" / "hello-file")
    return {"results": run_oracle_job(home / "jobs", home / "tasks", cwd=home,
                                      cache_dir=str(opt_jobs["cache"]))}


@pytest.fixture(scope="module")
def dataset_under_opt(opt_jobs: dict[str, Path], job_from_opt: dict[str, Any]) -> dict[str, Any]:
    """A trial of one task of a dataset in /opt probes its sibling's solution and
    tests, an earlier job beside its own, and its own job. It runs after
    ``job_from_opt``, whose image it must reuse."""
    dataset, jobs = opt_jobs["opt"] / "dataset", opt_jobs["opt"] / "jobs"
    shutil.copytree(TASKS / "hello-file", dataset / "victim")
    earlier = jobs / "earlier" / "victim__aaaaaaa"
    earlier.mkdir(parents=True)
    (earlier / "result.json").write_text("{}")
    secrets = [dataset / "victim" / "solution" / "solve.sh",
               dataset / "victim" / "tests" / "test.sh", earlier / "result.json", jobs / "job"]
    attacker = dataset / "attacker"
    shutil.copytree(TASKS / "hello-file", attacker)
    probes = "".join(f"ls -d '{path}' >> /app/seen 2>/dev/null\n" for path in secrets)
    (attacker / "solution" / "solve.sh").write_text(
        f"#!/bin/sh\n{probes}printf 'Hello from wmo_trio\\n' > /app/greeting.txt\n")
    (attacker / "tests" / "test.sh").write_text(
        "#!/bin/sh\nmkdir -p /logs/verifier\n"
        "if [ -s /app/seen ]; then cat /app/seen; echo 0; else echo 1; fi"
        " > /logs/verifier/reward.txt\n")
    run_oracle_job(jobs, dataset, concurrency=2, cache_dir=str(opt_jobs["cache"]))
    return {"results": _by_task(jobs), "jobs": jobs}


def test_no_other_task_or_job_is_readable_when_they_live_under_opt(
    dataset_under_opt: dict[str, Any]
) -> None:
    """The attacker's trial must find none of what it probes."""
    results = dataset_under_opt["results"]
    assert sorted(results) == ["attacker", "victim"]
    for name, result in results.items():
        assert result["exception_info"] is None, (name, result["exception_info"])
    seen = (dataset_under_opt["jobs"] / "job" / results["attacker"]["trial_name"] / "verifier"
            / "reward.txt")
    assert reward(results["attacker"]) == 1.0, seen.read_text()  # what it could read
    assert reward(results["victim"]) == 1.0


def test_a_job_run_from_opt_with_its_tasks_and_jobs_inside_passes(
    job_from_opt: dict[str, Any]
) -> None:
    [result] = job_from_opt["results"].values()
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0


def test_jobs_under_opt_reuse_the_image_the_first_one_built(
    opt_jobs: dict[str, Path], job_from_opt: dict[str, Any], dataset_under_opt: dict[str, Any]
) -> None:
    for job in (job_from_opt, dataset_under_opt):
        assert {reward(r) for r in job["results"].values()} == {1.0}

    assert len(ImageCache(opt_jobs["cache"]).entries()) == 1
    layers = [path for path in (opt_jobs["cache"] / "host").iterdir() if path.is_dir()]
    assert len(layers) == 1  # beside its lease's lock file


def test_in_a_system_directory_itself_its_harbor_tasks_and_jobs_are_hidden_not_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Harbor run from /opt: /opt is part of the image and stays, but the tasks and
    the job directories in it do not."""
    prefix = f"/opt/wmo-trio-test-{uuid.uuid4().hex[:12]}"
    task, job, tool = Path(f"{prefix}-task"), Path(f"{prefix}-job"), Path(f"{prefix}-tool")
    try:
        (task / "solution").mkdir(parents=True)
        (task / "task.toml").write_text("")
        (task / "solution" / "solve.sh").write_text("#!/bin/sh\n")
        job.mkdir()
        (job / "config.json").write_text("{}")
        (job / "result.json").write_text("{}")
        tool.mkdir()
        (tool / "run.sh").write_text("echo tool\n")
        monkeypatch.chdir("/opt")

        async def scenario() -> None:
            async with running(make_environment(tmp_path)) as environment:
                for path in (task, job):
                    probe = await environment.exec(f"ls -d '{path}'")
                    assert probe.return_code != 0, path
                assert (await environment.exec(f"sh '{tool}/run.sh'")).stdout == "tool\n"

        run(scenario)
    finally:
        for path in (task, job, tool):
            shutil.rmtree(path, ignore_errors=True)


def test_a_directory_holding_a_hidden_path_keeps_its_owner_mode_and_times(
    opt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (opt_dir / "harbor-cwd").mkdir()
    (opt_dir / "beside").write_text("")
    os.chown(opt_dir, 65534, 65534)
    opt_dir.chmod(0o711)
    os.utime(opt_dir, (1_577_836_800, 1_577_836_800))
    monkeypatch.chdir(opt_dir / "harbor-cwd")

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            listing = await environment.exec(f"stat -c '%a %u %g %Y' '{opt_dir}'; ls -A '{opt_dir}'")
            assert listing.stdout == "711 65534 65534 1577836800\nbeside\n"

    run(scenario)
