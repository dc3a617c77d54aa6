"""When the agent phase ends, nothing the agent started runs on while the verifier works;
the task's ENTRYPOINT services do.

Harbor tells an environment nothing when an agent phase ends: the docker-free
environment takes harbor's first read of the agent's logs as that end. The first test
holds harbor's real ``Trial`` to the order that relies on; the others are hostile tasks
run in harbor's own job with the ``oracle`` agent, whose ``solve.sh`` plays the agent.
"""

from __future__ import annotations

import asyncio
import shutil
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial
from harbor_jobs import run_oracle_job
from test_local_environment import (
    TASKS,
    make_environment,
    pytestmark,
    reward,
    run,
    running,
    sleepers,
    unique_seconds,
    until_sleeping,
)

from wmo_trio.harbor import LocalEnvironment
from wmo_trio.sandbox import _cgroup
from wmo_trio.sandbox._cgroup import HostCgroups

__all__ = ["pytestmark"]

GET = 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:{port}/", timeout=5).read().decode())'
# The agent's leftovers: a loop that keeps rewriting a file the verifier reads, and a
# sleeper; both clear their environment and leave the agent's session. Each rewrite is a
# rename, so the end of the agent phase never finds the file truncated and not yet
# written (a kill between `>` and `date` once left it empty and failed the check that
# the loop ran).
TAMPER = "while :; do date > /app/tamper.new; mv /app/tamper.new /app/tamper; sleep 0.1; done"


class RecordingEnvironment(LocalEnvironment):
    """LocalEnvironment that records, in order, what harbor asks of it and when it ends
    the agent's processes."""

    calls: ClassVar[list[str]] = []

    async def exec(self, command: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(f"exec {command}")
        return await super().exec(command, *args, **kwargs)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        self.calls.append(f"upload_dir {target_dir}")
        await super().upload_dir(source_dir, target_dir)

    async def _end_agent_processes(self) -> None:
        self.calls.append("end agent processes")
        await super()._end_agent_processes()


@pytest.mark.harbor
def test_harbor_reads_the_agents_logs_after_the_agent_and_before_the_verifier(
        tmp_path: Path) -> None:
    """What the environment relies on, against harbor's real Trial: the agent's
    processes are ended once, after the agent's last command and before the verifier
    uploads or runs anything. If a harbor release reorders its trial, this fails."""
    RecordingEnvironment.calls = []
    config = TrialConfig(
        task=TaskConfig(path=TASKS / "hello-file"),
        trials_dir=tmp_path / "trials",
        agent=AgentConfig(name="oracle"),
        environment=EnvironmentConfig(
            import_path=f"{__name__}:RecordingEnvironment",
            kwargs={"state_dir": str(tmp_path / "state")}),
    )

    async def scenario() -> Any:
        trial = await Trial.create(config)
        return await trial.run()

    result = asyncio.run(scenario())

    assert result.exception_info is None, result.exception_info
    calls = RecordingEnvironment.calls
    assert calls.count("end agent processes") == 1, calls
    end = calls.index("end agent processes")
    agent = [i for i, call in enumerate(calls) if "solve.sh" in call]
    verifier = [i for i, call in enumerate(calls)
                if call == "upload_dir /tests" or "test.sh" in call]
    assert agent and verifier, calls
    assert max(agent) < end < min(verifier), (
        "harbor no longer reads the agent's logs between the agent and the verifier: "
        f"LocalEnvironment._end_agent_processes needs another signal. Calls: {calls}")


def _hostile_task(tasks: Path, seconds: int, port: int, *, times_out: bool) -> Path:
    """hello-file, with an ENTRYPOINT that starts a web server the way a daemonizing
    service does (environment cleared, session left), a solution that leaves processes
    behind the same way (then returns, or runs into its timeout), and tests that pass
    only if the server answers and none of the solution's processes runs. Each task has
    its own port, so no other trial's server could answer for a missing one."""
    task = tasks / f"leftovers-{'timed-out' if times_out else 'returned'}"
    shutil.copytree(TASKS / "hello-file", task)
    environment = task / "environment"
    (environment / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY service.sh /service.sh\n"
        "RUN mkdir /srv/www && echo up > /srv/www/index.html\n"
        'ENTRYPOINT ["/bin/sh", "/service.sh"]\n')
    (environment / "service.sh").write_text(
        f"env -i setsid -f python3 -m http.server {port} --bind 127.0.0.1 --directory /srv/www"
        ' > /dev/null 2>&1\nexec "$@"\n')
    (task / "solution" / "solve.sh").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        env -i setsid -f sh -c '{TAMPER}' > /dev/null 2>&1
        env -i setsid -f sleep {seconds} > /dev/null 2>&1
        while [ ! -s /app/tamper ]; do sleep 0.01; done
        printf 'Hello from wmo_trio\\n' > /app/greeting.txt
        """) + (f"sleep {seconds + 1}\n" if times_out else ""))
    if times_out:
        toml = (task / "task.toml").read_text()
        (task / "task.toml").write_text(
            toml.replace("[agent]\ntimeout_sec = 60.0", "[agent]\ntimeout_sec = 10.0"))
    (task / "tests" / "test.sh").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        mkdir -p /logs/verifier
        cd /logs/verifier
        for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done > processes.txt 2>&1
        # Waits well inside the verifier's budget, so that a service that never answers
        # still leaves the checks, and what ran then, for the test to show.
        answer=
        end=$(( $(date +%s) + 30 ))
        while [ "$(date +%s)" -lt "$end" ]; do
            answer=$(python3 -c '{GET.format(port=port)}' 2>/dev/null) && break
            sleep 0.1
        done
        echo "service: $answer" > checks.txt
        for p in /proc/[0-9]*; do echo "$p $(tr '\\0' ' ' < $p/cmdline)"; done > after.txt 2>&1
        cat /proc/net/tcp >> after.txt
        if [ ! -s /app/tamper ]; then
            echo "the agent's loop never ran" >> checks.txt
            echo 0 > reward.txt
        elif grep -q -e 'date > /app/tamper' -e 'sleep {seconds}' processes.txt; then
            echo "the agent's processes still run" >> checks.txt
            echo 0 > reward.txt
        elif [ "$answer" != up ]; then
            echo 0 > reward.txt
        else
            echo 1 > reward.txt
        fi
        """))
    return task


ENDINGS = {"returned": 8123, "timed-out": 8124}  # how the agent phase ends: its task's port


@pytest.fixture(scope="module")
def leftovers_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job, both hostile tasks side by side: the agent that returns and the one
    that runs into its timeout, each with its own sleeper and port."""
    tmp_path = tmp_path_factory.mktemp("leftovers")
    seconds = {ending: unique_seconds() for ending in ENDINGS}
    for ending, port in ENDINGS.items():
        _hostile_task(tmp_path / "tasks", seconds[ending], port,
                      times_out=ending == "timed-out")
    results = run_oracle_job(tmp_path / "jobs", tmp_path / "tasks", concurrency=2,
                             state_dir=str(tmp_path / "state"))
    return {"results": results, "jobs": tmp_path / "jobs", "seconds": seconds}


@pytest.mark.harbor
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_processes_the_agent_detached_are_gone_before_the_verifier_and_services_stay(
        leftovers_job: dict[str, Any], ending: str) -> None:
    jobs = leftovers_job["jobs"]
    [(name, result)] = [(name, result) for name, result in leftovers_job["results"].items()
                        if result["task_name"] == f"leftovers-{ending}"]
    verifier = jobs / "job" / name / "verifier"
    if ending == "timed-out":
        assert result["exception_info"]["exception_type"] == "AgentTimeoutError"
    else:
        assert result["exception_info"] is None, result["exception_info"]
    shown = {log: (verifier / log).read_text() if (verifier / log).exists() else None
             for log in ("checks.txt", "processes.txt", "after.txt")}
    assert reward(result) == 1.0, (result["exception_info"], shown)
    assert sleepers(leftovers_job["seconds"][ending]) == []


def test_without_cgroups_the_entrypoints_session_survives_and_the_agents_detached_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host that gives trials no cgroup, the services are what the ENTRYPOINT's
    session, ancestry and tag claim; a process the agent detached is not among them."""
    monkeypatch.setattr(_cgroup, "host_cgroups", lambda: HostCgroups((), "none here"))
    service, detached = unique_seconds(), unique_seconds()
    environment_dir = tmp_path / "task" / "environment"
    environment_dir.mkdir(parents=True)
    (environment_dir / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY service.sh /service.sh\n"
        'ENTRYPOINT ["/bin/sh", "/service.sh"]\n')
    (environment_dir / "service.sh").write_text(f'sleep {service} &\nexec "$@"\n')

    async def scenario() -> None:
        environment = make_environment(tmp_path, environment_dir)
        async with running(environment):
            assert environment._sandbox is not None and environment._sandbox.cgroup is None
            await environment.exec(f"env -i setsid -f sleep {detached} > /dev/null 2>&1")
            assert len(await until_sleeping(detached, 1)) == 1
            assert len(await until_sleeping(service, 1)) == 1
            await environment.download_dir("/logs/agent", tmp_path / "agent-logs")
            assert sleepers(detached) == []
            assert len(sleepers(service)) == 1
            assert (await environment.exec("echo alive")).stdout == "alive\n"

    run(scenario)
