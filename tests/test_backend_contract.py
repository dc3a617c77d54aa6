"""One contract over every backend that runs an episode's program: `local` (in this
process), `e2b` (the real e2b SDK against the loopback fake of tests/e2b_fake.py) and
`sandbox` (bubblewrap, where this machine can run it).

A program sends the same requests on each, valid ones and malformed ones, through its kit
or past it (to `kit._channel`, which a program can reach on every backend); every backend
must answer as the others do: the same ending, the same steps, and for a request the host
refuses (`wmo_trio.episode.channel`) an `error` ending with a step that says why, never a
crash. What belongs to one backend (its transport, its frames, its sandbox) is tested
beside it: tests/test_e2b_backend.py, tests/test_sandbox_backend.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from doubles import Spy, make_doc, untimed
from e2b_fake import FakeE2B
from test_code_runtime import AGENT, INSTRUCTION, SOLVE, code_doc

from wmo_trio.backends import BACKENDS, build_runtime, sandbox_problem
from wmo_trio.episode import LocalDirEnvironment, channel
from wmo_trio.episode.channel import MAX_FREE_CALLS
from wmo_trio.episode.runtime import RuntimeBase
from wmo_trio.episode.services import ELIDED
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import RunResult, StopReason

SANDBOX_PROBLEM = sandbox_problem()
SANDBOX = pytest.param("sandbox", marks=[
    pytest.mark.skipif(SANDBOX_PROBLEM is not None, reason=f"no sandbox backend here: {SANDBOX_PROBLEM}"),
    pytest.mark.slow,  # real sandboxes
])
# The backends that run the program as a runner process, where this machine has them.
RUNNERS = ["e2b"] + (["sandbox"] if SANDBOX_PROBLEM is None else [])


@pytest.fixture(params=["local", "e2b", SANDBOX])
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend in turn; for `e2b`, with the fake E2B service running."""
    if request.param == "e2b":
        request.getfixturevalue("e2b")
    name: str = request.param
    return name


def run_on(backend: str, doc: HarnessDoc, provider: Any, workdir: Path, *,
           should_cancel: Callable[[], bool] | None = None,
           backend_settings: dict[str, Any] | None = None, **settings: Any) -> RunResult:
    """The episode of `doc` on `backend`; `settings` are the episode's (`EpisodeSettings`)."""
    with build_runtime(doc, provider, settings, backend=backend, backend_settings=backend_settings,
                       should_cancel=should_cancel) as runtime:
        return runtime.run("task", INSTRUCTION, LocalDirEnvironment(workdir, command_timeout_sec=30))


def call(tool: str, **arguments: str) -> dict[str, Any]:
    return {"name": tool, "arguments": arguments}


def reply(*calls: dict[str, Any], text: str = "") -> dict[str, Any]:
    return {"text": text, "tool_calls": list(calls)}


# =======================================================================================
# Requests every backend answers alike
# =======================================================================================


def test_a_program_solves_the_task_through_its_kit(backend: str, tmp_path: Path) -> None:
    result = run_on(backend, code_doc(AGENT), Spy(SOLVE), tmp_path)
    assert (result.stop_reason, result.answer) == (StopReason.SUBMITTED, "wrote out/greeting.txt")
    assert (tmp_path / "out" / "greeting.txt").read_text() == "hi\n"
    assert [s.action.name for s in result.steps] == ["write_file", "read_file", "submit"]


def test_a_runtime_is_closed_when_its_with_block_ends(backend: str, tmp_path: Path) -> None:
    with build_runtime(code_doc(AGENT), Spy(SOLVE), backend=backend) as runtime:
        result = runtime.run("task", INSTRUCTION, LocalDirEnvironment(tmp_path, command_timeout_sec=30))
        assert isinstance(runtime, RuntimeBase) and not runtime.control.interrupted
    assert result.stop_reason is StopReason.SUBMITTED
    assert runtime.control.interrupted  # close() interrupts whatever call is left
    with pytest.raises(RuntimeError, match="runs a single episode"):
        runtime.run("task", INSTRUCTION, LocalDirEnvironment(tmp_path, command_timeout_sec=30))


def test_a_backend_named_builds_the_runtime_it_declares(backend: str) -> None:
    declared = BACKENDS[backend]
    with build_runtime(code_doc(AGENT), Spy(SOLVE), backend=backend) as runtime:
        assert type(runtime) is declared.runtime_class()
    assert declared.name == backend


def test_closing_a_runtime_while_it_runs_ends_the_episode_as_cancelled(backend: str,
                                                                       tmp_path: Path) -> None:
    # close() interrupts the control, the one stop signal, on every backend alike.
    provider = Spy([{"text": "slow", "latency_s": 60}, {"text": "unused"}])
    started = time.monotonic()
    with build_runtime(make_doc(), provider, backend=backend) as runtime:
        closer = threading.Thread(target=lambda: provider.calling.wait() and runtime.close())
        closer.start()
        result = runtime.run("task", INSTRUCTION, LocalDirEnvironment(tmp_path, command_timeout_sec=30))
        closer.join()  # its kill of a remote sandbox may outlast the run
    assert result.stop_reason is StopReason.CANCELLED
    assert len(provider.requests) == 1 and time.monotonic() - started < 50


def test_a_program_that_raises_ends_with_error_and_its_traceback(backend: str, tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.execute("bash", {"command": "echo before"})
        return {}["missing"]
    """
    result = run_on(backend, code_doc(source), Spy([{"text": "x"}]), tmp_path)
    assert result.stop_reason is StopReason.ERROR
    assert [s.observation.content for s in result.steps] == [
        "before\n", "code:runtime raised KeyError: 'missing'"]
    assert 'return {}["missing"]' in result.steps[-1].observation.metadata["traceback"]


def test_the_host_counts_the_budgets_even_when_the_kit_is_bypassed(backend: str, tmp_path: Path) -> None:
    # The program is in the runner's interpreter: it can reach the channel behind the kit.
    source = """
    def run(kit):
        for n in range(3):
            kit._channel.execute("bash", {"command": f"touch file-{n}"}, None, None)
        return "escaped"
    """
    result = run_on(backend, code_doc(source, max_env_actions=2), Spy([{"text": "x"}]), tmp_path)
    assert result.stop_reason is StopReason.BUDGET
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file-0", "file-1"]


LOOP_CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], StopReason]] = {
    "nudged, then submitted": ({}, [{"text": "hmm"}, reply(call("bash", command="echo hi")),
                                    reply(call("submit", answer="done"), text="all done")],
                               StopReason.SUBMITTED),
    "no tool call": ({}, [{"text": "thinking"}] * 3, StopReason.NO_TOOL_CALL),
    "unparsed": ({}, [reply({"name": "bash", "arguments": "{not json"})] * 3,
                 StopReason.UNPARSED_TOOL_CALL),
    "truncated": ({}, [{"text": "cut off", "finish_reason": "length"}] * 3,
                  StopReason.OUTPUT_TRUNCATED),
    "max turns": ({"max_turns": 2}, [reply(call("bash", command="echo 1")), {"text": "more?"}],
                  StopReason.MAX_TURNS),
    "several calls in one reply": (
        {}, [reply(call("bash", command="echo a"), {"name": "bash", "arguments": "oops"},
                   call("dance"), call("write_file", path="x")),
             reply(call("submit", answer="ok"))], StopReason.SUBMITTED),
    "environment budget": ({"max_env_actions": 1},
                           [reply(call("bash", command="echo 1")), reply(call("bash", command="echo 2")),
                            reply(call("submit", answer="ok"))], StopReason.SUBMITTED),
    "context window": ({}, [reply(call("bash", command="head -c 1500 /dev/zero | tr '\\0' x"))] * 3
                       + [reply(call("submit", answer="ok"))], StopReason.SUBMITTED),
    "provider error": ({}, [reply(call("bash", command="echo 1")),
                            {"error": {"kind": "bad_request", "message": "no"}}],
                       StopReason.PROVIDER_ERROR),
    "skills": ({"skill": "Take notes."}, [reply(call("read_skill", name="notes")),
                                         reply(call("read_skill", name="nope")),
                                         reply(call("submit", answer="ok"))], StopReason.SUBMITTED),
}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_the_built_in_loop_runs_alike_on_every_backend(e2b: FakeE2B, tmp_path: Path,
                                                       case: str) -> None:
    params, script, expected = LOOP_CASES[case]
    doc = make_doc(**params)
    window = 1024 if case == "context window" else None
    results, requests = {}, {}
    for backend in ("local", *RUNNERS):
        spy = Spy(script)
        (tmp_path / backend).mkdir()
        results[backend] = run_on(backend, doc, spy, tmp_path / backend, context_window=window)
        requests[backend] = [request.model_dump() for request in spy.requests]
    assert results["local"].stop_reason is expected, results["local"].steps
    if window is not None:  # the case is meant to make the loop elide old tool outputs
        assert ELIDED in json.dumps(requests["local"])
    for backend in RUNNERS:
        result, local = results[backend], results["local"]
        assert result.model_copy(update={"steps": untimed(result.steps)}) == local.model_copy(
            update={"steps": untimed(local.steps)}), backend
        assert requests[backend] == requests["local"], backend


# =======================================================================================
# Requests the host refuses, alike on every backend
# =======================================================================================

# Each is sent past the kit, which would not send it; the program then catches whatever
# the refusal raised and tries to go on, which it must not be able to.
REFUSED = {
    "a tool step": (
        'kit._channel.step({"kind": "tool_call", "name": "bash"}, {"content": "faked"})',
        "a step may only carry a message step"),
    "a model request of the wrong shape": (
        'kit._channel.complete({"system": 1, "messages": [], "tools": [], '
        '"max_output_tokens": 5, "temperature": None})',
        "invalid model request: system: Input should be a valid string"),
    "a tool name that is not text": (
        'kit._channel.execute(7, {}, None, None)',
        "field 'tool' must be str, got int"),
    "tool arguments nested past the bound": (
        'deep = {}\n            for _ in range(300):\n                deep = {"a": deep}\n'
        '            kit._channel.execute("bash", {"command": "true", "deep": deep}, None, None)',
        "a request's values nest deeper than 64 levels"),
    "a flood of message steps": (
        'for _ in range(1_000_000):\n    '
        '            kit._channel.step({"kind": "message", "content": "spam"}, {"content": "spam"})',
        "more message steps than it made model calls"),
    "a flood of free tool calls": (
        'while True:\n                kit.execute("no-such-tool", {})',
        "over {free_calls} requests that call neither the model nor the environment"),
}
# The free-call ceiling belongs to the host's channel, the one object every backend answers
# through: the local case meets it as it is; a runner's flood meets a lower one, since each
# of its calls is a round trip (on e2b's fake an HTTP request to the fake and a streamed
# reply, about 2 ms of CPU: seconds for the real ceiling).
RUNNER_FREE_CALLS = 64


@pytest.mark.parametrize("case", [
    # A few thousand calls in-process, a hundred round trips on a runner.
    pytest.param(case, marks=pytest.mark.slow) if "flood" in case else case for case in REFUSED])
def test_a_refused_request_ends_the_episode_with_error_and_says_why(
    backend: str, tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    free_calls = MAX_FREE_CALLS if backend == "local" else RUNNER_FREE_CALLS
    monkeypatch.setattr(channel, "MAX_FREE_CALLS", free_calls)
    request, message = REFUSED[case][0], REFUSED[case][1].format(free_calls=free_calls)
    source = f"""
    def run(kit):
        try:
            {request}
        except BaseException:
            pass
        kit.execute("bash", {{"command": "touch went-on"}})
        kit.execute("submit", {{"answer": "went on"}})
    """
    result = run_on(backend, code_doc(source), Spy([{"text": "x"}]), tmp_path, episode_timeout_sec=120)
    assert result.stop_reason is StopReason.ERROR, result.steps[-3:]
    last = result.steps[-1].observation
    assert last.is_error
    assert last.content.startswith("the episode's program broke the channel protocol: ")
    assert message in last.content
    assert not (tmp_path / "went-on").exists()
    assert len(result.steps) <= free_calls + 2  # the refused calls, and why


# =======================================================================================
# In this process only
# =======================================================================================


def test_a_backends_settings_are_checked_by_its_own_model_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"^harness_backend='local' takes no settings$"):
        build_runtime(make_doc(), Spy(SOLVE), backend="local", backend_settings={"cpus": 2})
    with pytest.raises(ValueError, match=r"^harness_backend='sandbox': unknown setting cpu "):
        build_runtime(make_doc(), Spy(SOLVE), backend="sandbox", backend_settings={"cpu": 2})
    with pytest.raises(ValueError, match=r"^harness_backend must be one of 'local', 'e2b', 'sandbox'"):
        build_runtime(make_doc(), Spy(SOLVE), backend="docker")


def test_in_process_a_request_whose_values_are_not_json_is_refused(tmp_path: Path) -> None:
    # A runner's requests are JSON by construction; in-process a program can send anything.
    source = """
    def run(kit):
        kit._channel.execute("bash", {"command": {1, 2}}, None, None)
    """
    result = run_on("local", code_doc(source), Spy([{"text": "x"}]), tmp_path)
    assert result.stop_reason is StopReason.ERROR
    assert "a request's values must be JSON" in result.steps[-1].observation.content
