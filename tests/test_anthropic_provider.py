"""The Anthropic provider, through the real `anthropic` SDK against a loopback server.

Nothing of the SDK is mocked: every test sends real HTTP to `AnthropicServer` (see
tests/anthropic_server.py), which answers from a queue and records what it received.
What every HTTP provider does alike (errors, retries, budgets, interrupts, the pool, the
shared settings) is in tests/test_provider_contract.py; here is what only this one does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic_server as api
import pytest
from anthropic_server import AnthropicServer
from doubles import untimed
from provider_wires import FAST_RETRY, call, closing_all, request, tool_result, user

from wmo_trio.episode._environment import DirectoryShell
from wmo_trio.episode._execution import LocalExecution
from wmo_trio.harness import parse_harness
from wmo_trio.models import TokenUsage
from wmo_trio.providers import build_provider
from wmo_trio.providers._anthropic import AnthropicProvider
from wmo_trio.providers._base import (
    CallControl,
    FinishReason,
    Message,
    Provider,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderRequest,
    ToolCall,
    ToolSpec,
)
from wmo_trio.providers._http import retry_after_seconds

KEY_ENV = "WMO_TEST_ANTHROPIC_KEY"
BREAKPOINT = {"type": "ephemeral"}


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, api.API_KEY)


def settings(server: AnthropicServer, **extra: Any) -> dict[str, Any]:
    return {"kind": "anthropic", "model": "claude-test", "api_key_env": KEY_ENV,
            "base_url": server.base_url, **extra}


@pytest.fixture
def make_provider(anthropic_server: AnthropicServer) -> Iterator[Callable[..., AnthropicProvider]]:
    yield from closing_all(
        lambda **extra: AnthropicProvider.from_config(ProviderConfig(**settings(anthropic_server, **extra))))


@pytest.fixture
def provider(make_provider: Callable[..., AnthropicProvider]) -> AnthropicProvider:
    return make_provider()


@pytest.fixture
def make_built(anthropic_server: AnthropicServer) -> Iterator[Callable[..., Provider]]:
    """Providers from `build_provider`, i.e. wrapped in the retry policy."""
    yield from closing_all(lambda **extra: build_provider(settings(anthropic_server, **extra)))


def sent(server: AnthropicServer, provider: AnthropicProvider, req: ProviderRequest) -> dict[str, Any]:
    """The body the provider sends for `req`."""
    server.enqueue(api.text("ok"))
    provider.complete(req, CallControl())
    body: dict[str, Any] = server.bodies[-1]
    return body


def cache_breakpoints(value: Any, path: str = "") -> list[str]:
    """Where `cache_control` appears anywhere in a request body."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "cache_control":
                found.append(path)
            found.extend(cache_breakpoints(item, f"{path}.{key}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(cache_breakpoints(item, f"{path}[{index}]"))
    return found


def without_breakpoint(block: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in block.items() if key != "cache_control"}


# -- request mapping -------------------------------------------------------------------


def test_system_prompt_is_sent_at_the_top_level(anthropic_server: AnthropicServer,
                                               provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(user("hi"), system="Be brief."))
    assert body["system"] == [{"type": "text", "text": "Be brief."}]
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert body["model"] == "claude-test"


def test_consecutive_same_role_messages_are_merged(anthropic_server: AnthropicServer,
                                                  provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(
        user("first"), user("second"),
        Message(role="assistant", content="calling", tool_calls=[call("t1"), call("t2")]),
        tool_result("t1", "out1"), tool_result("t2", "out2"), user("nudge"),
    ))
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert [b["text"] for b in messages[0]["content"]] == ["first", "second"]
    assert [b["type"] for b in messages[2]["content"]] == ["tool_result", "tool_result", "text"]


def test_tool_results_are_user_tool_result_blocks_with_is_error(anthropic_server: AnthropicServer,
                                                                provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(
        user("go"),
        Message(role="assistant", tool_calls=[call("t1"), call("t2")]),
        tool_result("t1", "fine"), tool_result("t2", "boom", is_error=True),
    ))
    blocks = [without_breakpoint(b) for b in body["messages"][-1]["content"]]
    assert body["messages"][-1]["role"] == "user"
    assert blocks == [
        {"type": "tool_result", "tool_use_id": "t1", "content": "fine", "is_error": False},
        {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
    ]


def test_assistant_tool_calls_are_tool_use_blocks(anthropic_server: AnthropicServer,
                                                  provider: AnthropicProvider) -> None:
    unparsed = ToolCall(id="t2", name="write_file", arguments=None, raw_arguments="[1]",
                        parse_error="not an object")
    body = sent(anthropic_server, provider, request(
        user("go"),
        Message(role="assistant", content="", tool_calls=[call("t1", "bash", {"command": "ls"}), unparsed]),
        tool_result("t1", "a"), tool_result("t2", "b"),
    ))
    assert body["messages"][1] == {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "t2", "name": "write_file", "input": {}},
    ]}


def test_empty_assistant_text_sends_no_text_block(anthropic_server: AnthropicServer,
                                                  provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(
        user("go"), Message(role="assistant", content="  \n", tool_calls=[call("t1")]),
        tool_result("t1", "x"),
    ))
    assert [b["type"] for b in body["messages"][1]["content"]] == ["tool_use"]


def test_an_assistant_message_with_nothing_in_it_is_left_out(anthropic_server: AnthropicServer,
                                                             provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(
        user("go"), Message(role="assistant", content=""), user("call a tool"),
    ))
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert [b["text"] for b in body["messages"][0]["content"]] == ["go", "call a tool"]


def test_tool_schemas_are_sent_as_input_schema(anthropic_server: AnthropicServer,
                                               provider: AnthropicProvider) -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    body = sent(anthropic_server, provider, request(
        tools=[ToolSpec(name="bash", description="Run a command.", parameters=schema)]))
    assert body["tools"] == [{"name": "bash", "description": "Run a command.", "input_schema": schema}]


def test_max_output_tokens_is_sent_as_max_tokens_and_thinking_stays_off(anthropic_server: AnthropicServer,
                                        provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(max_output_tokens=777))
    assert body["max_tokens"] == 777
    assert "thinking" not in body


def test_temperature_is_not_sent_under_the_sdk_api_version(anthropic_server: AnthropicServer,
                                                          provider: AnthropicProvider) -> None:
    # API version 2026-10-21, which the SDK speaks, answers any temperature with a 400.
    body = sent(anthropic_server, provider, request(temperature=0.3))
    assert "temperature" not in body
    assert anthropic_server.requests[-1].headers["anthropic-version"] != "2023-06-01"


def test_temperature_is_forwarded_under_api_version_2023_06_01(
        anthropic_server: AnthropicServer, make_provider: Callable[..., AnthropicProvider]) -> None:
    body = sent(anthropic_server, make_provider(api_version="2023-06-01"), request(temperature=0.3))
    assert body["temperature"] == 0.3
    assert anthropic_server.requests[-1].headers["anthropic-version"] == "2023-06-01"


def test_temperature_is_left_out_when_thinking_is_on(anthropic_server: AnthropicServer,
                                                     make_provider: Callable[..., AnthropicProvider]) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    body = sent(anthropic_server, make_provider(thinking=thinking, api_version="2023-06-01"),
                request(temperature=0.3, max_output_tokens=4096))
    assert body["thinking"] == thinking
    assert "temperature" not in body


def test_a_max_output_not_above_the_thinking_budget_is_refused_before_sending(
        anthropic_server: AnthropicServer, make_provider: Callable[..., AnthropicProvider]) -> None:
    provider = make_provider(thinking={"type": "enabled", "budget_tokens": 2048})
    with pytest.raises(ProviderError, match="budget_tokens") as caught:
        provider.complete(request(max_output_tokens=2048), CallControl())
    assert not caught.value.retryable
    assert anthropic_server.requests == []


def test_one_cache_breakpoint_on_the_last_block_of_the_last_message(
        anthropic_server: AnthropicServer, provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(
        user("go"), Message(role="assistant", content="ok", tool_calls=[call("t1")]),
        tool_result("t1", "first"), tool_result("t2", "last"),
        tools=[ToolSpec(name="bash", description="d", parameters={"type": "object"})],
    ))
    assert cache_breakpoints(body) == [".messages[2].content[1]"]
    assert body["messages"][2]["content"][1]["cache_control"] == BREAKPOINT


def test_without_messages_the_cache_breakpoint_is_on_the_system_prompt(
        anthropic_server: AnthropicServer, provider: AnthropicProvider) -> None:
    req = ProviderRequest(system="sys", messages=[], tools=[], max_output_tokens=10)
    body = sent(anthropic_server, provider, req)
    assert cache_breakpoints(body) == [".system[0]"]
    assert body["system"] == [{"type": "text", "text": "sys", "cache_control": BREAKPOINT}]


def test_thinking_blocks_go_back_with_their_tool_calls(
        anthropic_server: AnthropicServer, make_provider: Callable[..., AnthropicProvider]) -> None:
    provider = make_provider(thinking={"type": "enabled", "budget_tokens": 1024})
    anthropic_server.enqueue(api.message(
        [api.thinking_block("let me look", "sig-1"), api.redacted_thinking_block("xyz"),
         api.tool_use_block("bash", {"command": "ls"}, id_="toolu_1")],
        stop_reason="tool_use"))
    first = provider.complete(request(user("go"), max_output_tokens=4096), CallControl())

    body = sent(anthropic_server, provider, request(
        user("go"), Message(role="assistant", content=first.text, tool_calls=first.tool_calls),
        tool_result("toolu_1", "files"), max_output_tokens=4096))
    assert body["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "let me look", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
    ]


# -- response mapping ------------------------------------------------------------------


def test_text_blocks_are_concatenated(anthropic_server: AnthropicServer, provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.message([api.text_block("Hello, "), api.text_block("world.")]))
    response = provider.complete(request(), CallControl())
    assert response.text == "Hello, world."
    assert response.tool_calls == []
    assert response.finish_reason is FinishReason.STOP


def test_thinking_blocks_are_dropped_from_the_response(anthropic_server: AnthropicServer,
                                                       provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.message([
        api.thinking_block("secret reasoning"), api.redacted_thinking_block(), api.text_block("Answer."),
    ]))
    response = provider.complete(request(), CallControl())
    assert response.text == "Answer."
    assert response.tool_calls == []


@pytest.mark.parametrize(("stop_reason", "finish"), [
    ("end_turn", FinishReason.STOP),
    ("stop_sequence", FinishReason.STOP),
    ("pause_turn", FinishReason.STOP),
    ("tool_use", FinishReason.TOOL_CALLS),
    ("max_tokens", FinishReason.LENGTH),
    ("refusal", FinishReason.CONTENT_FILTER),
])
def test_stop_reasons_map_to_finish_reasons(anthropic_server: AnthropicServer, provider: AnthropicProvider,
                                            stop_reason: str, finish: FinishReason) -> None:
    anthropic_server.enqueue(api.text("x", stop_reason=stop_reason))
    assert provider.complete(request(), CallControl()).finish_reason is finish


def test_usage_counts_cache_reads_and_writes_as_input(anthropic_server: AnthropicServer,
                                                      provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.text("x", usage_=api.usage(12, 34, cache_read=1000, cache_creation=200)))
    assert provider.complete(request(), CallControl()).usage == TokenUsage(
        input_tokens=1212, output_tokens=34, cached_input_tokens=1000, cache_write_input_tokens=200, calls=1)


# -- errors ----------------------------------------------------------------------------


def test_retry_after_may_be_an_http_date() -> None:
    wait = retry_after_seconds({"retry-after": time.strftime(
        "%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 120))})
    assert wait is not None and 100 < wait <= 120


@pytest.mark.parametrize("headers", [{}, {"retry-after": "soon"}, {"retry-after": "nan"},
                                     {"retry-after-ms": "inf"}])
def test_unreadable_retry_after_is_ignored(headers: dict[str, str]) -> None:
    assert retry_after_seconds(headers) is None


def test_a_past_retry_after_date_means_no_wait() -> None:
    assert retry_after_seconds({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0


@pytest.mark.parametrize(("body", "problem"), [
    (b"<html>502 Bad Gateway</html>", "not JSON"),  # served as application/json
    (b'{"type": "completion"}', "not a message"),
    (b'{"type": "message", "content": [{"type": "tool_use", "id": "t1", "name": "bash", '
     b'"input": {"command": NaN}}]}', "not JSON (NaN is not JSON)"),
], ids=["page-said-to-be-json", "not-a-message", "nan"])
def test_a_reply_that_is_no_message_is_a_retryable_failure(anthropic_server: AnthropicServer,
                                                           provider: AnthropicProvider, body: bytes,
                                                           problem: str) -> None:
    anthropic_server.enqueue(api.raw(body))
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert caught.value.retryable
    assert problem in str(caught.value)


# -- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    {"api_version": 1}, {"thinking": {"type": "enabled", "budget_tokens": 100}}, {"thinking": "on"},
])
def test_a_bad_value_of_an_anthropic_setting_is_refused_naming_it(anthropic_server: AnthropicServer,
                                                                  extra: dict[str, Any]) -> None:
    with pytest.raises(ProviderConfigError, match=next(iter(extra))):
        build_provider(settings(anthropic_server, **extra))


# -- record and replay -----------------------------------------------------------------

DOC = parse_harness({"name": "record-replay", "surfaces": [
    {"id": "prompt:system", "kind": "prompt", "content": "You are a careful test agent."},
]})
INSTRUCTION = "Write 'hello' into greeting.txt, then submit."


def run_episode(provider: Provider, workdir: Path) -> Any:
    workdir.mkdir()
    with LocalExecution(DOC, provider, {"episode_timeout_sec": 60}) as runtime:
        return runtime.run("greeting", INSTRUCTION, DirectoryShell(workdir, command_timeout_sec=10))


def test_a_recorded_episode_replays_the_same(anthropic_server: AnthropicServer,
                                             make_built: Callable[..., Provider], tmp_path: Path) -> None:
    recording = tmp_path / "calls.jsonl"
    anthropic_server.enqueue(
        api.error(429),  # recorded as a failed attempt; replay must skip it
        api.tool_use("write_file", ["greeting.txt"], id_="toolu_bad"),  # unparsed: a nudge follows
        api.tool_use("write_file", {"path": "greeting.txt", "content": "hello"}, id_="toolu_w",
                     text_="Writing the file.", usage_=api.usage(50, 20, cache_creation=40)),
        api.tool_use("submit", {"answer": "wrote greeting.txt"}, id_="toolu_s",
                     usage_=api.usage(10, 8, cache_read=90)),
    )
    recorded = run_episode(make_built(retry=FAST_RETRY, record=str(recording)), tmp_path / "live")
    assert recorded.stop_reason == "submitted"
    assert (tmp_path / "live" / "greeting.txt").read_text() == "hello"
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert ["error" in line for line in lines] == [True, False, False, False]

    replayer = build_provider({"kind": "scripted", "model": "x", "replay": str(recording)})
    try:
        replayed = run_episode(replayer, tmp_path / "replay")
    finally:
        replayer.close()
    assert (tmp_path / "replay" / "greeting.txt").read_text() == "hello"
    assert untimed(replayed.steps) == untimed(recorded.steps)
    assert (replayed.stop_reason, replayed.answer) == (recorded.stop_reason, recorded.answer)
    assert replayed.worker_usage == recorded.worker_usage
    assert [step.observation.is_error for step in recorded.steps] == [True, False, False]
    assert len(anthropic_server.requests) == 4


