"""When the agent phase ends, what the agent started runs on, as under Docker: harbor
runs the verifier in the same environment, and tasks whose solution starts a server
rely on it. A command harbor's timeout cancels is still killed with its process tree,
and everything goes when the trial ends. A task that wants its verdict safe from the
agent's processes runs its verifier in an environment of its own (harbor's separate
verifier mode), which the docker-free environment runs too.

Hostile and ordinary tasks run in harbor's own job or trial with the ``oracle`` agent,
whose ``solve.sh`` plays the agent.
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
    pytestmark,
    reward,
    sleepers,
    unique_seconds,
    until_sleeping,
)

from wmo_trio.harbor import LocalEnvironment

__all__ = ["pytestmark"]

GET = 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:{port}/", timeout=5).read().decode())'
SERVE = "python3 -m http.server {port} --bind 127.0.0.1 --directory /srv/www"
# How the solution leaves its server and a sleeper behind: each as a plain background
# job, or daemonized (environment cleared, a session of its own, re-parented by a double
# fork), or daemonized by a solution that then runs into its timeout.
LEAVES = {
    "background": "{command} > /dev/null 2>&1 &",
    "daemonized": "(env -i setsid {command} > /dev/null 2>&1 &)",
    "timed-out": "(env -i setsid {command} > /dev/null 2>&1 &)",
}
SERVICE_PORT, AGENT_PORTS = 8120, {"background": 8121, "daemonized": 8122, "timed-out": 8123}


def _leftovers_task(tasks: Path, way: str, detached: int, in_flight: int) -> Path:
    """hello-file, with an ENTRYPOINT that starts a web server the way a daemonizing
    service does, a solution that leaves its own server and a `sleep <detached>` behind
    (``way``; the timed-out one then runs `sleep <in_flight>` past its timeout), and
    tests that pass only if both servers answer the verifier, the sleeper still runs
    and the command harbor cancelled does not. Each task's server has its own port, so
    no other trial's could answer for a missing one."""
    task = tasks / f"leftovers-{way}"
    shutil.copytree(TASKS / "hello-file", task)
    environment = task / "environment"
    (environment / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY service.sh /service.sh\n"
        "RUN mkdir /srv/www && echo up > /srv/www/index.html\n"
        'ENTRYPOINT ["/bin/sh", "/service.sh"]\n')
    (environment / "service.sh").write_text(
        f"env -i setsid -f {SERVE.format(port=SERVICE_PORT)} > /dev/null 2>&1\n"
        'exec "$@"\n')
    port = AGENT_PORTS[way]
    leave = LEAVES[way]
    (task / "solution" / "solve.sh").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {leave.format(command=SERVE.format(port=port))}
        {leave.format(command=f"sleep {detached}")}
        printf 'Hello from wmo_trio\\n' > /app/greeting.txt
        """) + (f"sleep {in_flight}\n" if way == "timed-out" else ""))
    if way == "timed-out":
        # Its daemons must have started before the timeout: a bound far above what a
        # busy machine needs for two processes (the trial waits it out in full).
        toml = (task / "task.toml").read_text()
        (task / "task.toml").write_text(
            toml.replace("[agent]\ntimeout_sec = 60.0", "[agent]\ntimeout_sec = 30.0"))
    (task / "tests" / "test.sh").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        mkdir -p /logs/verifier
        cd /logs/verifier
        for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done > processes.txt 2>&1
        # Each wait ends well inside the verifier's budget (a start on a busy machine may
        # be slow), so that what never comes still leaves the checks for the test to show.
        until_true() {{
            end=$(( $(date +%s) + 30 ))
            while [ "$(date +%s)" -lt "$end" ]; do
                "$@" && return
                sleep 0.1
            done
            return 1
        }}
        running() {{
            for p in /proc/[0-9]*; do
                [ "$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)" = "$1 " ] && return
            done
            return 1
        }}
        service=$(until_true python3 -c '{GET.format(port=SERVICE_PORT)}' 2>/dev/null)
        agent=$(until_true python3 -c '{GET.format(port=port)}' 2>/dev/null)
        echo "service: $service; agent's server: $agent" > checks.txt
        reward=1
        [ "$service" = up ] && [ "$agent" = up ] || reward=0
        if ! until_true running 'sleep {detached}'; then
            echo "the sleeper the agent left is gone" >> checks.txt
            reward=0
        fi
        if running 'sleep {in_flight}'; then
            echo "the command harbor cancelled still runs" >> checks.txt
            reward=0
        fi
        echo $reward > reward.txt
        """))
    return task


@pytest.fixture(scope="module")
def leftovers_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job, a task per way of leaving processes behind, side by side."""
    tmp_path = tmp_path_factory.mktemp("leftovers")
    detached = {way: unique_seconds() for way in LEAVES}
    in_flight = unique_seconds()
    for way in LEAVES:
        _leftovers_task(tmp_path / "tasks", way, detached[way], in_flight)
    results = run_oracle_job(tmp_path / "jobs", tmp_path / "tasks", concurrency=3,
                             state_dir=str(tmp_path / "state"))
    return {"results": results, "jobs": tmp_path / "jobs", "detached": detached,
            "in_flight": in_flight}


@pytest.mark.harbor
@pytest.mark.parametrize("way", sorted(LEAVES))
def test_what_the_agent_started_serves_the_verifier_until_the_trial_ends(
        leftovers_job: dict[str, Any], way: str) -> None:
    jobs = leftovers_job["jobs"]
    [(name, result)] = [(name, result) for name, result in leftovers_job["results"].items()
                        if result["task_name"] == f"leftovers-{way}"]
    verifier = jobs / "job" / name / "verifier"
    if way == "timed-out":
        assert result["exception_info"]["exception_type"] == "AgentTimeoutError"
    else:
        assert result["exception_info"] is None, result["exception_info"]
    shown = {log: (verifier / log).read_text() if (verifier / log).exists() else None
             for log in ("checks.txt", "processes.txt")}
    assert reward(result) == 1.0, (result["exception_info"], shown)
    # The trial's end ends them.
    assert sleepers(leftovers_job["detached"][way]) == []
    assert sleepers(leftovers_job["in_flight"]) == []


class RecordingEnvironment(LocalEnvironment):
    """LocalEnvironment that records how many of the agent's sleepers run once harbor
    reads the agent's logs (the agent is done) and when a separate verifier's
    environment starts."""

    sleeper: ClassVar[int] = 0
    seen: ClassVar[dict[str, int]] = {}

    async def _download(self, source_dir: str, target_dir: Path | str,
                        **options: Any) -> None:
        if source_dir == "/logs/agent":
            self.seen["agent done"] = len(await until_sleeping(self.sleeper, 1))
        await super()._download(source_dir, target_dir, **options)

    async def start(self, force_build: bool) -> None:
        if "__verifier__" in self.session_id:
            self.seen["verifier starts"] = len(sleepers(self.sleeper))
        await super().start(force_build)


@pytest.mark.harbor
def test_a_separate_verifier_environment_runs_with_none_of_the_agents_processes(
        tmp_path: Path) -> None:
    """harbor's separate verifier mode: the agent's environment, with all the agent
    left running, is stopped before a verifier environment built from tests/Dockerfile
    starts; the verifier reads the agent's output as the artifacts harbor carried over."""
    seconds = unique_seconds()
    task = tmp_path / "separate-verifier"
    shutil.copytree(TASKS / "hello-file", task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(
        'artifacts = ["/app/greeting.txt"]\n' + toml.replace(
            "[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n'))
    (task / "solution" / "solve.sh").write_text(
        f"#!/bin/sh\n(env -i setsid sleep {seconds} > /dev/null 2>&1 &)\n"
        "printf 'Hello from wmo_trio\\n' > /app/greeting.txt\n")
    (task / "tests" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nCOPY test.sh /tests/test.sh\n")
    RecordingEnvironment.sleeper, RecordingEnvironment.seen = seconds, {}
    config = TrialConfig(
        task=TaskConfig(path=task), trials_dir=tmp_path / "trials",
        agent=AgentConfig(name="oracle"),
        environment=EnvironmentConfig(import_path=f"{__name__}:RecordingEnvironment",
                                      kwargs={"state_dir": str(tmp_path / "state")}))

    async def scenario() -> Any:
        trial = await Trial.create(config)
        return await trial.run()

    result = asyncio.run(scenario())

    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 1.0}
    assert RecordingEnvironment.seen == {"agent done": 1, "verifier starts": 0}
    assert sleepers(seconds) == []
