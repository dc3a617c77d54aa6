"""The scripted provider, the provider registry and the core models' JSON round trips."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wmo_trio.episode._tools import tool_spec
from wmo_trio.episode.portable import parse_tool_call
from wmo_trio.models import Action, ActionKind, Observation, RunResult, Step, StopReason, TokenUsage
from wmo_trio.providers import (
    CallControl,
    FinishReason,
    Message,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    build_provider,
    known_kinds,
)
from wmo_trio.providers._scripted import ScriptedFailure


def request(assistant_turns: int = 0, instruction: str = "go") -> ProviderRequest:
    messages = [Message(role="user", content=instruction)]
    messages += [Message(role="assistant", content="ok")] * assistant_turns
    tools = [tool_spec(name) for name in ("bash", "read_file", "write_file", "submit")]
    return ProviderRequest(system="s", messages=messages, tools=tools, max_output_tokens=10)


def scripted(script: Any, **settings: Any) -> Any:
    return build_provider({"kind": "scripted", "model": "s", "script": script, **settings},
                          with_retries=False)


def test_replies_follow_the_number_of_assistant_turns() -> None:
    provider = scripted([{"text": "first"}, {"text": "second"}])
    assert provider.complete(request(1), CallControl()).text == "second"
    assert provider.complete(request(0), CallControl()).text == "first"


def test_a_finished_script_is_a_provider_error() -> None:
    provider = scripted([{"text": "only"}])
    with pytest.raises(ProviderError, match="the script has 1 replies and call 2"):
        provider.complete(request(1), CallControl())


def test_tool_calls_get_ids_and_a_finish_reason() -> None:
    reply = scripted([{"tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]}]
                     ).complete(request(), CallControl())
    assert reply.finish_reason is FinishReason.TOOL_CALLS
    assert reply.tool_calls[0].id == "call_0_0" and reply.tool_calls[0].arguments == {"command": "ls"}


@pytest.mark.parametrize(("raw", "problem"), [("{oops", "invalid JSON"),
                                              ("[1, 2]", "not a JSON object")])
def test_string_arguments_inject_malformed_tool_calls(raw: str, problem: str) -> None:
    call = scripted([{"tool_calls": [{"name": "bash", "arguments": raw}]}]
                    ).complete(request(), CallControl()).tool_calls[0]
    assert call.arguments is None and call.raw_arguments == raw
    assert call.parse_error is not None and problem in call.parse_error


def test_string_arguments_nested_too_deeply_are_a_malformed_tool_call() -> None:
    # As the openai provider reads them live, so that its recordings replay alike.
    raw = "[" * 100_000 + "]" * 100_000
    call = scripted([{"tool_calls": [{"name": "bash", "arguments": raw}]}]
                    ).complete(request(), CallControl()).tool_calls[0]
    assert (call.arguments, call.raw_arguments, call.parse_error) == (
        None, raw, "invalid JSON: nested too deeply")


@pytest.mark.parametrize("raw", ["", "  "])
def test_blank_string_arguments_are_a_call_without_arguments(raw: str) -> None:
    call = scripted([{"tool_calls": [{"name": "bash", "arguments": raw}]}]
                    ).complete(request(), CallControl()).tool_calls[0]
    assert (call.arguments, call.parse_error) == ({}, None)


@pytest.mark.parametrize(
    ("kind", "status", "retryable"),
    [("rate_limit", 429, True), ("overloaded", 529, True), ("server", 500, True),
     ("connection", None, True), ("timeout", 408, True), ("bad_request", 400, False)],
)
def test_injected_errors_carry_status_and_retryability(kind: str, status: int | None,
                                                       retryable: bool) -> None:
    provider = scripted([{"error": {"kind": kind, "retry_after": 2.5}}])
    with pytest.raises(ProviderError) as error:
        provider.complete(request(), CallControl())
    assert (error.value.status, error.value.retryable, error.value.retry_after) == (
        status, retryable, 2.5)


def test_an_unexpected_injected_error_is_not_a_provider_error() -> None:
    with pytest.raises(ScriptedFailure, match="boom"):
        scripted([{"error": {"kind": "unexpected", "message": "boom"}}]).complete(
            request(), CallControl())


def test_latency_is_interruptible() -> None:
    control = CallControl()
    control.interrupt()
    with pytest.raises(ProviderInterrupted):
        scripted([{"text": "slow", "latency_s": 60}]).complete(request(), control)


def test_usage_is_a_deterministic_estimate() -> None:
    provider = scripted([{"text": "x" * 40}])
    first = provider.complete(request(), CallControl()).usage
    again = provider.complete(request(), CallControl()).usage
    assert first == again and first.output_tokens == 10 and first.calls == 1
    assert first.input_tokens > 0


def test_scripts_load_from_files(tmp_path: Path) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"replies": [{"text": "from file"}]}))
    assert scripted(str(path)).complete(request(), CallControl()).text == "from file"


@pytest.mark.parametrize(
    ("content", "message"),
    [("[{", "is not JSON: line 1"), ("[]", "non-empty list"),
     ('[{"text": "ok"}, {"txet": "typo"}]', "reply 1: txet: Extra inputs"),
     ('[{"latency_s": -1}]', "reply 0: latency_s")],
)
def test_malformed_script_files_say_what_and_where(tmp_path: Path, content: str,
                                                   message: str) -> None:
    path = tmp_path / "script.json"
    path.write_text(content)
    with pytest.raises(ProviderConfigError) as error:
        scripted(str(path))
    assert message in str(error.value) and str(path) in str(error.value)


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(ProviderConfigError, match="unknown setting scirpt"):
        build_provider({"kind": "scripted", "model": "s", "scirpt": []})


def test_a_scripted_model_that_does_not_exist_is_refused_naming_offline() -> None:
    # Before: scripted/online ran the offline policy, and its trace said scripted/online.
    with pytest.raises(ProviderConfigError) as error:
        build_provider({"kind": "scripted", "model": "online"})
    assert "scripted model 'online' does not exist" in str(error.value)
    assert "'offline'" in str(error.value)
    # A script's or a recording's replies may go by any name.
    build_provider({"kind": "scripted", "model": "weak", "script": [{"text": "hi"}]}).close()


def test_an_unknown_kind_names_the_known_kinds() -> None:
    with pytest.raises(ProviderConfigError) as error:
        build_provider({"kind": "openia", "model": "x"})
    assert "'openia'" in str(error.value)
    assert all(kind in str(error.value) for kind in known_kinds())


def test_a_provider_config_needs_kind_and_model() -> None:
    with pytest.raises(ProviderConfigError, match="model: Field required"):
        build_provider({"kind": "scripted"})


def test_the_model_name_is_kind_slash_model() -> None:
    assert ProviderConfig(kind="anthropic", model="claude-x").model_name == "anthropic/claude-x"


def test_the_offline_policy_gives_up_on_unknown_tasks() -> None:
    provider = build_provider({"kind": "scripted", "model": "offline"})
    first = provider.complete(request(0, "write a novel"), CallControl())
    last = provider.complete(request(1, "write a novel"), CallControl())
    assert first.tool_calls[0].name == "bash"
    assert last.tool_calls[0].name == "submit"


def test_the_offline_policy_talks_when_its_tool_is_taken_away() -> None:
    provider = build_provider({"kind": "scripted", "model": "offline"})
    full = request(0, "write a novel")
    without = full.model_copy(update={"tools": [t for t in full.tools if t.name != "bash"]})
    reply = provider.complete(without, CallControl())
    assert reply.tool_calls == [] and "I wanted to call bash, but it is not available" in reply.text


def test_the_offline_policy_writes_its_call_as_text_when_the_call_offers_no_tools() -> None:
    """A code:runtime program's `kit.complete` offers no tools: its calls come back as text,
    in the format the kit describes (`tools_text`) and reads (`parse_tool_call`)."""
    provider = build_provider({"kind": "scripted", "model": "offline"})
    bare = request(0, "write a novel").model_copy(update={"tools": []})
    reply = provider.complete(bare, CallControl())
    assert reply.tool_calls == []
    assert parse_tool_call(reply.text) == {"tool": "bash", "arguments": {"command": "pwd && ls -la"}}


# -- models ------------------------------------------------------------------------------

jsonish = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
actions = st.builds(Action, kind=st.sampled_from(ActionKind), name=st.none() | st.text(max_size=8),
                    arguments=st.none() | st.dictionaries(st.text(max_size=5), jsonish, max_size=3),
                    content=st.none() | st.text(max_size=20))
observations = st.builds(Observation, content=st.text(max_size=20), is_error=st.booleans(),
                         reward=st.none() | st.floats(allow_nan=False, allow_infinity=False),
                         metadata=st.dictionaries(st.text(max_size=5), jsonish, max_size=3))
usages = st.builds(TokenUsage, **{f: st.integers(0, 10**9) for f in
                                  ("input_tokens", "output_tokens", "cached_input_tokens",
                                   "cache_write_input_tokens", "calls")})
results = st.builds(RunResult, task_id=st.text(max_size=8),
                    steps=st.lists(st.builds(Step, action=actions, observation=observations),
                                   max_size=4),
                    stop_reason=st.sampled_from(StopReason), answer=st.text(max_size=10),
                    turns=st.integers(0, 50), worker_usage=st.none() | usages)


@settings(max_examples=100, deadline=None)
@given(results)
def test_run_results_round_trip_through_json(result: RunResult) -> None:
    assert RunResult.model_validate_json(result.model_dump_json()) == result


def test_stop_reasons_are_the_contract_set() -> None:
    assert {r.value for r in StopReason} == {
        "submitted", "max_turns", "no_action", "error", "budget", "no_tool_call",
        "output_truncated", "unparsed_tool_call", "provider_error", "unknown_done_reason",
        "cancelled"}


def test_usage_adds_field_by_field() -> None:
    total = TokenUsage(input_tokens=1, output_tokens=2, calls=1) + TokenUsage(
        input_tokens=10, cached_input_tokens=5, cache_write_input_tokens=3, calls=1)
    assert total == TokenUsage(input_tokens=11, output_tokens=2, cached_input_tokens=5,
                               cache_write_input_tokens=3, calls=2)
