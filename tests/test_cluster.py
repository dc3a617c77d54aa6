"""One harbor job over several worker processes and machines, and the research API's
fan-out, on a real Ray (`wmo_trio.cluster`).

One two-node Ray cluster on this machine serves the module (`ray.cluster_utils.Cluster`:
a head and a second node, one core each, under a temporary directory of this module's
own, never Ray's shared /tmp/ray), and is checked at the end to have left no process
behind. The jobs are harbor's real `Job` with the wmo_trio agent on the docker-free
environment; the model, where a test must act while calls are in flight (a worker killed,
a Ctrl-C), is the real Anthropic SDK against the benchmark's loopback Messages API server,
told to hold its replies until the test has acted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from processes import alive, command_lines_of, descendants, wait_until_gone

pytestmark = [pytest.mark.slow, pytest.mark.harbor]

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "tasks"
LOCAL_ENVIRONMENT = "wmo_trio.harbor:LocalEnvironment"
KEY_ENV = "WMO_TEST_CLUSTER_ANTHROPIC_KEY"
TIMEOUT_S = 240  # a hang, not a slow machine


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine (one core each) for the module; at the end, every
    process they started is gone."""
    from ray.cluster_utils import Cluster

    scratch = Path(tempfile.mkdtemp(prefix="wmo-ray-t", dir="/tmp"))  # socket paths: short
    with pytest.MonkeyPatch.context() as patch:
        # Ray's default directory, and the address file Cluster writes there, are ours.
        patch.setenv("RAY_TMPDIR", str(scratch))
        # What the workers' agents need, in the environment the nodes hand their workers.
        patch.setenv(KEY_ENV, "test-key")
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        # This process's other children (earlier test files' servers) are not the cluster's.
        before = set(descendants(os.getpid()))
        # What an embedded cluster starts (wmo_trio.cluster._session): no log monitor, no
        # autoscaler monitor, two Python processes fewer to start.
        cluster = Cluster(initialize_head=True, shutdown_at_exit=False,
                          head_node_args={"num_cpus": 1, "include_dashboard": False,
                                          "include_log_monitor": False, "no_monitor": True})
        try:
            cluster.add_node(num_cpus=1)
            yield cluster
        finally:
            started = set(descendants(os.getpid())) - before
            cluster.shutdown()
    left = wait_until_gone(started, 30)
    shutil.rmtree(scratch, ignore_errors=True)
    assert left == set(), f"the test cluster left processes behind: {command_lines_of(left)}"


def job_config(jobs_dir: Path, name: str, path: Path, *, attempts: int, concurrency: int,
               provider: dict[str, Any] | None = None) -> Any:
    """The job `wmo-trio run` builds for these options (docker-free environment; the
    scripted offline model, or the Anthropic SDK against `provider`'s server)."""
    from wmo_trio.cli._run import RunOptions, build_job_config

    model = "anthropic/claude-bench" if provider else "scripted/offline"
    return build_job_config(RunOptions(
        paths=[path], concurrency=concurrency, attempts=attempts, jobs_dir=jobs_dir, job_name=name,
        environment=LOCAL_ENVIRONMENT, model=model, provider_settings=provider or {}))


def run_job(config: Any, niceness: dict[int, int] | None = None,
            **where: Any) -> tuple[Any, list[Any]]:
    """`wmo_trio.harbor.run_job` in this process (trio owning it); the `JobResult` and the
    trial events the workers saw (and into `niceness`, each worker process's)."""
    niceness = {} if niceness is None else niceness
    from wmo_trio.harbor import run_job as run
    from wmo_trio.harbor._job import harbor_progress_hidden

    events: list[Any] = []

    async def seen(event: Any) -> None:
        events.append(event)
        with contextlib.suppress(OSError):  # a worker of another machine, or gone
            niceness.setdefault(event.worker.pid, os.getpriority(os.PRIO_PROCESS, event.worker.pid))

    async def main() -> Any:
        with harbor_progress_hidden(), trio.fail_after(TIMEOUT_S), warnings.catch_warnings():
            # harbor's notice of an API it will change, once a trial; its CLI does not show it
            warnings.filterwarnings("ignore", "Task.checksum", DeprecationWarning)
            return await run(config, on_event=seen, **where)

    return trio.run(main), events


def outcomes(job_dir: Path) -> collections.Counter[tuple[str, Any, Any, Any]]:
    """(task, reward, exception, stop reason) of every trial of a job, counted."""
    found: collections.Counter[tuple[str, Any, Any, Any]] = collections.Counter()
    for result_file in job_dir.glob("*/result.json"):
        result = json.loads(result_file.read_text())
        trace = json.loads((result_file.parent / "agent" / "wmo-run.json").read_text())
        rewards = (result.get("verifier_result") or {}).get("rewards") or {}
        found[(result["task_name"], rewards.get("reward"),
               (result.get("exception_info") or {}).get("exception_type"), trace["stop_reason"])] += 1
    return found


def test_a_job_on_two_workers_gives_the_same_trials_and_rewards_as_in_one_process(tmp_path: Path) -> None:
    from wmo_trio.cli._trace import find

    alone, _ = run_job(job_config(tmp_path, "alone", TASKS, attempts=8, concurrency=8))
    config = job_config(tmp_path, "workers", TASKS, attempts=8, concurrency=8)
    niceness: dict[int, int] = {}
    shared, events = run_job(config, niceness, workers=2)
    assert outcomes(tmp_path / "workers") == outcomes(tmp_path / "alone")
    # an embedded cluster's workers do this process's work at its priority (Ray's default
    # nices them to 15)
    assert set(niceness.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, niceness
    assert sum(outcomes(tmp_path / "workers").values()) == 24
    assert {event.worker.index for event in events} == {0, 1}  # both workers ran trials
    # harbor's own records: its stats, and a resume that finds every trial done
    for figure in ("n_trials", "metrics", "pass_at_k"):
        assert [getattr(s, figure) for s in shared.stats.evals.values()] == [
            getattr(s, figure) for s in alone.stats.evals.values()], figure
    trials = sorted(path.name for path in (tmp_path / "workers").iterdir() if path.is_dir())
    resumed, _ = run_job(config)
    assert sorted(path.name for path in (tmp_path / "workers").iterdir() if path.is_dir()) == trials
    assert sorted(result.trial_name for result in resumed.trial_results) == trials
    # wmo-trio trace reads every trial's trace and reward
    problems: list[str] = []
    assert len(find(tmp_path / "workers", problems)) == 24 and problems == []


def test_a_job_on_a_two_node_cluster_runs_on_both_nodes_and_brings_every_trial_back(
        ray_cluster: Any, tmp_path: Path) -> None:
    config = job_config(tmp_path, "nodes", TASKS / "hello-file", attempts=4, concurrency=4)
    _, events = run_job(config, ray_address=ray_cluster.address)
    nodes = {node.node_id for node in ray_cluster.list_all_nodes()}
    assert {event.worker.node_id for event in events} == nodes and len(nodes) == 2
    trials = [path for path in (tmp_path / "nodes").iterdir() if path.is_dir()]
    assert len(trials) == 4
    for trial in trials:
        for record in ("config.json", "result.json", "lock.json", "agent/wmo-run.json",
                       "agent/trajectory.json", "verifier/reward.txt"):
            assert (trial / record).is_file(), (trial.name, record)
        result = json.loads((trial / "result.json").read_text())
        assert result["verifier_result"]["rewards"] == {"reward": 1.0}
        assert result["trial_uri"] == trial.resolve().as_uri()  # the driver's, not a worker's
        assert result["config"]["task"]["path"] == str(TASKS / "hello-file")


def test_a_fleet_runs_explicit_trials_in_order_into_one_job_directory(
        ray_cluster: Any, tmp_path: Path) -> None:
    """The reusable piece beneath `--workers`, as a race runs its rounds: harbor
    `TrialConfig`s of two candidates' agent configurations, results in their order."""
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig

    from wmo_trio.cluster import ClusterOptions, open_trial_fleet

    def agent(harness: str) -> AgentConfig:
        return AgentConfig(import_path="wmo_trio.harbor:WmoTrioHarborAgent", model_name="scripted/offline",
                           skip_model_parsing=True, kwargs={
                               "harness": str(ROOT / "examples" / harness),
                               "provider_config": {"kind": "scripted", "model": "offline"}})

    environment = EnvironmentConfig(import_path=LOCAL_ENVIRONMENT)
    candidates = [agent("harness.json"), agent("harness-terse.json")]
    configs = [TrialConfig(task=TaskConfig(path=TASKS / "hello-file"), trials_dir=tmp_path / "race",
                           agent=candidate, environment=environment) for candidate in candidates]
    ends: list[str] = []

    async def watch(event: Any) -> None:
        if event.event.value == "end":
            ends.append(event.trial_name)

    async def main() -> list[Any]:
        with trio.fail_after(TIMEOUT_S):
            async with open_trial_fleet(ClusterOptions(ray_address=ray_cluster.address), concurrency=2,
                                        agents=candidates, environment=environment) as fleet:
                results: list[Any] = await fleet.run_trials(configs, concurrency=2, watch=watch)
                return results

    results = trio.run(main)
    assert [result.trial_name for result in results] == [config.trial_name for config in configs]
    assert sorted(ends) == sorted(config.trial_name for config in configs)
    for config, result in zip(configs, results, strict=True):
        assert result.verifier_result.rewards == {"reward": 1.0}
        written = json.loads((tmp_path / "race" / config.trial_name / "result.json").read_text())
        assert written["config"]["agent"]["kwargs"]["harness"] == config.agent.kwargs["harness"]


def test_a_worker_that_cannot_load_the_environment_is_one_line_before_any_trial(
        ray_cluster: Any, tmp_path: Path) -> None:
    from harbor.models.trial.config import EnvironmentConfig

    from wmo_trio.cluster import ClusterError

    config = job_config(tmp_path, "unloadable", TASKS / "hello-file", attempts=1, concurrency=1)
    config.environment = EnvironmentConfig(import_path="wmo_trio_no_such_module:Environment")
    with pytest.raises(ClusterError, match=r"cannot load what the work needs: .*no_such_module") as refused:
        run_job(config, ray_address=ray_cluster.address)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "unloadable").exists()  # no job, no trial


def test_a_worker_killed_mid_job_loses_no_trial(ray_cluster: Any, tmp_path: Path) -> None:
    from benchmarks.messages_server import serve

    with serve(delay_s=0, tool_calls=1) as server:
        server.hold()
        config = job_config(tmp_path, "killed", TASKS / "hello-file", attempts=2, concurrency=2,
                            provider={"base_url": server.base_url, "api_key_env": KEY_ENV})
        events: list[Any] = []
        killed: list[int] = []

        async def kill_a_busy_worker() -> None:
            # Both trials are in a model call: kill the worker of one of them.
            while not (server.stats()["held"] >= 2 and any(  # noqa: ASYNC110 - another process's state
                    e.hook.event.value == "agent-start" for e in events)):
                await trio.sleep(0.2)
            [pid, *_] = [e.worker.pid for e in events if e.hook.event.value == "agent-start"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            server.hold(False)

        async def main() -> Any:
            from wmo_trio.harbor import run_job as run
            from wmo_trio.harbor._job import harbor_progress_hidden

            async def seen(event: Any) -> None:
                events.append(event)

            with harbor_progress_hidden(), trio.fail_after(TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(kill_a_busy_worker)
                    return await run(config, ray_address=ray_cluster.address, on_event=seen)

        result = trio.run(main)
    assert len(killed) == 1 and alive(set(killed)) == set()
    results = [json.loads(path.read_text()) for path in (tmp_path / "killed").glob("*/result.json")]
    assert len(results) == 2 and all(r["finished_at"] for r in results)  # each counted once
    assert [s.n_trials for s in result.stats.evals.values()] == [2]
    assert all((r.get("exception_info") or {}).get("exception_type") is None for r in results)
    rerun = [e for e in events if e.hook.event.value == "end" and e.worker.pid != killed[0]]
    assert len(rerun) == 2  # both ended on a live worker, the killed one's trial run again
    starts = collections.Counter(e.hook.trial_name for e in events if e.hook.event.value == "start")
    assert sorted(starts.values()) in ([1, 2], [1, 1])  # the first start may not have been seen


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path: Path) -> None:
    from benchmarks.messages_server import serve

    with serve(delay_s=0, tool_calls=4) as server:
        server.hold()
        command = [str(Path(sys.executable).parent / "wmo-trio"), "run", "--workers", "2",
                   "-p", str(TASKS / "hello-file"), "-k", "2", "-n", "2", "-o", str(tmp_path),
                   "--job-name", "stopped", "-e", LOCAL_ENVIRONMENT, "-m", "anthropic/claude-bench",
                   "--provider-config", json.dumps({"base_url": server.base_url, "api_key_env": KEY_ENV})]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, KEY_ENV: "test-key"})
        try:
            async def both_trials_in_a_model_call() -> None:
                while server.stats()["held"] < 2:
                    assert process.poll() is None, process.communicate()[1][-3000:]
                    await trio.sleep(0.2)

            trio.run(_within, TIMEOUT_S, both_trials_in_a_model_call)
            started = set(descendants(process.pid))
            # the command's own Ray session directory, as its processes name it
            scratch = {Path("/tmp") / match for line in command_lines_of(started).values()
                       for match in re.findall(r"/tmp/(wmo-ray-[^/ ]+)/", line)}
            assert len(scratch) == 1, command_lines_of(started)
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("wmo-trio: interrupted"), err[-3000:]
    assert wait_until_gone(started, 30) == set()  # no Ray process, worker or sandbox left
    assert not any(path.exists() for path in scratch)  # its Ray's session removed
    trials = [path for path in (tmp_path / "stopped").iterdir() if path.is_dir()]
    assert len(trials) == 2
    for trial in trials:
        result = json.loads((trial / "result.json").read_text())
        assert result["exception_info"]["exception_type"] == "CancelledError"
        trace = json.loads((trial / "agent" / "wmo-run.json").read_text())
        assert trace["stop_reason"] == "cancelled-by-harbor" and trace["partial"] is True


def held_specs(server: Any, directory: Path, name: str, count: int) -> list[Any]:
    """Research episodes of the Anthropic SDK against `server`, each traced in `directory`."""
    import wmo_trio
    from wmo_trio import DirectoryEnvironment, EpisodeSpec

    doc = wmo_trio.load_harness(ROOT / "examples" / "harness.json")
    provider = {"kind": "anthropic", "model": "claude-bench", "base_url": server.base_url,
                "api_key_env": KEY_ENV}
    return [EpisodeSpec(doc, provider, "run the steps", DirectoryEnvironment(directory),
                        task_id=f"{name}-{i}", trace_path=directory / f"{name}-{i}.json")
            for i in range(count)]


async def _within(seconds: float, afn: Any) -> None:
    with trio.fail_after(seconds):
        await afn()


async def test_the_research_fan_out_runs_on_two_workers_and_refuses_what_cannot_be_sent(
        ray_cluster: Any, tmp_path: Path) -> None:
    import wmo_trio
    from wmo_trio import DirectoryEnvironment, EpisodeSpec, HarborEnvironment

    doc = wmo_trio.load_harness(ROOT / "examples" / "harness.json")
    provider = {"kind": "scripted", "model": "offline"}
    task = "Create the file `{}` whose whole content is the line `hi`"
    async with wmo_trio.open_episode_pool(limit=8, ray_address=ray_cluster.address) as pool:
        assert len({worker.node_id for worker in pool.workers}) == 2
        unsendable = EpisodeSpec(doc, provider, task.format("x.txt"), HarborEnvironment(object()),
                                 task_id="harbor", trace_path=tmp_path / "harbor.json")
        with pytest.raises(ValueError, match="cannot be sent to a worker process"):
            async with pool.fan_out([EpisodeSpec(doc, provider, task.format("y.txt"),
                                                 DirectoryEnvironment(tmp_path)), unsendable]):
                pass
        assert list(tmp_path.iterdir()) == []  # refused before anything ran
        specs = [EpisodeSpec(doc, provider, task.format(f"out-{i}.txt"), DirectoryEnvironment(tmp_path),
                             task_id=f"task-{i}", trace_path=tmp_path / f"trace-{i}.json")
                 for i in range(12)]
        seen: list[str] = []
        async with pool.fan_out(specs) as results:
            async for spec, outcome in results:
                assert outcome.unwrap().stop_reason == "submitted"
                seen.append(spec.task_id)
    assert sorted(seen) == sorted(spec.task_id for spec in specs)  # each once
    for i in range(12):
        assert (tmp_path / f"out-{i}.txt").read_text().strip() == "hi"
        assert json.loads((tmp_path / f"trace-{i}.json").read_text())["stop_reason"] == "submitted"


async def test_cancelling_a_fan_out_on_workers_writes_each_partial_trace_here(
        ray_cluster: Any, tmp_path: Path) -> None:
    import wmo_trio
    from benchmarks.messages_server import serve

    with serve(delay_s=0, tool_calls=4) as server:
        server.hold()
        specs = held_specs(server, tmp_path, "held", 4)
        async with wmo_trio.open_episode_pool(limit=4, ray_address=ray_cluster.address) as pool:
            with trio.move_on_after(TIMEOUT_S) as cap:
                async with pool.fan_out(specs):
                    while server.stats()["held"] < 4:  # noqa: ASYNC110 - another process's state
                        await trio.sleep(0.2)
                    # every episode is in its model call on a worker: leave the block
        assert not cap.cancelled_caught
    for i in range(4):
        trace = json.loads((tmp_path / f"held-{i}.json").read_text())
        assert trace["stop_reason"] == "cancelled-by-caller" and trace["partial"] is True


async def test_a_fan_out_whose_worker_is_killed_runs_its_episodes_again_and_loses_none(
        ray_cluster: Any, tmp_path: Path) -> None:
    import wmo_trio
    from benchmarks.messages_server import serve

    with serve(delay_s=0, tool_calls=1) as server:
        server.hold()
        specs = held_specs(server, tmp_path, "killed", 4)
        reasons: dict[str, str] = {}
        with trio.fail_after(TIMEOUT_S):
            async with wmo_trio.open_episode_pool(limit=4, ray_address=ray_cluster.address) as pool:
                killed = pool.workers[0].pid
                async with pool.fan_out(specs) as results:
                    while server.stats()["held"] < 4:  # noqa: ASYNC110 - another process's state
                        await trio.sleep(0.2)
                    os.kill(killed, signal.SIGKILL)  # two of the four episodes run there
                    server.hold(False)
                    async for spec, outcome in results:
                        reasons[spec.task_id] = outcome.unwrap().stop_reason
    assert alive({killed}) == set()
    assert reasons == {spec.task_id: "submitted" for spec in specs}  # each once, none lost
    for spec in specs:
        assert json.loads(Path(str(spec.trace_path)).read_text())["stop_reason"] == "submitted"
