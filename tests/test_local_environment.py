"""Specification of ``wmo_trio.harbor:LocalEnvironment`` against real harbor.

Two layers: harbor's own CLI running the example tasks end to end, and the environment
object driven directly from asyncio for the exec and file-transfer contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths
from harbor_jobs import run_oracle_job

from wmo_trio.harbor import LocalEnvironment
from wmo_trio.sandbox import wait_for_removals

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "examples" / "tasks"
HARBOR = Path(sys.executable).parent / "harbor"
HOST_PATHS = (Path("/app"), Path("/logs"), Path("/tests"))
# How long a test waits for something that takes milliseconds on an idle machine: only
# a bound on a hang, far above what the busiest machine needs.
WAIT_BOUND_SEC = 60.0

pytestmark = [
    pytest.mark.skipif(
        sys.platform != "linux" or shutil.which("unshare") is None or os.geteuid() != 0,
        reason="LocalEnvironment is exercised here as root on Linux",
    ),
    pytest.mark.slow,  # real sandboxes: processes, namespaces, image builds
]


# ---------------------------------------------------------------------- helpers


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


# ---------------------------------------------------------------------- harbor CLI


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


@pytest.fixture(scope="module")
def example_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job of harbor's oracle and nop agents over every example task and a slow task
    (`slow_task`), with the host paths it must not touch recorded before and after; each
    test reads the trials of the agent and tasks it is about."""
    root = tmp_path_factory.mktemp("example-job")
    state_dir = root / "state"
    seconds = unique_seconds()
    slow = slow_task(root / "slow-task", seconds)
    # Two agents, and a task beside the dataset: a job file, as harbor's -c takes one.
    config = root / "job.json"
    config.write_text(json.dumps({"agents": [{"name": "oracle"}, {"name": "nop"}],
                                  "datasets": [{"path": str(TASKS)}],
                                  "tasks": [{"path": str(slow)}]}))
    before = snapshot()
    completed = run_harbor(root / "jobs", "-c", str(config), "-n", "8",
                           "--ek", f"state_dir={state_dir}")
    after = snapshot()
    results = trial_results(root / "jobs")
    by_agent: dict[str, dict[str, dict[str, Any]]] = {"oracle": {}, "nop": {}}
    for result in results.values():
        by_agent[result["agent_info"]["name"]][result["task_name"]] = result
    return {"completed": completed, "results": results, "by_agent": by_agent,
            "before": before, "after": after, "state_dir": state_dir, "seconds": seconds}


EXAMPLE_TASK_NAMES = ["calc-package", "hello-file", "proof-of-work"]


@pytest.mark.harbor
def test_oracle_solves_every_example_task(example_job: dict[str, Any]) -> None:
    assert example_job["completed"].returncode == 0, example_job["completed"].stderr
    oracle = example_job["by_agent"]["oracle"]
    assert sorted(oracle) == sorted([*EXAMPLE_TASK_NAMES, "slow-task"])
    for name in EXAMPLE_TASK_NAMES:
        assert oracle[name]["exception_info"] is None, name
        assert reward(oracle[name]) == 1.0, name


@pytest.mark.harbor
def test_a_job_leaves_host_app_logs_and_tests_untouched(example_job: dict[str, Any]) -> None:
    assert len(example_job["results"]) == 8
    assert example_job["after"] == example_job["before"]


@pytest.mark.harbor
def test_a_job_leaves_no_state_directory_or_mount(example_job: dict[str, Any]) -> None:
    state_dir: Path = example_job["state_dir"]
    assert len(example_job["results"]) == 8
    assert list(state_dir.iterdir()) == []
    assert mounts_mentioning(str(state_dir)) == []


@pytest.mark.harbor
def test_nop_agent_fails_every_example_task(example_job: dict[str, Any]) -> None:
    assert example_job["completed"].returncode == 0, example_job["completed"].stderr
    nop = example_job["by_agent"]["nop"]
    assert sorted(nop) == sorted([*EXAMPLE_TASK_NAMES, "slow-task"])
    for name, result in nop.items():
        assert result["exception_info"] is None, name
        assert reward(result) == 0.0, name


@pytest.mark.harbor
def test_sixteen_concurrent_trials_all_pass(tmp_path: Path) -> None:
    # harbor's Job in this process, as `harbor run -a oracle -k 16 -n 16` runs it: what
    # is checked is the trials, not the command line (tests/harbor_jobs.py)
    state_dir = tmp_path / "state"
    results = run_oracle_job(tmp_path / "jobs", TASKS / "hello-file", attempts=16,
                             concurrency=16, state_dir=str(state_dir))
    assert len(results) == 16
    assert [reward(r) for r in results.values()] == [1.0] * 16
    assert list(state_dir.iterdir()) == []


@pytest.mark.harbor
def test_agent_timeout_kills_the_agent_command_and_leaves_nothing(
    example_job: dict[str, Any],
) -> None:
    result = example_job["by_agent"]["oracle"]["slow-task"]
    assert example_job["completed"].returncode == 0, example_job["completed"].stderr
    assert result["exception_info"]["exception_type"] == "AgentTimeoutError"
    assert reward(result) == 0.0  # the verifier still ran
    assert sleepers(example_job["seconds"]) == []
    state_dir: Path = example_job["state_dir"]
    assert list(state_dir.iterdir()) == []
    assert mounts_mentioning(str(state_dir)) == []
    assert example_job["after"] == example_job["before"]


@pytest.mark.harbor
def test_missing_host_tools_fail_the_job_with_one_error_naming_docker(tmp_path: Path) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    environment = {**os.environ, **HARBOR_ENV, "PATH": str(empty_bin)}
    completed = subprocess.run(
        [str(HARBOR), "run", "-e", "wmo_trio.harbor:LocalEnvironment", "-p",
         str(TASKS / "hello-file"), "-a", "oracle", "-o", str(tmp_path / "jobs"), "-y", "-q"],
        capture_output=True, text=True, env=environment, cwd=REPO, timeout=600, check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0
    assert output.count("LocalEnvironment cannot run on this machine") == 1
    assert "unshare" in output
    assert "-e docker" in output


# ---------------------------------------------------------------------- exec


def test_exec_runs_as_root_in_the_dockerfile_workdir(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec("pwd; id -u")
            assert result.stdout == "/app\n0\n"
            assert result.stderr is None
            assert result.return_code == 0

    run(scenario)


def test_exec_reports_exit_code_and_stderr(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec("echo out; echo err >&2; exit 7")
            assert (result.stdout, result.stderr, result.return_code) == ("out\n", "err\n", 7)

    run(scenario)


def test_exec_honours_cwd(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert (await environment.exec("pwd", cwd="/usr/share")).stdout == "/usr/share\n"
            missing = await environment.exec("pwd", cwd="/no/such/dir")
            assert missing.return_code != 0

    run(scenario)


def test_workdir_follows_the_final_dockerfile_stage(tmp_path: Path) -> None:
    environment_dir = tmp_path / "environment"
    environment_dir.mkdir()
    (environment_dir / "Dockerfile").write_text(
        "FROM debian:bookworm-slim AS base\nARG ROOT=/srv\nWORKDIR $ROOT\n"
        "FROM python:3.12-slim\nWORKDIR /elsewhere\n"
        "FROM base\nWORKDIR project \\\n  \n"
    )

    async def scenario() -> None:
        async with running(make_environment(tmp_path, environment_dir)) as environment:
            assert (await environment.exec("pwd")).stdout == "/srv/project\n"

    run(scenario)


def test_task_workdir_overrides_the_dockerfile(tmp_path: Path) -> None:
    config = EnvironmentConfig(workdir="/opt/task-dir")

    async def scenario() -> None:
        async with running(make_environment(tmp_path, config=config)) as environment:
            assert (await environment.exec("pwd")).stdout == "/opt/task-dir\n"

    run(scenario)


def test_exec_merges_call_env_over_persistent_env(tmp_path: Path) -> None:
    async def scenario() -> None:
        environment = make_environment(
            tmp_path, persistent_env={"KEPT": "persistent", "SHADOWED": "persistent"}
        )
        async with running(environment):
            command = 'echo "$KEPT $SHADOWED $SCOPED"'
            with environment.scoped_exec_env({"SCOPED": "scoped"}):
                result = await environment.exec(command, env={"SHADOWED": "call"})
            assert result.stdout == "persistent call scoped\n"

    run(scenario)


def test_exec_does_not_see_the_host_process_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WMO_TRIO_HOST_SECRET", "do-not-leak")

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec("env")
            assert result.stdout is not None
            assert "do-not-leak" not in result.stdout
            assert "PATH=" in result.stdout

    run(scenario)


def test_tools_with_their_own_ca_roots_are_pointed_at_the_system_bundle(tmp_path: Path) -> None:
    """uv, for one, trusts only its own roots unless told; the system bundle is what
    apt, curl and pip trust, including a CA an egress proxy signs with."""

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec('test -s "$SSL_CERT_FILE" && echo "$SSL_CERT_FILE"')
            assert result.stdout == "/etc/ssl/certs/ca-certificates.crt\n"

    run(scenario)


def test_exec_runs_as_a_named_user(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec("id -un; echo $HOME", user="nobody")
            assert result.stdout == "nobody\n/nonexistent\n"

    run(scenario)


def test_exec_runs_as_a_numeric_uid_even_without_passwd_entry(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert (await environment.exec("id -u", user=65534)).stdout == "65534\n"
            assert (await environment.exec("id -u; id -g", user=4321)).stdout == "4321\n0\n"

    run(scenario)


def test_exec_uses_harbors_default_user(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            with environment.with_default_user("nobody"):
                assert (await environment.exec("id -un")).stdout == "nobody\n"
                assert (await environment.exec("id -un", user="root")).stdout == "root\n"

    run(scenario)


def test_the_image_has_the_hosts_system_accounts_but_not_its_people(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            people = await environment.exec(
                "awk -F: '$3 >= 1000 && $3 <= 60000' /etc/passwd /etc/group"
            )
            assert (people.stdout, people.return_code) == (None, 0)
            # What a Dockerfile's `useradd -u 1000` needs, whoever has 1000 on the host.
            added = await environment.exec("useradd -m -u 1000 probe && id -u probe")
            assert added.stdout == "1000\n", added.stderr
            assert (await environment.exec("id -un", user="nobody")).stdout == "nobody\n"

    run(scenario)


def test_exec_as_an_unknown_user_fails_like_docker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec("true", user="no-such-user")
            assert result.return_code == 126
            assert result.stderr is not None and "no-such-user" in result.stderr

    run(scenario)


def test_exec_timeout_kills_every_child_and_raises(tmp_path: Path) -> None:
    seconds = unique_seconds()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            command = (
                f"sleep {seconds} & setsid sleep {seconds} & "
                f"(trap '' HUP; sleep {seconds}) & sleep {seconds}"
            )
            with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
                await environment.exec(command, timeout_sec=1)
            # Checked while the trial still runs: stop would kill them anyway.
            assert sleepers(seconds) == []
            assert (await environment.exec("echo alive")).stdout == "alive\n"

    run(scenario)


def test_cancelled_exec_kills_its_processes_before_the_cancellation_propagates(
    tmp_path: Path,
) -> None:
    seconds = unique_seconds()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            task = asyncio.create_task(
                environment.exec(f"sleep {seconds} & setsid sleep {seconds} & wait")
            )
            assert len(await until_sleeping(seconds, 2)) == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sleepers(seconds) == []

    run(scenario)


def test_an_exec_cancelled_before_its_start_is_read_back_still_kills_its_processes(
    tmp_path: Path,
) -> None:
    """The interleaving a busy machine makes now and then, forced: the command runs,
    but the helper's reply saying so is still unread when the cancellation comes."""
    seconds = unique_seconds()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            task = asyncio.create_task(
                environment.exec(f"sleep {seconds} & setsid sleep {seconds} & wait")
            )
            await asyncio.sleep(0)  # the exec sends its request, then awaits the reply
            # Polling without yielding keeps the loop from reading that reply.
            deadline = time.monotonic() + WAIT_BOUND_SEC
            while len(sleepers(seconds)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(sleepers(seconds)) == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sleepers(seconds) == []

    run(scenario)


def test_exec_returns_when_the_command_exits_even_if_a_background_child_holds_its_output(
    tmp_path: Path,
) -> None:
    seconds = unique_seconds()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await asyncio.wait_for(
                environment.exec(f"sleep {seconds} & echo started"), timeout=WAIT_BOUND_SEC
            )
            assert result.stdout == "started\n"
            # Background processes live on, as in Docker.
            assert len(await until_sleeping(seconds, 1)) == 1
        assert sleepers(seconds) == []

    run(scenario)


def test_output_written_before_the_exit_is_kept_when_the_host_falls_behind(
    tmp_path: Path,
) -> None:
    """The host may read a command's output late (here a slow output callback; on a
    busy machine, the scheduler): all the command wrote before it exited is still
    returned and streamed."""
    streamed: list[str] = []

    async def slow_callback(text: str, stream: str) -> None:
        streamed.append(text)
        await asyncio.sleep(1)  # far longer than the wait for background writers

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            with environment.scoped_output_callback(slow_callback):
                result = await environment.exec("echo first; sleep 0.2; echo second")
            assert result.stdout == "first\nsecond\n"
            assert "".join(streamed) == "first\nsecond\n"

    run(scenario)


def test_a_long_output_keeps_its_head_and_tail_and_says_what_was_cut(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            result = await environment.exec(
                "printf start; head -c 10000000 /dev/zero | tr '\\0' x; printf end"
            )
            assert result.stdout is not None and result.stderr is not None
            assert len(result.stdout) == 4 << 20
            assert result.stdout.startswith("startxxx") and result.stdout.endswith("xxxend")
            assert result.stderr.strip().splitlines()[-1] == (
                f"[wmo-trio sandbox: stdout was 10,000,008 bytes; {10_000_008 - (4 << 20):,} "
                "bytes in its middle were not kept]"
            )

    run(scenario)


def test_no_network_tasks_get_only_a_loopback_interface(tmp_path: Path) -> None:
    async def scenario() -> None:
        environment = make_environment(
            tmp_path, network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
        )
        async with running(environment):
            result = await environment.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
            assert result.stdout is not None
            assert [line.strip() for line in result.stdout.splitlines()] == ["lo"]

    run(scenario)


# ---------------------------------------------------------------------- filesystem


def test_writes_stay_in_the_trial(tmp_path: Path) -> None:
    marker = f"wmo-trio-test-{uuid.uuid4().hex}"

    async def scenario() -> None:
        async with (
            running(make_environment(tmp_path)) as first,
            running(make_environment(tmp_path)) as second,
        ):
            assert (await first.exec(f"echo one > /etc/{marker}")).return_code == 0
            assert (await first.exec(f"cat /etc/{marker}")).stdout == "one\n"
            assert (await second.exec(f"test -e /etc/{marker}")).return_code == 1
            assert not Path(f"/etc/{marker}").exists()

    run(scenario)


def test_upload_and_download_a_file_round_trip(tmp_path: Path) -> None:
    source = tmp_path / "tool.sh"
    source.write_bytes(b"#!/bin/sh\necho \xff\xfe binary\n")
    source.chmod(0o750)

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            await environment.upload_file(source, "/opt/new/dir/tool.sh")
            listing = await environment.exec("stat -c '%a %U' /opt/new/dir/tool.sh")
            assert listing.stdout == "750 root\n"
            await environment.upload_file(source, "/app")  # a directory: goes inside
            assert (await environment.exec("test -f /app/tool.sh")).return_code == 0

            await environment.download_file("/opt/new/dir/tool.sh", tmp_path / "out" / "copy")
            assert (tmp_path / "out" / "copy").read_bytes() == source.read_bytes()
            with pytest.raises(FileNotFoundError):
                await environment.download_file("/no/such/file", tmp_path / "missing")
            assert not (tmp_path / "missing").exists()

    run(scenario)


def test_upload_and_download_a_directory_round_trip(tmp_path: Path) -> None:
    source = tmp_path / "tree"
    (source / "sub" / "deeper").mkdir(parents=True)
    (source / "top.txt").write_text("top\n")
    (source / "sub" / "deeper" / "run.sh").write_text("#!/bin/sh\n")
    (source / "sub" / "deeper" / "run.sh").chmod(0o755)
    (source / "empty").mkdir()

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            await environment.upload_dir(source, "/srv/tree")
            owners = await environment.exec("find /srv/tree -printf '%u\\n' | sort -u")
            assert owners.stdout == "root\n"
            await environment.exec("chmod 777 /srv/tree/sub")
            made = await environment.exec("echo inside > /srv/tree/sub/new.txt", user="nobody")
            assert made.return_code == 0
            target = tmp_path / "back"
            await environment.download_dir("/srv/tree", target)
            assert (target / "top.txt").read_text() == "top\n"
            assert (target / "empty").is_dir()
            assert stat.S_IMODE((target / "sub" / "deeper" / "run.sh").stat().st_mode) == 0o755
            assert (target / "sub" / "new.txt").stat().st_uid == os.getuid()
            with pytest.raises(FileNotFoundError):
                await environment.download_dir("/no/such/dir", tmp_path / "nothing")

    run(scenario)


def test_log_dirs_are_private_without_auto_mounting(tmp_path: Path) -> None:
    async def scenario() -> None:
        environment = make_environment(tmp_path)
        async with running(environment):
            assert not environment.is_path_mounted(
                EnvironmentPaths().verifier_dir, environment.trial_paths.verifier_dir
            )
            await environment.exec("echo 1 > /logs/verifier/reward.txt", user="nobody")
            assert not (environment.trial_paths.verifier_dir / "reward.txt").exists()
            await environment.download_dir("/logs/verifier", environment.trial_paths.verifier_dir)
            assert (environment.trial_paths.verifier_dir / "reward.txt").read_text() == "1\n"

    run(scenario)


def test_stop_leaves_no_process_mount_or_directory(tmp_path: Path) -> None:
    seconds = unique_seconds()

    async def scenario() -> None:
        environment = make_environment(tmp_path)
        state_dir = tmp_path / "state"
        async with running(environment):
            await environment.exec(f"setsid sleep {seconds} > /dev/null 2>&1 &")
            assert len(await until_sleeping(seconds, 1)) == 1
            assert mounts_mentioning(str(state_dir)) != []

        assert sleepers(seconds) == []
        assert mounts_mentioning(str(state_dir)) == []
        await asyncio.to_thread(wait_for_removals)  # the directory goes after the stop
        assert list(state_dir.iterdir()) == []
        await environment.stop(delete=True)  # a second stop is harmless

    run(scenario)


def test_stop_without_delete_keeps_the_upper_directory(tmp_path: Path) -> None:
    async def scenario() -> None:
        environment = make_environment(tmp_path)
        await environment.start(force_build=False)
        try:
            await environment.exec("echo kept > /app/kept.txt")
        finally:
            await environment.stop(delete=False)

        [trial_state] = (tmp_path / "state").iterdir()
        assert (trial_state / "upper" / "_root" / "app" / "kept.txt").read_text() == "kept\n"
        assert not (trial_state / "work").exists()
        assert mounts_mentioning(str(trial_state)) == []

    run(scenario)
