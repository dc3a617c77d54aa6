"""Hostile tasks against the copies in and out of a trial and the host's reads of what a
trial or a build wrote, in harbor's own job with the oracle agent (whose solve.sh
plays the agent): a planted ``tar`` and ``cat``, a ``tar`` that never ends, links out of
the log directories, a 2 GiB sparse log, a build that links resolv.conf to /proc/kmsg."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from harbor_jobs import run_oracle_job
from test_local_environment import (
    REPO,
    TASKS,
    make_environment,
    pytestmark,
    reward,
    run,
    running,
    sleepers,
    unique_seconds,
)

from wmo_trio.sandbox._errors import TransferIncomplete

__all__ = ["pytestmark"]

ESCAPE = REPO / "tests" / "hostile" / "escape.py"
GREETING = "printf 'Hello from wmo_trio\\n' > /app/greeting.txt\n"
REWARD = ("mkdir -p /logs/verifier\n"
          "if printf 'Hello from wmo_trio\\n' | cmp -s - /app/greeting.txt{extra}; then\n"
          "    echo 1 > /logs/verifier/reward.txt\nelse\n    echo 0 > /logs/verifier/reward.txt\nfi\n")


def _task(tasks: Path, name: str, solve: str, *, test_extra: str = "", test_after: str = "",
          dockerfile_extra: str = "") -> None:
    task = tasks / name
    shutil.copytree(TASKS / "hello-file", task)
    (task / "solution" / "solve.sh").write_text("#!/bin/sh\n" + GREETING + solve)
    (task / "tests" / "test.sh").write_text(
        "#!/bin/sh\n" + REWARD.format(extra=test_extra) + test_after)
    if dockerfile_extra:
        dockerfile = task / "environment" / "Dockerfile"
        dockerfile.write_text(dockerfile.read_text() + dockerfile_extra)


def _host_bytes(path: Path) -> int:
    """Disk space the files under ``path`` take (holes not counted)."""
    return sum(entry.lstat().st_blocks * 512 for entry in path.rglob("*"))


def hostile_tasks(root: Path) -> dict[str, Any]:
    """The hostile tasks under ``root / "tasks"``, and what the tests check after them."""
    host_dir = root / "host-dir"  # where a crafted archive aims to write
    host_dir.mkdir()
    secret = f"secret-{uuid.uuid4().hex}"
    secret_file = root / "host-secret"
    secret_file.write_text(secret + "\n")
    seconds = unique_seconds()
    tasks = root / "tasks"

    # A tar first on PATH: for a copy out of /logs/agent it emits an archive that writes
    # into host_dir, for /logs/verifier one that makes reward.txt a link to the secret;
    # every run leaves a marker the verifier sees. A cat wrapper does the same.
    tar_wrapper = (
        "#!/bin/sh\ntouch /app/tar-ran\ncase \" $* \" in\n"
        f"  *' -cf '*/logs/agent*) exec python3 /usr/local/lib/escape.py file {host_dir} ;;\n"
        "  *' -cf '*/logs/verifier*) exec python3 /usr/local/lib/escape.py link reward.txt "
        f"{secret_file} ;;\nesac\nexec /usr/bin/tar \"$@\"\n")
    _task(tasks, "planted-tools", (
        "cp /solution/escape.py /usr/local/lib/escape.py\n"
        f"cat > /usr/local/sbin/tar <<'EOF'\n{tar_wrapper}EOF\n"
        "printf '#!/bin/sh\\ntouch /app/cat-ran\\nexec /bin/cat \"$@\"\\n' > /usr/local/sbin/cat\n"
        "chmod 755 /usr/local/sbin/tar /usr/local/sbin/cat\n"
    ), test_extra=" && [ ! -e /app/tar-ran ] && [ ! -e /app/cat-ran ]")
    shutil.copy(ESCAPE, tasks / "planted-tools" / "solution" / "escape.py")

    _task(tasks, "endless-tar", (
        f"printf '#!/bin/sh\\nexec sleep {seconds}\\n' > /usr/local/sbin/tar\n"
        "chmod 755 /usr/local/sbin/tar\n"))

    _task(tasks, "link-farm", (
        "cd /logs/agent\nln -s / a-root\nln -s /etc/shadow b-shadow\nln -s . d\n"
        "ln -s d/../../.. e-climb\nmkdir sub\necho deep > sub/deep.txt\n"
        "ln -s ../f1.txt sub/f1-link\n"
        "for i in $(seq 1 20); do echo $i > f$i.txt; done\n"
    ), test_after=f"ln -s {secret_file} /logs/verifier/reward.json\n")

    _task(tasks, "sparse-log", (
        "truncate -s 2G /logs/agent/huge.bin\necho small > /logs/agent/small.txt\n"))

    _task(tasks, "kmsg-resolv", "",
          dockerfile_extra="RUN ln -sf /proc/kmsg /etc/resolv.conf\n")

    # Reward files harbor would parse as 1.0 (a number, then spaces), 4 MiB each.
    spaces = "head -c 4194304 /dev/zero | tr '\\0' ' '"
    _task(tasks, "huge-reward-txt", "",
          test_after=f"{spaces} >> /logs/verifier/reward.txt\n")
    _task(tasks, "huge-reward-json", "", test_after=(
        f"{{ printf '{{\"reward\": 1.0}}'; {spaces}; }} > /logs/verifier/reward.json\n"))

    return {"host_dir": host_dir, "secret": secret, "secret_file": secret_file,
            "seconds": seconds, "tasks": tasks}


@pytest.fixture(scope="module")
def hostile_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("transfer-hostile")
    job = hostile_tasks(root)
    tasks = job["tasks"]
    trials = run_oracle_job(root / "jobs", tasks, concurrency=3, cache_dir=str(root / "cache"))
    results = {result["task_name"]: result for result in trials.values()}
    return {**job, "results": results, "jobs": root / "jobs" / "job"}


def _trial_dir(job: dict[str, Any], task: str) -> Path:
    trial: Path = job["jobs"] / job["results"][task]["trial_name"]
    return trial


def _passed(job: dict[str, Any], task: str) -> None:
    result = job["results"][task]
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0


@pytest.mark.harbor
def test_a_planted_tar_or_cat_never_runs_and_writes_nothing_on_the_host(
    hostile_job: dict[str, Any],
) -> None:
    """The reward says no marker was left: neither wrapper ran, in any copy in or out."""
    _passed(hostile_job, "planted-tools")
    assert list(hostile_job["host_dir"].iterdir()) == []


@pytest.mark.harbor
def test_a_tar_that_never_ends_does_not_hold_the_trial(hostile_job: dict[str, Any]) -> None:
    _passed(hostile_job, "endless-tar")
    assert sleepers(hostile_job["seconds"]) == []


@pytest.mark.harbor
def test_links_out_of_the_log_dir_are_dropped_and_the_other_files_arrive(
    hostile_job: dict[str, Any],
) -> None:
    _passed(hostile_job, "link-farm")  # reward.json -> the host's file was not created
    agent = _trial_dir(hostile_job, "link-farm") / "agent"
    assert sorted(path.name for path in agent.glob("f*.txt")) == sorted(
        f"f{index}.txt" for index in range(1, 21))
    assert (agent / "sub" / "deep.txt").read_text() == "deep\n"
    assert os.readlink(agent / "sub" / "f1-link") == "../f1.txt"
    assert os.readlink(agent / "d") == "."
    for dropped in ("a-root", "b-shadow", "e-climb"):
        assert not os.path.lexists(agent / dropped), dropped
    log = (_trial_dir(hostile_job, "link-farm") / "trial.log").read_text()
    assert "a-root -> /" in log and "reward.json -> " in log


@pytest.mark.harbor
def test_a_sparse_2_gib_log_is_left_out_by_name_and_the_rest_arrives(
    hostile_job: dict[str, Any],
) -> None:
    _passed(hostile_job, "sparse-log")
    trial = _trial_dir(hostile_job, "sparse-log")
    assert (trial / "agent" / "small.txt").read_text() == "small\n"
    assert not (trial / "agent" / "huge.bin").exists()
    assert _host_bytes(trial) < 64 << 20
    log = (trial / "trial.log").read_text()
    assert "huge.bin (2,147,483,648 bytes" in log and "download_limit_mb" in log


@pytest.mark.harbor
def test_no_trial_puts_a_host_secret_into_its_results(hostile_job: dict[str, Any]) -> None:
    """A crafted archive (planted-tools) and a link (link-farm) both aim reward files at
    a host file: its contents reach neither result.json nor exception.txt."""
    assert set(hostile_job["results"]) >= {"planted-tools", "link-farm"}
    for path in hostile_job["jobs"].rglob("*"):
        if path.is_file() and not path.is_symlink() and path.name in (
                "result.json", "exception.txt", "trial.log"):
            assert hostile_job["secret"] not in path.read_text(errors="replace"), path
    assert hostile_job["secret_file"].read_text() == hostile_job["secret"] + "\n"


@pytest.mark.harbor
def test_a_build_linking_resolv_conf_to_proc_kmsg_ends(hostile_job: dict[str, Any]) -> None:
    """The host's check of the built /etc/resolv.conf follows no link: the build ends,
    its image is kept as built, the trial passes."""
    _passed(hostile_job, "kmsg-resolv")


@pytest.mark.harbor
def test_a_download_past_its_time_limit_ends_the_trial_with_the_error(tmp_path: Path) -> None:
    [result] = run_oracle_job(tmp_path / "jobs", TASKS / "hello-file",
                              download_timeout_sec=1e-9).values()
    assert reward(result) is None
    exception = (tmp_path / "jobs" / "job" / result["trial_name"] / "exception.txt").read_text()
    assert "download of /logs/verifier" in exception
    assert "time limit of 1e-09 s" in exception and "--ek download_timeout_sec=N" in exception


@pytest.mark.harbor
@pytest.mark.parametrize("task", ["huge-reward-txt", "huge-reward-json"])
def test_a_reward_file_past_its_bound_is_not_copied_and_scores_as_a_bad_one(
    hostile_job: dict[str, Any], task: str,
) -> None:
    """harbor reads a reward file whole: a 4 MiB one, which it would score 1.0, reaches
    it as a short text saying why, and the trial ends with harbor's error for a reward
    file it cannot parse (a failed verifier, not retried), not a lost trial."""
    result = hostile_job["results"][task]
    assert reward(result) is None
    assert result["exception_info"]["exception_type"] == "VerifierOutputParseError"
    name = "reward.json" if task.endswith("json") else "reward.txt"
    written = (_trial_dir(hostile_job, task) / "verifier" / name).read_text()
    assert len(written) < 1024 and f"/logs/verifier/{name} holds more than 1 MiB" in written
    if name == "reward.json":  # harbor's own message names the text
        assert "holds more than 1 MiB (4,194,319 bytes)" in result["exception_info"][
            "exception_message"]
    log = (_trial_dir(hostile_job, task) / "trial.log").read_text()
    assert f"/logs/verifier/{name} holds more than 1 MiB" in log


def test_reward_files_follow_links_in_their_directory_only_and_not_past_a_mib(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            made = await environment.exec(
                "cd /logs/verifier && mkdir -p sub && echo 0.5 > sub/real.txt && "
                "ln -s sub/real.txt reward.txt && truncate -s 1G reward.json")
            assert made.return_code == 0, made.stderr
            target = tmp_path / "linked"
            await environment.download_dir("/logs/verifier", target)
            assert not (target / "reward.txt").is_symlink()
            assert (target / "reward.txt").read_text() == "0.5\n"
            said = json.loads((target / "reward.json").read_text())
            assert isinstance(said, str) and "(1,073,741,824 bytes)" in said
            await environment.exec("cd /logs/verifier && rm reward.* && "
                                   "ln -s /etc/hostname reward.txt && mkfifo reward.json")
            target = tmp_path / "out"
            await environment.download_dir("/logs/verifier", target)
            assert not os.path.lexists(target / "reward.txt")
            assert "is not a regular file" in json.loads((target / "reward.json").read_text())

    run(scenario)


# ---------------------------------------------------------------------- harbor's other copies


def test_filtered_and_excluding_downloads_run_no_program_of_the_trial(tmp_path: Path) -> None:
    """harbor's own versions of these run the trial's find and tar: here a planted
    find and tar would leave markers. The patterns keep harbor's meaning."""

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            planted = await environment.exec(
                "for tool in tar find gzip; do printf '#!/bin/sh\\ntouch /tmp/$0-ran\\n' "
                "> /usr/local/sbin/$tool; chmod 755 /usr/local/sbin/$tool; done; "
                "mkdir -p /logs/verifier/cache /logs/verifier/sub && cd /logs/verifier && "
                "echo 1 > reward.txt && echo '{}' > a.json && echo '{}' > sub/b.json && "
                "echo x > notes.txt && echo c > cache/c.json && ln -s a.json link.json")
            assert planted.return_code == 0, planted.stderr
            filtered = tmp_path / "filtered"
            await environment.download_dir_filtered(
                source_dir="/logs/verifier", target_dir=filtered, include=["*.json"],
                exclude=["cache/*"], protect=["reward.txt"])
            excluded = tmp_path / "excluded"
            await environment.download_dir_with_exclusions(
                source_dir="/logs/verifier", target_dir=excluded, exclude=["cache", "*.txt"])
            markers = await environment.exec("ls /tmp")
            assert markers.stdout is None or "-ran" not in markers.stdout
            assert sorted(path.relative_to(filtered).as_posix()
                          for path in filtered.rglob("*")) == [
                "a.json", "reward.txt", "sub", "sub/b.json"]
            assert sorted(path.relative_to(excluded).as_posix()
                          for path in excluded.rglob("*")) == [
                "a.json", "link.json", "sub", "sub/b.json"]

    run(scenario)


def test_a_log_dir_linked_to_proc_is_not_read_by_the_host(tmp_path: Path) -> None:
    """The host reads as root: /proc/keys, kallsyms and their kin would say more than
    the trial may know, and would be uploaded back into it with the agent's logs."""

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            linked = await environment.exec("rm -rf /logs/agent && ln -s /proc /logs/agent")
            assert linked.return_code == 0, linked.stderr
            target = tmp_path / "agent"
            with pytest.raises(TransferIncomplete, match="kernel's proc filesystem"):
                await environment.download_dir("/logs/agent", target)
            assert list(target.iterdir()) == []
            with pytest.raises(PermissionError, match="kernel's proc filesystem"):
                await environment.download_file("/logs/agent/version", tmp_path / "version")

    run(scenario)


def test_download_limits_are_validated_when_the_environment_is_made(tmp_path: Path) -> None:
    for value in (0, -1, "lots", "inf"):
        with pytest.raises(ValueError, match="download_limit_mb must be a positive number"):
            make_environment(tmp_path, download_limit_mb=value)
    with pytest.raises(ValueError, match="download_timeout_sec must be a positive number"):
        make_environment(tmp_path, download_timeout_sec="never")
