"""The e2b backend: episodes whose loop runs in an E2B sandbox (`E2BRuntime`), and
`build_runtime` / `check_backend`.

Everything goes through the real `e2b` SDK to the loopback fake in `e2b_fake.py`, whose
sandboxes are real processes (in a private root filesystem when the tests run as root).
Every test ends by checking that no sandbox it created is left alive.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from doubles import Spy, make_doc
from e2b_fake import FakeE2B
from harbor_jobs import run_job_here
from test_backend_contract import call, reply, run_on
from test_code_runtime import AGENT, INSTRUCTION, code_doc, text_call

from wmo_trio.backends import build_runtime, check_backend, sandbox_problem
from wmo_trio.backends.e2b import E2BRuntime, E2BSettings
from wmo_trio.episode import EpisodeRuntime, LocalDirEnvironment
from wmo_trio.harness import load_harness
from wmo_trio.models import ActionKind, RunResult, StopReason
from wmo_trio.providers import build_provider

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "examples" / "harness.json"
HELLO_TASK = REPO / "examples" / "tasks" / "hello-file"
OFFLINE = {"kind": "scripted", "model": "offline"}
GRACE_S = E2BSettings().sandbox_grace_s
# The backends that run the program as a runner process, where this machine has them: each
# must behave as the local backend does.
RUNNERS = ["e2b"] + (["sandbox"] if sandbox_problem() is None else [])


def offline() -> Any:
    return build_provider(OFFLINE)


def the_sandbox(fake: FakeE2B, before: int) -> str:
    (sandbox_id,) = fake.created[before:]
    return sandbox_id


# =======================================================================================
# Episodes on each backend
# =======================================================================================


@pytest.mark.parametrize("backend", ["local", "e2b"])
def test_the_example_task_is_solved_on_each_backend(e2b: FakeE2B, tmp_path: Path, backend: str) -> None:
    created = len(e2b.created)
    started = time.monotonic()
    result = run_on(backend, load_harness(HARNESS), offline(), tmp_path, episode_timeout_sec=30)
    assert result.stop_reason is StopReason.SUBMITTED, result.steps
    assert (tmp_path / "out" / "greeting.txt").read_text() == "hi\n"
    assert [s.action.name for s in result.steps] == ["write_file", "read_file", "submit"]
    if backend == "local":
        assert len(e2b.created) == created
        return
    sandbox_id = the_sandbox(e2b, created)
    sandbox = e2b.sandboxes[sandbox_id]
    assert sandbox.template == "base"
    (runner,) = sandbox.processes.values()
    assert f"/tmp/wmo-trio-{sandbox_id}/portable.py" in runner.command
    assert sandbox_id in e2b.killed
    # Alive for the whole budget, and not much longer if every kill failed.
    assert 30 < sandbox.timeout <= math.ceil(30 + GRACE_S)
    assert time.monotonic() - started < 30  # ended by its submit, not by the 30 s budget


def test_the_program_runs_in_the_sandbox_not_on_the_host(e2b: FakeE2B, tmp_path: Path) -> None:
    marker = f"/tmp/wmo-trio-marker-{uuid.uuid4().hex}"
    source = f"""
    import os, sys
    def run(kit):
        print("a program may print")  # and neither this nor a child's output is a frame
        os.system("echo from a child process")
        open({marker!r}, "w").write("written by the program")
        return os.getcwd() + " " + sys.executable
    """
    created = len(e2b.created)
    result = run_on("e2b", code_doc(source), Spy([{"text": "x"}]), tmp_path)
    sandbox_id = the_sandbox(e2b, created)
    assert result.stop_reason is StopReason.NO_ACTION  # it returned: it did not submit
    cwd, executable = (result.steps[-1].action.content or "").split(" ")
    assert cwd == f"/tmp/wmo-trio-{sandbox_id}"
    assert executable != sys.executable  # the sandbox's python3, not this venv's
    if e2b.isolated:
        assert not Path(marker).exists(), "the program wrote to the host's filesystem"


FORGED_ENDINGS = {
    "an unknown done reason": ({"type": "done", "stop_reason": "victory", "answer": "x"},
                               StopReason.UNKNOWN_DONE_REASON,
                               "the episode's program ended with the reason 'victory'"),
    "a reason only the host gives": ({"type": "done", "stop_reason": "budget", "answer": ""},
                                     StopReason.UNKNOWN_DONE_REASON, "with the reason 'budget'"),
    # Only the host's answer to the submit tool submits: a program cannot claim it.
    "a submit the host never saw": ({"type": "done", "stop_reason": "submitted", "answer": "x"},
                                    StopReason.UNKNOWN_DONE_REASON, "with the reason 'submitted'"),
    "an unknown frame type": ({"type": "teleport"}, StopReason.ERROR, "unknown frame type 'teleport'"),
}


@pytest.mark.parametrize("case", list(FORGED_ENDINGS))
def test_frames_the_runner_may_not_send_end_the_episode(e2b: FakeE2B, tmp_path: Path,
                                                        case: str) -> None:
    frame, expected, message = FORGED_ENDINGS[case]
    source = f"""
    import time
    def run(kit):
        kit._channel.send({frame!r})
        time.sleep(60)
    """
    created = len(e2b.created)
    started = time.monotonic()
    result = run_on("e2b", code_doc(source), Spy([{"text": "x"}]), tmp_path)
    assert result.stop_reason is expected
    assert message in result.steps[-1].observation.content
    assert the_sandbox(e2b, created) in e2b.killed
    assert time.monotonic() - started < 30  # far from the program's 60 s sleep


# =======================================================================================
# Failures of the sandbox side
# =======================================================================================


def test_rate_limited_sandbox_creation_ends_with_error(e2b: FakeE2B, tmp_path: Path) -> None:
    e2b.faults.rate_limited_creations = 1000
    created, requests = len(e2b.created), e2b.creation_requests
    result = run_on("e2b", load_harness(HARNESS), offline(), tmp_path)
    assert result.stop_reason is StopReason.ERROR
    (step,) = result.steps
    assert step.observation.content.startswith(
        "sandbox transport failed: creating a sandbox from template 'base' failed: RateLimitException")
    assert len(e2b.created) == created and e2b.creation_requests > requests


def test_a_runner_dying_mid_episode_ends_with_error_and_is_not_replayed(e2b: FakeE2B,
                                                                        tmp_path: Path) -> None:
    e2b.faults.kill_at_input = 2  # it dies waiting for the answer to its first tool call
    created = len(e2b.created)
    result = run_on("e2b", load_harness(HARNESS), offline(), tmp_path,
                    backend_settings={"transport_retries": 1})
    assert result.stop_reason is StopReason.ERROR
    write, failure = result.steps
    assert write.action.name == "write_file" and (tmp_path / "out" / "greeting.txt").exists()
    assert failure.observation.content.startswith(
        "sandbox transport failed: the runner exited with code -9 before its done frame")
    assert "not replayed: the episode already ran an environment action" in \
        failure.observation.content
    assert failure.observation.metadata == {"attempt": 1, "sandbox_id": e2b.created[created]}
    assert the_sandbox(e2b, created) in e2b.killed


def test_a_line_that_is_not_json_ends_with_error(e2b: FakeE2B, tmp_path: Path) -> None:
    e2b.faults.garbage_at_input = 1
    created = len(e2b.created)
    result = run_on("e2b", load_harness(HARNESS), offline(), tmp_path)
    assert result.stop_reason is StopReason.ERROR
    assert result.steps[-1].observation.content == (
        "sandbox transport failed: the runner sent a line that is not a JSON frame: "
        "'this line is not a JSON frame'")
    assert the_sandbox(e2b, created) in e2b.killed


def test_a_transport_failure_before_any_environment_action_is_replayed(e2b: FakeE2B,
                                                                       tmp_path: Path) -> None:
    e2b.faults.kill_at_input = 1  # dies waiting for its first model reply
    created = len(e2b.created)
    result = run_on("e2b", load_harness(HARNESS), offline(), tmp_path,
                    backend_settings={"transport_retries": 1})
    assert result.stop_reason is StopReason.SUBMITTED
    first, second = e2b.created[created:]
    assert first in e2b.killed and second in e2b.killed
    note, *rest = result.steps
    assert note.action.kind is ActionKind.MESSAGE
    assert "replaying the episode on a fresh sandbox (attempt 2 of 2)" in note.observation.content
    assert [s.action.name for s in rest] == ["write_file", "read_file", "submit"]
    assert result.worker_usage is not None and result.worker_usage.calls == 4  # one spent on the lost runner


def test_without_transport_retries_a_failure_is_final(e2b: FakeE2B, tmp_path: Path) -> None:
    e2b.faults.kill_at_input = 1
    created = len(e2b.created)
    result = run_on("e2b", load_harness(HARNESS), offline(), tmp_path)
    assert result.stop_reason is StopReason.ERROR
    assert len(e2b.created) == created + 1
    assert "not replayed" not in result.steps[-1].observation.content


# =======================================================================================
# Stopping from outside
# =======================================================================================


def start_in_thread(runtime: Any, workdir: Path) -> tuple[threading.Thread, dict[str, RunResult]]:
    out: dict[str, RunResult] = {}

    def target() -> None:
        out["result"] = runtime.run("task", INSTRUCTION, LocalDirEnvironment(workdir, command_timeout_sec=30))

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def test_abort_kills_the_sandbox_at_once(e2b: FakeE2B, tmp_path: Path) -> None:
    spy = Spy([reply(call("bash", command="echo 1")), {"text": "slow", "latency_s": 30}])
    runtime = build_runtime(make_doc(), spy, backend="e2b")
    created = len(e2b.created)
    thread, out = start_in_thread(runtime, tmp_path)
    e2b.wait_for(lambda: len(spy.requests) == 2)  # the runner waits on a slow model call
    sandbox_id = the_sandbox(e2b, created)
    runtime.abort()
    assert sandbox_id in e2b.killed  # killed by abort() itself, not later
    thread.join(5)
    assert not thread.is_alive()
    result = out["result"]
    assert result.stop_reason is StopReason.CANCELLED
    assert [s.action.name for s in result.steps] == ["bash"]
    runtime.close()


def test_abort_during_a_long_program_computation_stops_it(e2b: FakeE2B, tmp_path: Path) -> None:
    # In-process this would run forever; in a sandbox it is killed.
    source = ("def run(kit):\n    kit.complete('s', [{'role': 'user', 'content': 'go'}])\n"
              "    while True:\n        pass\n")
    spy = Spy([{"text": "x"}])
    runtime = build_runtime(code_doc(source), spy, backend="e2b")
    thread, out = start_in_thread(runtime, tmp_path)
    e2b.wait_for(lambda: len(spy.requests) == 1)  # past its model call: computing for ever
    runtime.abort()
    thread.join(5)
    assert out["result"].stop_reason is StopReason.CANCELLED
    assert e2b.created[-1] in e2b.killed


def test_the_wall_clock_budget_ends_the_episode_and_kills_the_sandbox(e2b: FakeE2B,
                                                                     tmp_path: Path) -> None:
    created = len(e2b.created)
    started = time.monotonic()
    result = run_on("e2b", make_doc(), Spy([{"text": "slow", "latency_s": 30}]), tmp_path,
                    episode_timeout_sec=1.5)
    assert time.monotonic() - started < 20  # ended by the budget, not by the 30 s call
    assert result.stop_reason is StopReason.BUDGET
    assert result.steps[-1].observation.content == (
        "episode stopped: its wall-clock budget of 1.5 s ran out")
    assert the_sandbox(e2b, created) in e2b.killed


def test_should_cancel_is_checked_before_each_call(e2b: FakeE2B, tmp_path: Path) -> None:
    spy = Spy([reply(call("bash", command="echo 1")), reply(call("bash", command="touch no"))])
    result = run_on("e2b", make_doc(), spy, tmp_path, should_cancel=lambda: len(spy.requests) >= 2)
    assert result.stop_reason is StopReason.CANCELLED
    assert [s.action.name for s in result.steps] == ["bash"]
    assert not (tmp_path / "no").exists()


def test_close_kills_the_sandbox_and_is_idempotent(e2b: FakeE2B, tmp_path: Path) -> None:
    spy = Spy([{"text": "slow", "latency_s": 30}])
    runtime = build_runtime(make_doc(), spy, backend="e2b")
    thread, out = start_in_thread(runtime, tmp_path)
    e2b.wait_for(lambda: len(spy.requests) == 1)
    runtime.close()
    runtime.close()
    thread.join(5)
    assert out["result"].stop_reason is StopReason.CANCELLED


# =======================================================================================
# Choosing a backend
# =======================================================================================


def test_check_backend_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(ValueError, match="set the E2B_API_KEY environment variable"):
        check_backend("e2b", None)
    check_backend("e2b", None, settings={"api_key": "given"})
    with pytest.raises(ValueError, match="e2b_template is only valid with harness_backend='e2b'"):
        check_backend("local", "base")
    with pytest.raises(ValueError,
                       match="harness_backend must be one of 'local', 'e2b', 'sandbox', got 'docker'"):
        check_backend("docker")
    with pytest.raises(ValueError, match="e2b_template must be a non-empty"):
        check_backend("e2b", " ", settings={"api_key": "given"})
    monkeypatch.setenv("E2B_API_KEY", "key")
    check_backend("e2b", "my-template")
    check_backend("local")


@pytest.mark.parametrize("backend, code, expected", [
    ("local", False, EpisodeRuntime), ("local", True, EpisodeRuntime),
    ("e2b", False, E2BRuntime), ("e2b", True, E2BRuntime),
])
def test_build_runtime_chooses_the_runtime(monkeypatch: pytest.MonkeyPatch, backend: str, code: bool,
                                           expected: type) -> None:
    monkeypatch.setenv("E2B_API_KEY", "key")
    doc = code_doc(AGENT) if code else make_doc()
    runtime = build_runtime(doc, offline(), backend=backend, backend_settings=(
        {"template": "mine", "transport_retries": 2} if backend == "e2b" else None))
    assert type(runtime) is expected
    if isinstance(runtime, E2BRuntime):
        assert (runtime.settings.template, runtime.settings.transport_retries) == ("mine", 2)


# =======================================================================================
# Harbor on the fake: its own E2BEnvironment, and this agent's e2b backend
# =======================================================================================


def harbor_job(fake: FakeE2B, jobs: Path, *, agent_kwargs: dict[str, Any],
               provider_config: dict[str, Any]) -> dict[str, Any]:
    """One trial of the agent on hello-file in harbor's own E2B environment, on the fake
    (whose variables the `e2b` fixture has set): harbor's `Job` in this process, as `harbor
    run -e e2b --skip-model-parsing-and-provider-mapping` runs it (tests/harbor_jobs.py);
    its result, with the agent's trace under "trace"."""
    from harbor.models.job.config import JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    run_job_here(JobConfig(
        job_name="job", jobs_dir=jobs, quiet=True,
        agents=[AgentConfig(
            import_path="wmo_trio.harbor:WmoTrioHarborAgent",
            model_name=f"{provider_config['kind']}/{provider_config['model']}",
            skip_model_parsing=True,  # as the README runs it: no litellm lookup
            kwargs={"harness": str(HARNESS), "provider_config": provider_config, **agent_kwargs})],
        environment=EnvironmentConfig(type="e2b"),
        tasks=[TaskConfig(path=HELLO_TASK)]))
    (result_file,) = jobs.glob("job/*/result.json")
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["trace"] = json.loads((result_file.parent / "agent" / "wmo-run.json").read_text())
    return result


@pytest.mark.harbor
def test_a_harbor_trial_runs_in_harbors_own_e2b_environment(e2b: FakeE2B, tmp_path: Path) -> None:
    if not e2b.isolated:
        pytest.skip("the fake needs root to give a sandbox its own /app and /logs")
    pytest.importorskip("dockerfile_parse", reason="harbor's E2BEnvironment needs harbor[e2b]")
    created = len(e2b.created)
    result = harbor_job(e2b, tmp_path / "jobs", agent_kwargs={}, provider_config=OFFLINE)
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"]["reward"] == 1.0
    assert result["trace"]["stop_reason"] == "submitted"
    (sandbox_id,) = e2b.created[created:]
    commands = [p.command for p in e2b.processes(sandbox_id)]
    assert any("/tests/test.sh" in c for c in commands)  # the verifier ran in the sandbox
    assert sandbox_id in e2b.killed


@pytest.mark.harbor
def test_a_harbor_trial_runs_a_code_runtime_document_in_a_sandbox(e2b: FakeE2B, tmp_path: Path) -> None:
    from wmo_trio.harbor import WmoTrioHarborAgent

    if not e2b.isolated:
        pytest.skip("the fake needs root to give a sandbox its own /app and /logs")
    try:
        WmoTrioHarborAgent(tmp_path / "probe", "scripted/offline", harness=str(HARNESS),
                           provider_config=OFFLINE, harness_backend="e2b")
    except ValueError as error:
        if "not available in this version" in str(error):
            pytest.skip("the harbor agent does not take harness_backend='e2b' yet")
        raise
    document = json.loads(HARNESS.read_text())
    document["surfaces"].append({"id": "code:runtime", "kind": "code", "content": AGENT})
    script = tmp_path / "script.json"
    script.write_text(json.dumps([
        text_call("write_file", path="/app/greeting.txt", content="Hello from wmo_trio\n"),
        text_call("submit", answer="done"),
    ]))
    created = len(e2b.created)
    result = harbor_job(e2b, tmp_path / "jobs",
                        agent_kwargs={"harness": json.dumps(document), "harness_backend": "e2b"},
                        provider_config={"kind": "scripted", "model": "s", "script": str(script)})
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"]["reward"] == 1.0
    assert result["trace"]["stop_reason"] == "submitted"
    sandboxes = e2b.created[created:]
    assert len(sandboxes) == 2 and all(s in e2b.killed for s in sandboxes)  # task + runner
    runners = [p for s in sandboxes for p in e2b.processes(s) if "portable.py" in p.command]
    assert len(runners) == 1


@pytest.mark.parametrize("bad", [{"template": ""}, {"transport_retries": -1},
                                 {"transport_retries": True}, {"sandbox_grace_s": 0},
                                 {"request_timeout_s": float("inf")}, {"tempalte": "x"}])
def test_bad_e2b_settings_are_refused_naming_them(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        E2BSettings.parse(bad)


def test_a_replayed_episode_has_its_whole_turn_limit_again(e2b: FakeE2B, tmp_path: Path) -> None:
    # The example takes three turns; the lost runner had spent one of the three allowed.
    e2b.faults.kill_at_input = 1  # dies waiting for its first model reply
    doc = load_harness(HARNESS).with_surfaces(
        {"id": "param:max-turns", "kind": "param", "content": "3"})
    result = run_on("e2b", doc, offline(), tmp_path, backend_settings={"transport_retries": 1})
    assert result.stop_reason is StopReason.SUBMITTED
    assert [s.action.name for s in result.steps[1:]] == ["write_file", "read_file", "submit"]
