"""Faults, bad input and load: every trial scoreable, every trace kept (CONTRACT 3-5).

Each test drives the real `WmoTrioHarborAgent` (engine, host, runtime, adapter, trace
writer) from a plain `asyncio.run`, awaited the way harbor's trial awaits it
(`asyncio.wait_for(agent.run(...), timeout)`), against the environment and provider
doubles of `harbor_doubles`, and injects one fault. Each then checks that the trial ends
*scoreable* (run returns, or raises harbor's timeout, or the episode's own exception as
itself, never a group) and leaves exactly one parseable `wmo-run.json`, or, where the
fault is the trace write itself, that the contract's error or log line happened instead.

Timings are never asserted tightly (the machine is shared): "promptly" means well under
the time the fault would otherwise have taken (a 30 s model call, a command hanging
forever).

"""

from __future__ import annotations

import asyncio
import errno
import faulthandler
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harbor.environments.base import BaseEnvironment
from harbor_doubles import (
    Do,
    FakeEnvironment,
    TrialOutcome,
    WorkerDefect,
    bash,
    call,
    child_processes,
    instrument_episodes,
    make_agent,
    run_trial,
    submit,
    trace_files,
)

import wmo_trio.trace
from wmo_trio.engine import LoopServingHost
from wmo_trio.episode._tools import MAX_OBSERVATION_CHARS
from wmo_trio.harbor._agent import HarborEpisode
from wmo_trio.models import StopReason
from wmo_trio.trace import CANCELLED_BY_HARBOR_TIMEOUT, TRACE_FILENAME, FinishedTrace, PartialTrace, Trace

ROOT = Path(__file__).resolve().parent.parent
# Far longer than any fault here takes to be handled; only a hang gets near it.
HANG_GUARD_S = 120
# "Promptly": what a cancelled trial may take on a loaded 2-core machine, against the
# 30 s or forever the fault would have taken.
PROMPT_S = 8.0
INSTRUCTION = "Solve the task."


# -- fixtures and helpers -------------------------------------------------------------------


def drive[T](main: Callable[[], Awaitable[T]]) -> T:
    """`asyncio.run(main())`, harbor's shape; a hang dumps every stack and ends the run
    instead of blocking the suite forever."""
    faulthandler.dump_traceback_later(HANG_GUARD_S, exit=True)
    try:
        return asyncio.run(main())  # type: ignore[arg-type]
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After every test: the loop's trio run ended with it and no child process is left."""
    children = set(child_processes())
    yield
    assert not LoopServingHost._hosts, "a trio host outlived its asyncio loop"
    deadline = time.monotonic() + 5
    while "wmo-trio-engine" in {t.name for t in threading.enumerate()} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "wmo-trio-engine" not in {t.name for t in threading.enumerate()}
    assert set(child_processes()) <= children


class TraceWrites:
    """Every attempt to write a `wmo-run.json`, by logs dir (wraps `write_atomically`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts: list[Path] = []
        self.original = wmo_trio.trace.write_atomically
        self.failure: OSError | None = None
        monkeypatch.setattr(wmo_trio.trace, "write_atomically", self._write)

    def _write(self, path: Path, text: str) -> None:
        if path.name == TRACE_FILENAME:
            self.attempts.append(path.parent)
        if self.failure is not None:
            raise self.failure
        self.original(path, text)

    def to(self, logs_dir: Path) -> int:
        return sum(1 for p in self.attempts if p == logs_dir)


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> TraceWrites:
    return TraceWrites(monkeypatch)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Any:
    return instrument_episodes(monkeypatch.setattr)


def one_trace(logs_dir: Path, writes: TraceWrites, outcome: TrialOutcome) -> Trace:
    """The trial is scoreable and left exactly one parseable trace, written once."""
    assert outcome.scoreable, f"unscoreable ending: {outcome.ending} {outcome.error!r}"
    trace = trace_files(logs_dir)
    assert writes.to(logs_dir) == 1, f"{writes.to(logs_dir)} trace writes to {logs_dir}"
    return trace


def single(agent_logs: Path, script: list[dict[str, Any]], environment: Any, *,
           timeout_sec: float | None = 30, instruction: str = INSTRUCTION,
           **agent_options: Any) -> TrialOutcome:
    """One trial of a fresh agent on a fresh loop."""
    agent = make_agent(agent_logs, script, **agent_options)
    return drive(lambda: run_trial(agent, instruction, environment, timeout_sec))


def env_steps(trace: Trace) -> list[Any]:
    return [s for s in trace.steps if s.action.name in ("bash", "read_file", "write_file")]


async def _timing_out_when(started: threading.Event, agent: Any, environment: Any,
                           cancels: int = 1, gap_s: float = 0.2) -> tuple[TrialOutcome, float]:
    """Harbor's timeout (`asyncio.timeout`, what `wait_for` uses), fired the moment
    `started` is set; then `cancels - 1` more cancellations of the trial's task, `gap_s`
    apart. Returns the outcome and when the timeout fired."""
    from harbor.models.agent.context import AgentContext

    loop = asyncio.get_running_loop()
    context = AgentContext()
    began = time.monotonic()
    fired = 0.0

    async def trial() -> None:
        async with asyncio.timeout(None) as timeout:
            async def fire() -> None:
                nonlocal fired
                while not started.is_set():  # noqa: ASYNC110  (a threading.Event, set by a worker)
                    await asyncio.sleep(0.002)
                fired = time.monotonic()
                timeout.reschedule(loop.time())
                for _ in range(cancels - 1):
                    await asyncio.sleep(gap_s)
                    task.cancel()

            firing = asyncio.create_task(fire())
            try:
                await agent.run(instruction=INSTRUCTION, environment=environment, context=context)
            finally:
                firing.cancel()

    task = asyncio.create_task(trial())
    ending, error = "returned", None
    try:
        await task
    except TimeoutError as raised:
        ending, error = "timeout", raised
    except asyncio.CancelledError as raised:
        ending, error = "cancelled", raised
    except BaseException as raised:
        ending, error = "raised", raised
    return TrialOutcome(ending, error, began, time.monotonic(), context), fired


def announcing(command: str, behaviour: Do) -> tuple[FakeEnvironment, threading.Event]:
    """An environment in which `command` does `behaviour`, and an event set as it starts
    (harbor's timeout fired on it lands while the command is in flight)."""
    started = threading.Event()

    def responder(text: str) -> Do | None:
        if text != command:
            return None
        started.set()
        return behaviour

    return FakeEnvironment(responder=responder), started


# -- the double is harbor's interface ------------------------------------------------------------


def test_the_environment_double_has_harbors_exec_and_upload_signatures() -> None:
    import inspect

    for name in ("exec", "upload_file"):
        real = list(inspect.signature(getattr(BaseEnvironment, name)).parameters)
        double = list(inspect.signature(getattr(FakeEnvironment, name)).parameters)
        assert double == real, (name, double, real)


# =======================================================================================
# The environment fails
# =======================================================================================


@pytest.mark.parametrize("error", [
    ConnectionResetError(104, "Connection reset by peer"),
    TimeoutError("the exec request timed out"),  # asyncio.TimeoutError is TimeoutError since 3.11
    RuntimeError("Command timed out after 240 seconds"),  # what harbor's docker exec raises
    BrokenPipeError(32, "Broken pipe"),
    asyncio.CancelledError(),  # a transport's own task cancelled, not the trial
], ids=["connection-reset", "timeout", "harbor-runtime-error", "broken-pipe",
        "stray-cancelled-error"])
def test_an_exec_that_raises_is_an_error_observation_and_the_episode_goes_on(
    tmp_path: Path, writes: TraceWrites, error: BaseException,
) -> None:
    environment = FakeEnvironment({"fails": Do(error=error)})
    outcome = single(tmp_path, [bash("fails"), bash("echo after"), submit("ok")], environment)
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    failed, after = env_steps(trace)
    assert failed.observation.is_error
    assert failed.observation.content.startswith("environment command failed: ")
    if not isinstance(error, asyncio.CancelledError):
        assert failed.observation.content.startswith(
            f"environment command failed: {type(error).__name__}: {error}")
    assert after.observation.content == "ok\n"
    assert outcome.context.metadata is not None
    assert outcome.context.metadata["stop_reason"] == "submitted"


@pytest.mark.parametrize("cancel_cleanup_s", [0.0, 0.5], ids=["prompt-cancel", "slow-cancel"])
def test_a_hanging_exec_is_cancelled_and_the_trial_returns_promptly_on_harbors_timeout(
    tmp_path: Path, writes: TraceWrites, counts: Any, cancel_cleanup_s: float,
) -> None:
    environment, hanging = announcing("hang", Do(hang=True, cancel_cleanup_s=cancel_cleanup_s))
    agent = make_agent(tmp_path, [bash("echo first"), bash("hang"), submit()])
    outcome, fired = drive(lambda: _timing_out_when(hanging, agent, environment))
    assert outcome.ending == "timeout"
    assert outcome.returned_at - fired < cancel_cleanup_s + PROMPT_S
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace) and trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
    [first, hung] = environment.calls
    assert first.ending == "returned"
    assert hung.ending == "cancelled"  # its own cleanup ran to the end, cancelled once
    # the hanging coroutine finished its own cancellation before run() gave the trial back
    assert hung.ended is not None and hung.ended <= outcome.returned_at
    assert [s.action.arguments for s in trace.steps] == [{"command": "echo first"}, {"command": "hang"}]
    assert trace.steps[1].observation.is_error
    # no model call after harbor cancelled: the two that chose the commands
    assert trace.worker_usage is not None and trace.worker_usage.calls == 2
    assert counts.of(trace.task_id) == {"run": 1, "stop": 1, "close": 1, "record": 1}
    assert outcome.context.metadata is not None
    assert outcome.context.metadata["stop_reason"] == CANCELLED_BY_HARBOR_TIMEOUT


def test_a_cancelled_command_is_cancelled_once_and_its_cleanup_runs_to_the_end(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    environment, hanging = announcing("hang", Do(hang=True, cancel_cleanup_s=1.0))
    agent = make_agent(tmp_path, [bash("hang"), submit()])
    outcome, _ = drive(lambda: _timing_out_when(hanging, agent, environment))
    assert outcome.ending == "timeout"
    one_trace(tmp_path, writes, outcome)
    [hung] = environment.calls
    assert (hung.ending, hung.cancel_requests) == ("cancelled", 1)


def test_50_mb_of_output_becomes_a_10000_character_observation(tmp_path: Path,
                                                              writes: TraceWrites) -> None:
    size = 50 * 1024 * 1024
    head, tail = "HEAD-OF-OUTPUT\n", "\nTAIL-OF-OUTPUT"
    stdout = head + "x" * (size - len(head) - len(tail)) + tail
    environment = FakeEnvironment({"flood": Do(stdout=stdout, stderr="E" * 1000 + "\nSTDERR-END",
                                               return_code=3)})
    outcome = single(tmp_path, [bash("flood"), submit()], environment)
    assert outcome.ending == "returned"
    trace = one_trace(tmp_path, writes, outcome)
    [step] = env_steps(trace)
    content = step.observation.content
    assert len(content) <= MAX_OBSERVATION_CHARS
    assert content.startswith(head) and content.endswith("STDERR-END\n[exit 3]")
    assert "characters cut from the middle" in content
    assert step.observation.metadata["return_code"] == 3
    # what was kept is what the model saw: the trace is small, not 50 MB
    assert (tmp_path / TRACE_FILENAME).stat().st_size < 100_000


RAW = b"\x00NUL \xff\xfe bad \xc3( \xed\xa0\x80 lone \x1b[31m ansi \xe2\x82 cut \xf0\x9f\x98\x80 ok\n"


def test_binary_and_invalid_utf8_output_as_harbor_decodes_it_is_a_valid_observation(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    # harbor's environments decode with errors="replace": invalid bytes arrive as U+FFFD
    text = RAW.decode("utf-8", errors="replace")
    environment = FakeEnvironment({"binary": Do(stdout=text, stderr=RAW.decode("latin-1"))})
    outcome = single(tmp_path, [bash("binary"), submit()], environment)
    assert outcome.ending == "returned"
    trace = one_trace(tmp_path, writes, outcome)
    [step] = env_steps(trace)
    content = step.observation.content
    content.encode("utf-8")  # a valid str
    assert content == text + RAW.decode("latin-1")
    assert "\ufffd" in content and "\x00NUL" in content


def test_output_with_lone_surrogates_is_a_valid_observation_and_the_trace_is_written(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    text = RAW.decode("utf-8", errors="surrogateescape")
    assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    environment = FakeEnvironment({"binary": Do(stdout=text)})
    outcome = single(tmp_path, [bash("binary"), submit()], environment)
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    [step] = env_steps(trace)
    step.observation.content.encode("utf-8")
    assert "NUL" in step.observation.content and "ok\n" in step.observation.content


def test_tool_call_arguments_with_an_escaped_lone_surrogate_still_leave_a_trace(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    raw = '{"command": "echo \\udcff"}'
    assert json.loads(raw)["command"] == "echo \udcff"
    script = [{"tool_calls": [{"name": "bash", "arguments": raw}]}, submit()]
    outcome = single(tmp_path, script, FakeEnvironment())
    assert outcome.ending == "returned", repr(outcome.error)
    one_trace(tmp_path, writes, outcome)


# =======================================================================================
# The provider fails
# =======================================================================================


@pytest.mark.parametrize("kind", ["rate_limit", "overloaded", "server", "connection", "timeout"])
def test_a_storm_of_retryable_errors_is_ridden_out_by_the_retry_policy(
    tmp_path: Path, writes: TraceWrites, kind: str,
) -> None:
    environment = FakeEnvironment()
    agent = make_agent(tmp_path, [bash("echo one"), bash("echo two"), submit("ok")], kind="faulty",
                       settings={"storm": {"kind": kind, "per_turn": 4, "retry_after": 0.0}})
    outcome = drive(lambda: run_trial(agent, INSTRUCTION, environment, 60))
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    assert trace.answer == "ok"
    provider = agent.provider.inner  # RetryingProvider -> FaultyProvider
    assert provider.attempts == {0: 5, 1: 5, 2: 5}  # 4 failures then the reply, every turn
    assert [c.command for c in environment.calls] == ["echo one", "echo two"]


@pytest.mark.parametrize(("kind", "status"), [
    ("rate_limit", 429), ("server", 500), ("connection", None), ("overloaded", 529),
    ("bad_request", 400),
])
def test_errors_beyond_the_retry_budget_end_the_episode_as_provider_error(
    tmp_path: Path, writes: TraceWrites, kind: str, status: int | None,
) -> None:
    script = [bash("echo one"), {"error": {"kind": kind, "message": "down", "retry_after": 0.0}}]
    outcome = single(tmp_path, script, FakeEnvironment(), retry={"max_attempts": 3, "base_delay_s": 0.001})
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.PROVIDER_ERROR
    last = trace.steps[-1]
    assert last.observation.is_error
    assert last.observation.content == f"provider error: ProviderError: {kind}: down"
    assert last.observation.metadata["status"] == status
    assert outcome.context.metadata is not None
    assert outcome.context.metadata["stop_reason"] == "provider_error"


def test_an_exception_type_nobody_expected_from_the_provider_ends_as_provider_error(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    script = [bash("echo one"), {"error": {"kind": "unexpected", "message": "what is this"}}]
    outcome = single(tmp_path, script, FakeEnvironment())
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.PROVIDER_ERROR
    assert trace.steps[-1].observation.content == "provider failed: ScriptedFailure: what is this"


# Not "": blank arguments are a call without any, as servers mean them (test_scripted.py).
@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"a string"', "null", '{"command": "ls"'])
def test_malformed_tool_calls_are_nudged_then_end_the_episode(
    tmp_path: Path, writes: TraceWrites, raw: str,
) -> None:
    malformed = {"tool_calls": [{"name": "bash", "arguments": raw}]}
    environment = FakeEnvironment()
    outcome = single(tmp_path, [malformed, malformed, malformed, submit()], environment)
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.UNPARSED_TOOL_CALL
    assert environment.calls == []
    assert [s.observation.is_error for s in trace.steps] == [True, True, True]


def test_a_malformed_tool_call_is_nudged_and_the_episode_recovers(tmp_path: Path,
                                                                  writes: TraceWrites) -> None:
    malformed = {"text": "oops", "tool_calls": [{"name": "bash", "arguments": "{oops"}]}
    outcome = single(tmp_path, [malformed, bash("echo ok"), submit("fine")], FakeEnvironment())
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    assert trace.steps[0].observation.is_error and "could not be parsed" in trace.steps[0].observation.content


@pytest.mark.parametrize(("tool", "arguments", "problem"), [
    ("bash", {"command": 42}, "'command' must be a string, got int"),
    ("bash", {"command": ["ls", "-l"]}, "'command' must be a string, got list"),
    ("bash", {"command": None}, "'command' must be a string, got NoneType"),
    ("bash", {"command": {"nested": "object"}}, "'command' must be a string, got dict"),
    ("bash", {}, "missing argument 'command'"),
    ("bash", {"command": "ls", "cwd": "/"}, "unexpected argument 'cwd'; bash takes command"),
    ("read_file", {"path": 1.5}, "'path' must be a string, got float"),
    ("read_file", {"path": ""}, "'path' must be a non-empty string"),
    ("write_file", {"path": "a.txt", "content": True}, "'content' must be a string, got bool"),
    ("write_file", {"path": "a.txt"}, "missing argument 'content'"),
    ("submit", {"answer": 7}, "'answer' must be a string, got int"),
])
def test_tool_calls_with_arguments_of_the_wrong_type_get_an_error_observation(
    tmp_path: Path, writes: TraceWrites, tool: str, arguments: dict[str, Any], problem: str,
) -> None:
    environment = FakeEnvironment()
    outcome = single(tmp_path, [{"tool_calls": [call(tool, **arguments)]}, submit()], environment)
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    wrong = trace.steps[0]
    assert wrong.observation.is_error
    assert wrong.observation.content == f"invalid {tool} arguments: {problem}"
    assert environment.calls == []  # nothing reached the environment


def test_an_unknown_tool_is_not_available(tmp_path: Path, writes: TraceWrites) -> None:
    outcome = single(tmp_path, [{"tool_calls": [call("rm_rf", path="/")]}, submit()], FakeEnvironment())
    trace = one_trace(tmp_path, writes, outcome)
    assert trace.steps[0].observation.content == "tool 'rm_rf' not available"


# =======================================================================================
# Harbor times out, at every moment
# =======================================================================================


def test_timeout_before_the_first_step_leaves_an_empty_partial_trace(
    tmp_path: Path, writes: TraceWrites, counts: Any,
) -> None:
    environment = FakeEnvironment()
    agent = make_agent(tmp_path, [{"latency_s": 30, **bash("never")}, submit()], kind="faulty")
    outcome, fired = drive(lambda: _timing_out_when(agent.provider.inner.turn_started(0), agent,
                                                    environment))
    assert outcome.ending == "timeout"
    assert outcome.returned_at - fired < PROMPT_S
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace) and trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
    assert trace.steps == [] and trace.turns == 0
    assert environment.calls == []
    # stopped while the worker waited on the model
    assert counts.of(trace.task_id) == {"run": 1, "stop": 1, "close": 1, "record": 1}


@pytest.mark.parametrize("mode", ["thread", "guest"])
def test_timeout_while_the_engine_starts_still_leaves_a_trace(
    tmp_path: Path, writes: TraceWrites, monkeypatch: pytest.MonkeyPatch, mode: str,
) -> None:
    monkeypatch.setenv("WMO_TRIO_HOST", mode)
    lost = []
    for attempt in range(3):  # each on a fresh loop, whose engine has not started yet
        logs = tmp_path / f"attempt-{attempt}"
        outcome = single(logs, [submit()], FakeEnvironment(), timeout_sec=1e-6,
                         session_id=f"t{attempt}")
        assert outcome.ending == "timeout"
        if not (logs / TRACE_FILENAME).exists():
            lost.append(attempt)
    assert lost == []


def test_timeout_during_a_model_call_keeps_the_steps_so_far_and_the_usage(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    environment = FakeEnvironment()
    script = [bash("echo one"), {"latency_s": 30, **bash("never")}, submit()]
    agent = make_agent(tmp_path, script, kind="faulty")
    outcome, fired = drive(lambda: _timing_out_when(agent.provider.inner.turn_started(1), agent,
                                                    environment))
    assert outcome.ending == "timeout"
    assert outcome.returned_at - fired < PROMPT_S
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace) and trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
    assert [s.action.arguments for s in trace.steps] == [{"command": "echo one"}]
    assert [c.command for c in environment.calls] == ["echo one"]
    assert trace.worker_usage is not None and trace.worker_usage.calls == 1
    # the context harbor keeps reports the tokens spent before the timeout
    assert outcome.context.n_input_tokens == trace.worker_usage.input_tokens > 0
    assert outcome.context.n_output_tokens == trace.worker_usage.output_tokens > 0


def test_timeout_during_a_command_kills_its_process_and_waits_for_it(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    environment = FakeEnvironment({"slow": Do(process_s=60)})
    agent = make_agent(tmp_path, [bash("slow"), submit()])
    outcome, fired = drive(lambda: _timing_out_when(environment.child_started, agent, environment))
    assert outcome.ending == "timeout"
    assert outcome.returned_at - fired < PROMPT_S
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace) and len(trace.steps) == 1
    [slow] = environment.calls
    assert slow.ending == "cancelled" and slow.ended is not None and slow.ended <= outcome.returned_at
    assert environment.children  # the sleep ran, and was killed and reaped (see the fixture)
    assert not set(environment.children) & set(child_processes())


@pytest.mark.parametrize("cancels", [1, 2, 3], ids=["timeout", "timeout+cancel", "timeout+2cancels"])
def test_timeout_during_cleanup_waits_for_cleanup_and_keeps_the_full_result(
    tmp_path: Path, writes: TraceWrites, counts: Any, cancels: int,
) -> None:
    agent = make_agent(tmp_path, [bash("echo one"), submit("answer")], kind="faulty",
                       settings={"close_delay_s": 1.0})
    provider = agent.provider.inner
    outcome, fired = drive(lambda: _timing_out_when(provider.close_started, agent,
                                                    FakeEnvironment(), cancels=cancels))
    assert fired > 0, "close() never started"
    assert outcome.ending == ("timeout" if cancels == 1 else "cancelled"), repr(outcome.error)
    assert outcome.scoreable
    # run() gave the trial back only after the (shielded) close and trace write
    assert outcome.returned_at - fired >= 0.5
    assert outcome.returned_at - fired < 1.0 + PROMPT_S
    trace = one_trace(tmp_path, writes, outcome)
    # the worker had finished on its own before harbor's timeout: its full result stands
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    assert trace.answer == "answer"
    assert provider.closes == 1
    assert counts.of(trace.task_id) == {"run": 1, "close": 1, "record": 1}


def test_timeout_during_cleanup_still_reports_stop_reason_to_harbor(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, [submit("answer")], kind="faulty", settings={"close_delay_s": 0.5})
    outcome, _ = drive(lambda: _timing_out_when(agent.provider.inner.close_started, agent,
                                                FakeEnvironment()))
    assert outcome.ending == "timeout"
    assert outcome.context.metadata is not None
    assert outcome.context.metadata.get("stop_reason") == "submitted"


@pytest.mark.parametrize("cancels", [2, 3])
def test_more_cancellations_while_a_stopping_episode_cleans_up_change_nothing(
    tmp_path: Path, writes: TraceWrites, counts: Any, cancels: int,
) -> None:
    # the command takes 1 s to handle its cancellation, whatever happens meanwhile; more
    # cancellations of the trial arrive while the engine waits for it
    environment, started = announcing("hang", Do(hang=True, cancel_cleanup_s=1.0,
                                                 stubborn_cleanup=True))
    agent = make_agent(tmp_path, [bash("hang"), submit()])
    outcome, fired = drive(lambda: _timing_out_when(started, agent, environment, cancels=cancels,
                                                    gap_s=0.05))
    assert outcome.ending == "cancelled" and outcome.scoreable
    assert outcome.returned_at - fired >= 0.9  # it waited for the command's cleanup
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace) and trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
    [hung] = environment.calls
    assert hung.ending == "cancelled"
    assert hung.ended is not None and hung.ended <= outcome.returned_at
    assert counts.of(trace.task_id) == {"run": 1, "stop": 1, "close": 1, "record": 1}


# =======================================================================================
# The trace cannot be written; cleanup fails; the worker raises a BaseException
# =======================================================================================


class EpisodeDefect(Exception):
    pass


def _unwritable(tmp_path: Path, writes: TraceWrites, how: str) -> Path:
    if how == "logs-dir-under-a-file":
        blocker = tmp_path / "a-regular-file"
        blocker.write_text("not a directory")
        return blocker / "agent"
    writes.failure = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return tmp_path / "agent"


@pytest.mark.parametrize("how", ["logs-dir-under-a-file", "disk-full"])
def test_a_healthy_episode_whose_trace_cannot_be_written_raises_to_harbor(
    tmp_path: Path, writes: TraceWrites, how: str,
) -> None:
    logs = _unwritable(tmp_path, writes, how)
    outcome = single(logs, [bash("echo one"), submit()], FakeEnvironment())
    assert outcome.ending == "raised" and isinstance(outcome.error, OSError), repr(outcome.error)
    if how == "disk-full":
        assert outcome.error.errno == errno.ENOSPC
    assert outcome.scoreable
    assert writes.to(logs) == 1


@pytest.mark.parametrize("how", ["logs-dir-under-a-file", "disk-full"])
def test_after_a_timeout_a_lost_trace_is_logged_and_the_timeout_propagates(
    tmp_path: Path, writes: TraceWrites, caplog: pytest.LogCaptureFixture, how: str,
) -> None:
    logs = _unwritable(tmp_path, writes, how)
    agent = make_agent(logs, [bash("echo one"), {"latency_s": 30, **submit()}], kind="faulty")
    outcome, _ = drive(lambda: _timing_out_when(agent.provider.inner.turn_started(1), agent,
                                                FakeEnvironment()))
    assert outcome.ending == "timeout", repr(outcome.error)
    assert writes.to(logs) == 1
    assert "writing the trace of a stopped episode failed" in caplog.text


@pytest.mark.parametrize("how", ["logs-dir-under-a-file", "disk-full"])
@pytest.mark.parametrize("defect", ["exception", "base-exception"])
def test_after_an_episode_exception_a_lost_trace_is_logged_and_the_exception_propagates(
    tmp_path: Path, writes: TraceWrites, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch, how: str, defect: str,
) -> None:
    logs = _unwritable(tmp_path, writes, how)
    if defect == "exception":
        _raise_in_progress_after(monkeypatch, steps=1)
        outcome = single(logs, [bash("echo one"), submit()], FakeEnvironment())
        assert outcome.ending == "raised" and isinstance(outcome.error, EpisodeDefect)
    else:
        outcome = single(logs, [bash("echo one"), submit()], FakeEnvironment(), kind="faulty",
                         settings={"base_exception_at_turn": 1})
        assert outcome.ending == "raised" and type(outcome.error) is WorkerDefect
    assert writes.to(logs) == 1
    assert "writing the trace of a stopped episode failed" in caplog.text


def test_a_lost_trace_when_the_timeout_fires_during_cleanup_is_logged(
    tmp_path: Path, writes: TraceWrites, caplog: pytest.LogCaptureFixture,
) -> None:
    writes.failure = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    agent = make_agent(tmp_path, [submit()], kind="faulty", settings={"close_delay_s": 0.5})
    outcome, fired = drive(lambda: _timing_out_when(agent.provider.inner.close_started, agent,
                                                    FakeEnvironment()))
    assert fired > 0 and outcome.ending == "timeout"
    assert writes.to(tmp_path) == 1
    assert "No space left on device" in caplog.text


def _raise_in_progress_after(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """The episode's progress hook raises once `steps` steps are recorded: an exception
    out of the runtime itself, which nothing turns into an observation."""
    original = HarborEpisode._report_usage

    def report(self: HarborEpisode, log: Any) -> None:
        original(self, log)
        if len(log.steps()) >= steps:
            raise EpisodeDefect(f"injected defect after {steps} step(s)")

    monkeypatch.setattr(HarborEpisode, "_report_usage", report)


def test_an_episode_exception_reaches_the_caller_as_itself_with_a_partial_trace(
    tmp_path: Path, writes: TraceWrites, monkeypatch: pytest.MonkeyPatch, counts: Any,
) -> None:
    _raise_in_progress_after(monkeypatch, steps=1)
    outcome = single(tmp_path, [bash("echo one"), submit()], FakeEnvironment())
    assert outcome.ending == "raised" and type(outcome.error) is EpisodeDefect
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace)
    assert trace.stop_reason == "agent-exception:EpisodeDefect"
    assert trace.error == "EpisodeDefect: injected defect after 1 step(s)"
    assert len(trace.steps) == 1
    assert counts.of(trace.task_id) == {"run": 1, "close": 1, "record": 1}


def test_a_base_exception_from_the_worker_reaches_the_caller_as_itself(
    tmp_path: Path, writes: TraceWrites, counts: Any,
) -> None:
    outcome = single(tmp_path, [bash("echo one"), bash("echo two"), submit()], FakeEnvironment(),
                     kind="faulty", settings={"base_exception_at_turn": 2})
    assert outcome.ending == "raised" and type(outcome.error) is WorkerDefect, repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace)
    assert trace.stop_reason == "agent-exception:WorkerDefect"
    assert trace.error == "WorkerDefect: injected BaseException at turn 2"
    assert [s.action.arguments for s in trace.steps] == [{"command": "echo one"},
                                                          {"command": "echo two"}]
    assert trace.worker_usage is not None and trace.worker_usage.calls == 2
    assert outcome.context.metadata is not None
    assert outcome.context.metadata["stop_reason"] == "agent-exception:WorkerDefect"
    assert counts.of(trace.task_id) == {"run": 1, "close": 1, "record": 1}


@pytest.mark.slow  # a child interpreter
def test_keyboard_interrupt_and_system_exit_from_the_worker_reach_the_caller_as_themselves(
    tmp_path: Path,
) -> None:
    # In a child interpreter: were one of them to escape anywhere else, it must not take
    # pytest down with it.
    script = textwrap.dedent(f"""
        import asyncio, json, sys, threading
        from pathlib import Path
        import harbor_doubles as hd
        from wmo_trio.trace import parse_trace

        results = {{}}
        for name, kind in [("KeyboardInterrupt", KeyboardInterrupt), ("SystemExit", SystemExit)]:
            class Inject(hd.FaultyProvider):
                def complete(self, request, control, kind=kind):
                    if sum(1 for m in request.messages if m.role == "assistant") == 1:
                        raise kind("injected")
                    return super().complete(request, control)
            hd.register_provider("inject", f"{{__name__}}:Inject")
            globals()["Inject"] = Inject
            logs = Path({str(tmp_path)!r}) / name
            agent = hd.make_agent(logs, [hd.bash("echo one"), hd.submit()], kind="inject")
            outcome = asyncio.run(hd.run_trial(agent, "x", hd.FakeEnvironment(), 30))
            trace = parse_trace((logs / "wmo-run.json").read_bytes())
            results[name] = [outcome.ending, type(outcome.error).__name__, trace.stop_reason,
                             len(trace.steps)]
        results["engine_threads"] = [t.name for t in threading.enumerate()
                                     if t.name == "wmo-trio-engine"]
        print(json.dumps(results))
    """)
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "tests"),
                       "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    assert results == {
        "KeyboardInterrupt": ["raised", "KeyboardInterrupt", "agent-exception:KeyboardInterrupt", 1],
        "SystemExit": ["raised", "SystemExit", "agent-exception:SystemExit", 1],
        "engine_threads": [],
    }


def test_a_failing_close_is_logged_and_the_outcome_stands(
    tmp_path: Path, writes: TraceWrites, caplog: pytest.LogCaptureFixture,
) -> None:
    outcome = single(tmp_path, [bash("echo one"), submit("kept")], FakeEnvironment(), kind="faulty",
                     settings={"close_error": True})
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    assert trace.answer == "kept"
    assert "closing an episode failed" in caplog.text
    assert "injected failure to close the provider" in caplog.text


def test_a_failing_close_after_a_timeout_is_logged_and_the_timeout_stands(
    tmp_path: Path, writes: TraceWrites, caplog: pytest.LogCaptureFixture,
) -> None:
    agent = make_agent(tmp_path, [bash("echo one"), {"latency_s": 30, **submit()}], kind="faulty",
                       settings={"close_error": True})
    outcome, _ = drive(lambda: _timing_out_when(agent.provider.inner.turn_started(1), agent,
                                                FakeEnvironment()))
    assert outcome.ending == "timeout"
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, PartialTrace) and trace.stop_reason == CANCELLED_BY_HARBOR_TIMEOUT
    assert "closing an episode failed" in caplog.text


# =======================================================================================
# Bad input
# =======================================================================================


def test_a_10_mb_instruction_runs_and_its_usage_is_estimated(tmp_path: Path,
                                                           writes: TraceWrites) -> None:
    instruction = ("Do the thing. " * 800_000)[: 10 * 1024 * 1024]
    environment = FakeEnvironment()
    outcome = single(tmp_path, [bash("echo one"), submit()], environment, instruction=instruction,
                     timeout_sec=120)
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(tmp_path, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    usage = trace.worker_usage
    assert usage is not None and usage.calls == 2
    # each of the two calls sent the instruction: about a token per four characters
    assert 2 * len(instruction) / 4 <= usage.input_tokens <= 2 * len(instruction) / 4 * 1.01 + 10_000
    assert outcome.context.n_input_tokens == usage.input_tokens
    trajectory = json.loads((tmp_path / "trajectory.json").read_bytes())
    assert trajectory["steps"][1]["message"] == instruction


AWKWARD_PATHS = [
    "dir with spaces/file name.txt",
    "it's \"quoted\".txt",
    "$(touch PWNED).txt",
    "`touch PWNED2`.txt",
    "new\nline.txt",
    "-leading-dash.txt",
    "--dashes/-n",
    "-e",
    "glob*?[a].txt",
    "semi;colon&amp|pipe>redirect<.txt",
    "back\\slash \\n.txt",
    "tab\there.txt",
    "héllo ✓ 𝄞.txt",
    "~tilde/${HOME}.txt",
    " leading and trailing spaces ",
]
AWKWARD_CONTENT = "\x00NUL, quotes ' \" $(touch PWNED3) `id` ${HOME} \\n -n -e\n\n\ttrailing\n\n"


def test_awkward_paths_round_trip_through_the_adapter_and_a_real_shell(
    tmp_path: Path, writes: TraceWrites,
) -> None:
    from harbor_doubles import BashEnvironment

    workdir = tmp_path / "work"
    workdir.mkdir()
    logs = tmp_path / "agent"
    big = "big $(touch PWNED4) 'q'/-large file.bin"
    big_content = (AWKWARD_CONTENT * 2000)[: 200_000]  # past the inline limit: upload_file
    script = [
        {"tool_calls": [call("write_file", path=p, content=f"{AWKWARD_CONTENT}{p}") for p in AWKWARD_PATHS]
         + [call("write_file", path=big, content=big_content)]},
        {"tool_calls": [call("read_file", path=p) for p in AWKWARD_PATHS]},
        {"tool_calls": [call("read_file", path="missing $(touch PWNED5)"),
                        call("read_file", path="dir with spaces"),
                        call("write_file", path="nul\x00in path", content="x"),
                        call("bash", command="ls -A | wc -l")]},
        submit(),
    ]
    outcome = single(logs, script, BashEnvironment(workdir))
    assert outcome.ending == "returned", repr(outcome.error)
    trace = one_trace(logs, writes, outcome)
    assert isinstance(trace, FinishedTrace) and trace.stop_reason is StopReason.SUBMITTED
    steps = env_steps(trace)
    writes_, reads, odd = steps[: len(AWKWARD_PATHS) + 1], steps[len(AWKWARD_PATHS) + 1: -4], steps[-4:]
    for step in writes_:
        path = step.action.arguments["path"]
        assert (step.observation.content, step.observation.is_error) == (f"wrote {path}", False)
    for path, step in zip(AWKWARD_PATHS, reads, strict=True):
        assert not step.observation.is_error, (path, step.observation.content)
        assert step.observation.content == f"{AWKWARD_CONTENT}{path}"
        assert (workdir / path).read_bytes() == f"{AWKWARD_CONTENT}{path}".encode()
    assert (workdir / big).read_text() == big_content
    missing, directory, nul, listing = odd
    assert missing.observation.is_error and "[exit 1]" in missing.observation.content
    assert directory.observation.is_error and "Is a directory" in directory.observation.content
    assert nul.observation.is_error
    assert nul.observation.content.startswith("environment command failed: ")
    assert not listing.observation.is_error
    assert not list(workdir.rglob("PWNED*")), "a $(...) or `...` in a path was run"


@pytest.mark.parametrize("size", [10, 100_000], ids=["inline", "upload"])
def test_write_file_into_a_directory_whose_name_ends_in_a_newline(
    tmp_path: Path, writes: TraceWrites, size: int,
) -> None:
    from harbor_doubles import BashEnvironment

    workdir = tmp_path / "work"
    workdir.mkdir()
    path = "newline-dir\n/file.txt"
    outcome = single(tmp_path / "agent", [{"tool_calls": [call("write_file", path=path, content="n" * size)]},
                                          submit()], BashEnvironment(workdir))
    trace = one_trace(tmp_path / "agent", writes, outcome)
    assert trace.steps[0].observation.content == f"wrote {path}"
    assert (workdir / path).read_text() == "n" * size
