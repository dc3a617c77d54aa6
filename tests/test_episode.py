"""The episode loop (CONTRACT section 3): stop reasons, nudges, budgets, cancellation."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from doubles import Spy, make_doc, when
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import running, when_written

from wmo_trio.episode import DirectoryShell, LocalExecution
from wmo_trio.episode._services import NUDGES, PrefixMemo
from wmo_trio.episode._tools import MAX_OBSERVATION_CHARS
from wmo_trio.models import Action, ActionKind, Observation, StopReason
from wmo_trio.providers import (
    CallControl,
    ProviderRequest,
    ProviderResponse,
    build_provider,
)


def bash(command: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}


def submit(answer: str = "done") -> dict[str, Any]:
    return {"tool_calls": [{"name": "submit", "arguments": {"answer": answer}}]}


TEXT = {"text": "let me think"}


def run(script: list[dict[str, Any]], tmp_path: Path, doc: Any = None, **settings: Any) -> Any:
    """The episode of `script`; `settings` are the episode's (`EpisodeSettings`)."""
    provider = Spy(script)
    runtime = LocalExecution(doc or make_doc(), provider, settings)
    result = runtime.run("task", "do it", DirectoryShell(tmp_path, command_timeout_sec=30))
    return result, provider


# -- stop reasons ------------------------------------------------------------------------


def test_submit_ends_the_episode_with_its_answer(tmp_path: Path) -> None:
    result, provider = run([bash("echo hi > f"), submit("all good"), bash("rm f")], tmp_path)
    assert result.stop_reason is StopReason.SUBMITTED
    assert result.answer == "all good"
    assert result.turns == 2 and len(provider.requests) == 2
    assert (tmp_path / "f").read_text() == "hi\n"
    assert result.worker_usage is not None and result.worker_usage.calls == 2


def test_tool_results_go_back_to_the_model_in_order(tmp_path: Path) -> None:
    two = {"tool_calls": [{"name": "bash", "arguments": {"command": "echo one"}},
                          {"name": "bash", "arguments": {"command": "echo two"}}]}
    _, provider = run([two, submit()], tmp_path)
    answers = [m for m in provider.requests[1].messages if m.role == "tool"]
    assert [m.content for m in answers] == ["one\n", "two\n"]
    assert [m.tool_call_id for m in answers] == ["call_0_0", "call_0_1"]


def test_max_turns_bounds_the_model_calls(tmp_path: Path) -> None:
    result, provider = run([bash("true")] * 5, tmp_path, make_doc(max_turns=3))
    assert result.stop_reason is StopReason.MAX_TURNS
    assert len(provider.requests) == 3 and result.turns == 3


def test_three_replies_without_a_tool_call_end_with_no_tool_call(tmp_path: Path) -> None:
    result, provider = run([TEXT, TEXT, TEXT, submit()], tmp_path)
    assert result.stop_reason is StopReason.NO_TOOL_CALL
    assert len(provider.requests) == 3 and result.turns == 0


def test_a_reply_without_a_tool_call_is_nudged(tmp_path: Path) -> None:
    result, provider = run([TEXT, submit()], tmp_path)
    assert result.stop_reason is StopReason.SUBMITTED
    assert provider.requests[1].messages[-1].content == NUDGES["no_tool_call"]
    assert provider.requests[1].messages[-1].role == "user"


def test_the_nudge_count_resets_after_a_usable_call(tmp_path: Path) -> None:
    result, _ = run([TEXT, TEXT, bash("true"), TEXT, TEXT, submit()], tmp_path)
    assert result.stop_reason is StopReason.SUBMITTED


def test_unparseable_tool_calls_end_with_unparsed_tool_call(tmp_path: Path) -> None:
    broken = {"tool_calls": [{"name": "bash", "arguments": "{not json"}]}
    result, provider = run([broken, broken, broken], tmp_path)
    assert result.stop_reason is StopReason.UNPARSED_TOOL_CALL
    # every tool call gets an answer, then the nudge
    second = provider.requests[1].messages
    assert second[-2].role == "tool" and "could not parse" in second[-2].content
    assert second[-1].content == NUDGES["unparsed_tool_call"]


def test_replies_cut_at_the_output_limit_end_with_output_truncated(tmp_path: Path) -> None:
    cut = {"text": "I will now wri", "finish_reason": "length"}
    result, provider = run([cut, cut, cut], tmp_path)
    assert result.stop_reason is StopReason.OUTPUT_TRUNCATED
    assert provider.requests[1].messages[-1].content == NUDGES["output_truncated"]


def test_max_turns_is_never_nudged(tmp_path: Path) -> None:
    result, provider = run([bash("true"), TEXT], tmp_path, make_doc(max_turns=2))
    assert result.stop_reason is StopReason.MAX_TURNS
    assert len(provider.requests) == 2
    assert all(step.observation.content not in NUDGES.values() for step in result.steps)


def test_a_truncated_last_turn_is_classified_before_max_turns(tmp_path: Path) -> None:
    cut = {"text": "partial", "finish_reason": "length"}
    result, _ = run([bash("true"), cut], tmp_path, make_doc(max_turns=2))
    assert result.stop_reason is StopReason.OUTPUT_TRUNCATED


def test_an_unparsed_last_turn_is_classified_before_max_turns(tmp_path: Path) -> None:
    broken = {"tool_calls": [{"name": "bash", "arguments": "[1]"}]}
    result, _ = run([bash("true"), broken], tmp_path, make_doc(max_turns=2))
    assert result.stop_reason is StopReason.UNPARSED_TOOL_CALL


def test_a_provider_error_ends_the_episode_without_a_nudge(tmp_path: Path) -> None:
    result, provider = run([bash("true"), {"error": {"kind": "bad_request", "message": "no"}},
                            submit()], tmp_path)
    assert result.stop_reason is StopReason.PROVIDER_ERROR
    assert len(provider.requests) == 2
    assert "bad_request: no" in result.steps[-1].observation.content
    assert result.worker_usage is not None and result.worker_usage.calls == 1


def test_an_unexpected_provider_exception_is_a_provider_error(tmp_path: Path) -> None:
    result, _ = run([{"error": {"kind": "unexpected", "message": "kaboom"}}], tmp_path)
    assert result.stop_reason is StopReason.PROVIDER_ERROR
    assert "ScriptedFailure: kaboom" in result.steps[-1].observation.content


def test_an_environment_that_raises_ends_with_error(tmp_path: Path) -> None:
    class Raising:
        def execute(self, action: Action) -> Observation:
            raise RuntimeError("transport gone")

    runtime = LocalExecution(make_doc(), Spy([bash("true"), submit()]))
    result = runtime.run("t", "go", Raising())
    assert result.stop_reason is StopReason.ERROR
    assert "RuntimeError: transport gone" in result.steps[-1].observation.content
    assert result.turns == 1


# -- budgets -----------------------------------------------------------------------------


def test_environment_actions_are_capped(tmp_path: Path) -> None:
    result, _ = run([bash("echo a >> log"), bash("echo b >> log"), bash("echo c >> log"),
                     submit()], tmp_path, make_doc(max_env_actions=2))
    assert result.stop_reason is StopReason.SUBMITTED
    assert (tmp_path / "log").read_text() == "a\nb\n"
    third = result.steps[2].observation
    assert third.is_error and "environment action budget exhausted" in third.content


def test_the_wall_clock_budget_interrupts_a_model_call(tmp_path: Path) -> None:
    started = time.monotonic()
    result, _ = run([{**bash("true"), "latency_s": 30}], tmp_path, episode_timeout_sec=0.3)
    assert time.monotonic() - started < 10  # far from the 30 s the call would take
    assert result.stop_reason is StopReason.BUDGET
    last = result.steps[-1]
    assert last.action.kind is ActionKind.MESSAGE and last.observation.is_error
    assert "wall-clock budget of 0.3 s" in last.observation.content


def test_the_wall_clock_budget_kills_a_running_command(tmp_path: Path) -> None:
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"
    result, _ = run([bash(f"sleep 30 && echo {marker}"), submit()], tmp_path,
                    episode_timeout_sec=0.5)
    assert result.stop_reason is StopReason.BUDGET
    assert "environment command failed" in result.steps[0].observation.content
    assert not running(marker)


def test_an_environment_whose_interrupt_raises_does_not_stop_later_budgets(
        tmp_path: Path, caplog: Any) -> None:
    # issue 15.2: the shared deadline watcher used to die with the raising interrupt(), and
    # no budget fired again in the process: a later 0.5 s episode ran its 30 s command.
    class Unreachable(DirectoryShell):
        def interrupt(self) -> None:
            super().interrupt()  # the command does stop; reporting it fails
            raise ConnectionError("the sandbox cannot be reached")

    provider = Spy([bash("sleep 30"), submit()])
    first = LocalExecution(make_doc(), provider, {"episode_timeout_sec": 0.3})
    assert first.run("t", "go", Unreachable(tmp_path)).stop_reason is StopReason.BUDGET
    # logged by the watcher thread once interrupt() raised, maybe after the episode returned
    limit = time.monotonic() + 30
    while "cancelling a call in flight of an ending episode failed" not in caplog.text:
        assert time.monotonic() < limit, "the raising interrupt() was never logged"
        time.sleep(0.01)
    started = time.monotonic()
    result, _ = run([bash("sleep 30"), submit()], tmp_path, episode_timeout_sec=0.5)
    assert result.stop_reason is StopReason.BUDGET
    assert time.monotonic() - started < 20  # far from the 30 s command


# -- cancellation ------------------------------------------------------------------------


def test_should_cancel_stops_at_the_next_boundary_keeping_usage(tmp_path: Path) -> None:
    calls = {"n": 0}

    def after_first_call() -> bool:
        return calls["n"] >= 1

    class Counting(Spy):
        def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
            calls["n"] += 1
            return super().complete(request, control)

    runtime = LocalExecution(make_doc(), Counting([bash("echo x > f"), submit()]),
                             should_cancel=after_first_call)
    result = runtime.run("t", "go", DirectoryShell(tmp_path))
    assert result.stop_reason is StopReason.CANCELLED
    assert result.steps == [] and not (tmp_path / "f").exists()  # checked before the tool call
    assert result.worker_usage is not None and result.worker_usage.calls == 1


def test_abort_interrupts_a_model_call_in_flight(tmp_path: Path) -> None:
    provider = Spy([{**bash("true"), "latency_s": 30}])
    runtime = LocalExecution(make_doc(), provider)
    when(provider.calling, runtime.abort)
    started = time.monotonic()
    result = runtime.run("t", "go", DirectoryShell(tmp_path))
    assert result.stop_reason is StopReason.CANCELLED
    assert time.monotonic() - started < 10


def test_an_interrupt_of_its_control_alone_ends_the_episode_as_cancelled(tmp_path: Path) -> None:
    # The control's interrupt is the one stop signal: no flag of the runtime's beside it.
    provider = Spy([{**bash("true"), "latency_s": 30}, submit()])
    runtime = LocalExecution(make_doc(), provider)
    when(provider.calling, runtime.control.interrupt)
    started = time.monotonic()
    result = runtime.run("t", "go", DirectoryShell(tmp_path))
    assert result.stop_reason is StopReason.CANCELLED
    assert len(provider.requests) == 1 and time.monotonic() - started < 10


def test_a_true_should_cancel_interrupts_the_control(tmp_path: Path) -> None:
    runtime = LocalExecution(make_doc(), Spy([submit()]), should_cancel=lambda: True)
    assert runtime.run("t", "go", DirectoryShell(tmp_path)).stop_reason is StopReason.CANCELLED
    assert runtime.control.interrupted


def test_the_wall_clock_budget_ends_the_calls_without_interrupting_the_episode(tmp_path: Path) -> None:
    result, _ = run([{**bash("true"), "latency_s": 30}], tmp_path, episode_timeout_sec=0.3)
    assert result.stop_reason is StopReason.BUDGET  # not cancelled: the deadline is not a stop


def test_abort_kills_the_command_in_flight(tmp_path: Path) -> None:
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6 + 1}"
    runtime = LocalExecution(make_doc(), Spy([bash(f"echo > started; sleep 40 ; echo {marker}"),
                                              submit()]))
    when_written(tmp_path / "started", runtime.abort)
    result = runtime.run("t", "go", DirectoryShell(tmp_path))
    assert result.stop_reason is StopReason.CANCELLED
    assert len(result.steps) == 1 and result.steps[0].observation.is_error
    assert not running(marker)


def test_abort_before_run_returns_cancelled_at_once(tmp_path: Path) -> None:
    provider = Spy([submit()])
    runtime = LocalExecution(make_doc(), provider)
    runtime.abort()
    assert runtime.run("t", "go", DirectoryShell(tmp_path)).stop_reason is StopReason.CANCELLED
    assert provider.requests == []


def test_close_is_idempotent_leaves_the_provider_alone_and_ends_every_wait(tmp_path: Path) -> None:
    closed = []

    class Closing(Spy):
        def close(self) -> None:
            closed.append(True)

    runtime = LocalExecution(make_doc(), Closing([submit()]))
    runtime.run("t", "go", DirectoryShell(tmp_path))
    runtime.close()
    runtime.close()
    assert closed == []  # the provider is its owner's to close
    assert runtime.control.interrupted and not runtime.control.sleep(30)


def test_a_runtime_runs_one_episode(tmp_path: Path) -> None:
    runtime = LocalExecution(make_doc(), Spy([submit(), submit()]))
    runtime.run("t", "go", DirectoryShell(tmp_path))
    with pytest.raises(RuntimeError, match="single episode"):
        runtime.run("t", "go", DirectoryShell(tmp_path))


def test_steps_are_recorded_as_they_happen(tmp_path: Path) -> None:
    seen: list[int] = []
    runtime = LocalExecution(make_doc(), Spy([bash("true"), bash("true"), submit()]),
                             on_progress=lambda log: seen.append(len(log.steps())))
    runtime.run("t", "go", DirectoryShell(tmp_path))
    assert 1 in seen and 2 in seen and max(seen) == 3


# -- tools answered by the episode -------------------------------------------------------


def test_unknown_tools_are_not_available(tmp_path: Path) -> None:
    call = {"tool_calls": [{"name": "python", "arguments": {"code": "1"}}]}
    result, _ = run([call, submit()], tmp_path)
    assert result.steps[0].observation.content == "tool 'python' not available"
    assert result.steps[0].observation.is_error


def test_tools_outside_the_policy_are_not_available(tmp_path: Path) -> None:
    result, _ = run([bash("touch f"), submit()], tmp_path, make_doc(policy="read_file\nsubmit"))
    assert result.steps[0].observation.content == "tool 'bash' not available"
    assert not (tmp_path / "f").exists()


def test_read_skill_answers_host_side(tmp_path: Path) -> None:
    read = {"tool_calls": [{"name": "read_skill", "arguments": {"name": "notes"}}]}
    missing = {"tool_calls": [{"name": "read_skill", "arguments": {"name": "none"}}]}
    result, provider = run([read, missing, submit()], tmp_path, make_doc(skill="use grep"))
    assert result.steps[0].observation.content.endswith("use grep")
    assert "unknown skill 'none'" in result.steps[1].observation.content
    assert "notes: d" in provider.requests[0].system


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "missing argument 'command'"),
        ({"command": 3}, "'command' must be a string, got int"),
        ({"command": "ls", "timeout": "9"}, "unexpected argument 'timeout'; bash takes command"),
    ],
)
def test_wrong_arguments_give_an_error_observation(tmp_path: Path, arguments: dict[str, Any],
                                                  problem: str) -> None:
    result, _ = run([{"tool_calls": [{"name": "bash", "arguments": arguments}]}, submit()], tmp_path)
    assert result.steps[0].observation.content == f"invalid bash arguments: {problem}"
    assert result.stop_reason is StopReason.SUBMITTED


def test_submit_needs_a_string_answer(tmp_path: Path) -> None:
    bad = {"tool_calls": [{"name": "submit", "arguments": {"answer": 42}}]}
    result, _ = run([bad, submit("ok")], tmp_path)
    assert "invalid submit arguments" in result.steps[0].observation.content
    assert result.answer == "ok"


def test_the_context_window_elides_old_tool_outputs(tmp_path: Path) -> None:
    big = bash("head -c 8000 /dev/zero | tr '\\0' x")
    _, provider = run([big, big, big, submit()], tmp_path, context_window=8000)
    last = provider.requests[-1]
    contents = [m.content for m in last.messages if m.role == "tool"]
    assert contents[0] == "[output elided to fit the context window]"
    assert contents[-1] == "x" * 8000
    assert last.max_output_tokens == 4000  # half the window at most


def test_the_offline_policy_solves_a_file_task(tmp_path: Path) -> None:
    provider = build_provider({"kind": "scripted", "model": "offline"})
    runtime = LocalExecution(make_doc(), provider)
    result = runtime.run("t", "Create the file `out/a.txt` whose whole content is the line `hi`",
                         DirectoryShell(tmp_path))
    assert result.stop_reason is StopReason.SUBMITTED
    assert (tmp_path / "out" / "a.txt").read_text() == "hi\n"


# -- the observation cap (issue 15.3) -------------------------------------------------------

LONG = st.integers(min_value=10_001, max_value=60_000)


class _RaisingEnvironment:
    """An environment that raises instead of answering, with a long message."""

    def __init__(self, message: str) -> None:
        self.message = message

    def execute(self, action: Action) -> Observation:
        raise RuntimeError(self.message)


def _observation_paths(n: int) -> dict[str, tuple[list[dict[str, Any]], Any, Any]]:
    """Every way an observation comes to be, each with a text of `n` characters in it:
    (script, document, environment or None for a DirectoryShell)."""
    text = "x" * n

    def call(tool: str, **arguments: str) -> dict[str, Any]:
        return {"tool_calls": [{"name": tool, "arguments": arguments}]}

    return {
        "unknown tool": ([call("t" + "o" * n), submit()], None, None),
        "unknown argument": ([call("bash", command="true", **{"k" * n: "v"}), submit()], None, None),
        "unknown skill": ([call("read_skill", name="s" * n), submit()], make_doc(skill="notes"), None),
        "command output": ([bash(f"head -c {n} /dev/zero | tr '\\\\0' x"), submit()], None, None),
        "write_file path": ([call("write_file", path="p" * n, content="c"), submit()], None, None),
        "unparsed call": ([{"tool_calls": [{"name": "bash" + "h" * n, "arguments": "{not json"}]},
                           call("bash", command="true"), submit()], None, None),
        "environment raises": ([bash("true"), submit()], None, _RaisingEnvironment(text)),
        "provider error": ([bash("true"), {"error": {"kind": "bad_request", "message": text}}],
                           None, None),
    }


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(sorted(_observation_paths(1))), n=LONG)
def test_every_observation_is_capped_whatever_produced_it(tmp_path: Path, path: str, n: int) -> None:
    script, doc, environment = _observation_paths(n)[path]
    provider = Spy(script)
    runtime = LocalExecution(doc or make_doc(), provider)
    environment = environment or DirectoryShell(tmp_path, command_timeout_sec=30)
    result = runtime.run("task", "do it", environment)
    assert result.steps, path
    for step in result.steps:
        assert len(step.observation.content) <= MAX_OBSERVATION_CHARS, (path, len(step.observation.content))
    for request in provider.requests:
        for message in request.messages:
            if message.role == "tool":
                assert len(message.content) <= MAX_OBSERVATION_CHARS, path


def test_a_prefix_memo_maps_each_new_item_once_and_sees_a_list_changed_in_place() -> None:
    seen: list[str] = []
    memo = PrefixMemo[str, str](lambda item: seen.append(item) or item.upper())
    sent = ["a", "b"]
    assert memo(sent) == ["A", "B"]
    sent.append("c")  # the same list, grown in place
    assert memo(sent) == ["A", "B", "C"] and seen == ["a", "b", "c"]
    sent[1] = "x"  # an item replaced: it and what follows are mapped again
    assert memo(sent) == ["A", "X", "C"] and seen == ["a", "b", "c", "x", "c"]
