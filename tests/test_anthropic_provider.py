"""The Anthropic provider, through the real `anthropic` SDK against a loopback server.

Nothing of the SDK is mocked: every test sends real HTTP to `AnthropicServer` (see
tests/anthropic_server.py), which answers from a queue and records what it received.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic_server as api
import pytest
import trio
from anthropic_server import AnthropicServer
from doubles import RecordingControl, untimed

from wmo_trio.episode.environment import LocalDirEnvironment
from wmo_trio.episode.runtime import EpisodeRuntime
from wmo_trio.harness import parse_harness
from wmo_trio.models import TokenUsage
from wmo_trio.providers import build_provider
from wmo_trio.providers.anthropic import AnthropicProvider
from wmo_trio.providers.base import (
    CallControl,
    FinishReason,
    Message,
    Provider,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ToolCall,
    ToolSpec,
)
from wmo_trio.providers.http import HTTPReply, retry_after_seconds

KEY_ENV = "WMO_TEST_ANTHROPIC_KEY"
BREAKPOINT = {"type": "ephemeral"}
FAST_RETRY = {"max_attempts": 6, "base_delay_s": 0.01, "max_delay_s": 0.05, "retry_after_cap_s": 0.05}
# A generous bound for things that would take many seconds (or an hour) if broken; real
# runs take a fraction of it even on a loaded two-core machine.
PROMPTLY_S = 5.0


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, api.API_KEY)


def settings(server: AnthropicServer, **extra: Any) -> dict[str, Any]:
    return {"kind": "anthropic", "model": "claude-test", "api_key_env": KEY_ENV,
            "base_url": server.base_url, **extra}


@pytest.fixture
def make_provider(anthropic_server: AnthropicServer) -> Iterator[Callable[..., AnthropicProvider]]:
    made: list[AnthropicProvider] = []

    def make(**extra: Any) -> AnthropicProvider:
        provider = AnthropicProvider.from_config(ProviderConfig(**settings(anthropic_server, **extra)))
        made.append(provider)
        return provider

    yield make
    for provider in made:
        provider.close()


@pytest.fixture
def provider(make_provider: Callable[..., AnthropicProvider]) -> AnthropicProvider:
    return make_provider()


@pytest.fixture
def make_built(anthropic_server: AnthropicServer) -> Iterator[Callable[..., Provider]]:
    """Providers from `build_provider`, i.e. wrapped in the retry policy."""
    made: list[Provider] = []

    def make(**extra: Any) -> Provider:
        provider = build_provider(settings(anthropic_server, **extra))
        made.append(provider)
        return provider

    yield make
    for provider in made:
        provider.close()


def request(*messages: Message, system: str = "You are a test.", tools: list[ToolSpec] | None = None,
            temperature: float | None = None, max_output_tokens: int = 256) -> ProviderRequest:
    return ProviderRequest(
        system=system,
        messages=list(messages) or [Message(role="user", content="hello")],
        tools=tools or [],
        max_output_tokens=max_output_tokens,
        temperature=temperature,
    )


def user(text: str) -> Message:
    return Message(role="user", content=text)


def call(call_id: str, name: str = "bash", arguments: dict[str, Any] | None = None) -> ToolCall:
    return ToolCall(id=call_id, name=name,
                    arguments=arguments if arguments is not None else {"command": "ls"})


def tool_result(call_id: str, text: str, is_error: bool = False) -> Message:
    return Message(role="tool", tool_call_id=call_id, content=text, is_error=is_error)


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


def interrupt_when(condition: Callable[[], bool], control: CallControl) -> threading.Thread:
    """A started thread that interrupts `control` (from outside, as an episode abort does)
    as soon as `condition()` holds."""

    def watch() -> None:
        limit = time.monotonic() + PROMPTLY_S
        while not condition() and time.monotonic() < limit:
            time.sleep(0.01)
        control.interrupt()

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


# -- request mapping -------------------------------------------------------------------


def test_system_prompt_is_sent_at_the_top_level(anthropic_server: AnthropicServer,
                                               provider: AnthropicProvider) -> None:
    body = sent(anthropic_server, provider, request(user("hi"), system="Be brief."))
    assert body["system"] == [{"type": "text", "text": "Be brief."}]
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert body["model"] == "claude-test"


def test_api_key_is_sent_to_the_server(anthropic_server: AnthropicServer,
                                       provider: AnthropicProvider) -> None:
    sent(anthropic_server, provider, request())
    headers = anthropic_server.requests[-1].headers
    assert api.API_KEY in (headers.get("x-api-key"), headers.get("authorization", "").removeprefix("Bearer "))


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


def test_max_tokens_is_max_output_tokens(anthropic_server: AnthropicServer,
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


def test_tool_use_blocks_become_tool_calls(anthropic_server: AnthropicServer,
                                           provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.message([
        api.text_block("Looking."),
        api.tool_use_block("bash", {"command": "ls -l"}, id_="toolu_a"),
        api.tool_use_block("read_file", {"path": "x"}, id_="toolu_b"),
    ], stop_reason="tool_use"))
    response = provider.complete(request(), CallControl())
    assert response.text == "Looking."
    assert response.tool_calls == [
        ToolCall(id="toolu_a", name="bash", arguments={"command": "ls -l"}),
        ToolCall(id="toolu_b", name="read_file", arguments={"path": "x"}),
    ]
    assert response.finish_reason is FinishReason.TOOL_CALLS


def test_a_tool_input_that_is_not_an_object_is_an_unparsed_call(anthropic_server: AnthropicServer,
                                                                 provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.tool_use("bash", ["ls"], id_="toolu_x"))
    [tool_call] = provider.complete(request(), CallControl()).tool_calls
    assert tool_call.arguments is None
    assert tool_call.raw_arguments == '["ls"]'
    assert tool_call.parse_error == "arguments are not a JSON object"


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


@pytest.mark.parametrize(("status", "retryable"), [
    (400, False), (401, False), (403, False), (404, False), (413, False), (422, False),
    (408, True), (409, True), (429, True), (500, True), (502, True), (503, True), (504, True), (529, True),
])
def test_status_errors_say_whether_a_retry_may_help(anthropic_server: AnthropicServer,
                                                    provider: AnthropicProvider,
                                                    status: int, retryable: bool) -> None:
    anthropic_server.enqueue(api.error(status, "nope"))
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert (caught.value.status, caught.value.retryable) == (status, retryable)
    assert "nope" in str(caught.value)
    assert len(anthropic_server.requests) == 1  # the SDK's own retries are off


def test_retry_after_ms_is_read_as_milliseconds(anthropic_server: AnthropicServer,
                                                provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.error(429, headers={"retry-after-ms": "1500", "retry-after": "9"}))
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert caught.value.retry_after == pytest.approx(1.5)


def test_retry_after_is_read_as_seconds(anthropic_server: AnthropicServer,
                                        provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.error(529, headers={"retry-after": "7"}))
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert caught.value.retry_after == 7.0


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


def test_a_dropped_connection_is_a_retryable_error(anthropic_server: AnthropicServer,
                                                   provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.dropped())
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert caught.value.retryable
    assert caught.value.status is None


NESTED_TOO_DEEPLY = b"[" * 100_000 + b"]" * 100_000  # what no JSON parser here goes into


@pytest.mark.parametrize(("body", "problem"), [
    (b'{"type": "message", "content": [', "not JSON"),
    (NESTED_TOO_DEEPLY, "not JSON (nested too deeply)"),
    (b"<html>502 Bad Gateway</html>", "not JSON"),
    (b'{"type": "completion"}', "not a message"),
    (b'{"type": "message", "content": [{"type": "tool_use", "id": "t1", "name": "bash", '
     b'"input": {"command": NaN}}]}', "not JSON (NaN is not JSON)"),
], ids=["broken", "too-deep", "web-page", "not-a-message", "nan"])
def test_a_reply_that_is_no_message_is_a_retryable_failure(anthropic_server: AnthropicServer,
                                                           provider: AnthropicProvider, body: bytes,
                                                           problem: str) -> None:
    anthropic_server.enqueue(api.raw(body))
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert caught.value.retryable
    assert problem in str(caught.value)


def test_a_reply_nested_too_deeply_is_retried(anthropic_server: AnthropicServer,
                                              make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(api.raw(NESTED_TOO_DEEPLY), api.text("readable"))
    assert make_built(retry=FAST_RETRY).complete(request(), CallControl()).text == "readable"
    assert len(anthropic_server.requests) == 2


def test_the_three_steps_of_a_call_can_be_driven_alone(anthropic_server: AnthropicServer,
                                                       provider: AnthropicProvider) -> None:
    # The trio thread serves every episode's calls: there, send only does the exchange, and
    # the body is parsed into the response in the worker thread.
    anthropic_server.enqueue(api.text("one step at a time"))
    body = provider.request_body(request())
    reply = trio.run(provider.send, body, 30.0)
    assert isinstance(reply, HTTPReply)
    assert anthropic_server.requests[-1].body == body  # the same body, however it was encoded
    assert json.loads(reply.body)["content"][0]["text"] == "one step at a time"
    assert provider.response(reply).text == "one step at a time"


def test_a_reply_slower_than_timeout_s_is_a_retryable_timeout(
        anthropic_server: AnthropicServer, make_provider: Callable[..., AnthropicProvider]) -> None:
    provider = make_provider(timeout_s=0.3)
    anthropic_server.enqueue(api.text("late").slow(30))
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(), CallControl())
    assert caught.value.retryable
    assert not isinstance(caught.value, ProviderInterrupted)
    assert time.monotonic() - started < PROMPTLY_S


def test_the_http_timeout_is_the_episode_remaining_budget(anthropic_server: AnthropicServer,
                                                          provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.text("ok"))
    provider.complete(request(), CallControl(deadline=time.monotonic() + 42))
    assert 30 < float(anthropic_server.requests[-1].headers["x-stainless-timeout"]) <= 42


def test_the_http_timeout_is_capped_by_timeout_s(anthropic_server: AnthropicServer,
                                                 make_provider: Callable[..., AnthropicProvider]) -> None:
    anthropic_server.enqueue(api.text("ok"))
    make_provider(timeout_s=7).complete(request(), CallControl(deadline=time.monotonic() + 1000))
    assert float(anthropic_server.requests[-1].headers["x-stainless-timeout"]) == 7


def test_an_interrupt_cancels_the_call_in_flight(anthropic_server: AnthropicServer,
                                                  provider: AnthropicProvider) -> None:
    anthropic_server.enqueue(api.text("never seen").slow(60))
    control = CallControl()
    interrupter = interrupt_when(lambda: bool(anthropic_server.requests), control)
    started = time.monotonic()
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), control)
    assert time.monotonic() - started < PROMPTLY_S
    interrupter.join()


def test_providers_of_one_configuration_share_a_client_per_trio_run(
        anthropic_server: AnthropicServer, make_provider: Callable[..., AnthropicProvider]) -> None:
    # One connection pool per process and configuration: two agents' providers reuse one
    # keep-alive connection; other settings get a client of their own.
    first, second, other = make_provider(), make_provider(), make_provider(timeout_s=99)
    anthropic_server.enqueue(*(api.text("ok") for _ in range(4)))

    async def main() -> None:
        for provider in (first, second, first, other):
            await trio.to_thread.run_sync(provider.complete, request(), CallControl())

    trio.run(main)
    ports = [recorded.client_port for recorded in anthropic_server.requests]
    assert ports[0] == ports[1] == ports[2] != ports[3]


def test_an_interrupted_control_sends_nothing(anthropic_server: AnthropicServer,
                                              provider: AnthropicProvider) -> None:
    control = CallControl()
    control.interrupt()
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), control)
    assert anthropic_server.requests == []


def test_a_spent_budget_sends_nothing(anthropic_server: AnthropicServer, provider: AnthropicProvider) -> None:
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), CallControl(deadline=time.monotonic() - 1))
    assert anthropic_server.requests == []


# -- configuration ---------------------------------------------------------------------


def test_a_missing_api_key_fails_at_construction_naming_the_variable(
        anthropic_server: AnthropicServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ProviderConfigError, match=KEY_ENV):
        build_provider(settings(anthropic_server))


def test_the_default_key_variable_is_anthropic_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ProviderConfigError, match="ANTHROPIC_API_KEY"):
        build_provider({"kind": "anthropic", "model": "claude-test"})


def test_an_unknown_setting_is_refused_naming_the_known_ones(anthropic_server: AnthropicServer) -> None:
    with pytest.raises(ProviderConfigError) as caught:
        build_provider(settings(anthropic_server, temprature=0.2))
    message = str(caught.value)
    assert "temprature" in message
    for known in ("api_key_env", "base_url", "timeout_s", "thinking", "max_connections", "api_version",
                  "retry", "record"):
        assert known in message


@pytest.mark.parametrize("extra", [
    {"timeout_s": 0}, {"timeout_s": "600"}, {"max_connections": 0}, {"base_url": ""}, {"api_version": 1},
    {"thinking": {"type": "enabled", "budget_tokens": 100}}, {"thinking": "on"}, {"api_key_env": ""},
])
def test_bad_setting_values_are_refused(anthropic_server: AnthropicServer, extra: dict[str, Any]) -> None:
    with pytest.raises(ProviderConfigError, match=next(iter(extra))):
        build_provider(settings(anthropic_server, **extra))


def test_base_url_defaults_to_anthropic_base_url(anthropic_server: AnthropicServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", anthropic_server.base_url)
    provider = build_provider({"kind": "anthropic", "model": "claude-test", "api_key_env": KEY_ENV})
    try:
        anthropic_server.enqueue(api.text("via env"))
        assert provider.complete(request(), CallControl()).text == "via env"
    finally:
        provider.close()


def test_max_connections_bounds_the_pool_and_still_serves_concurrent_calls(
        anthropic_server: AnthropicServer, make_provider: Callable[..., AnthropicProvider]) -> None:
    provider = make_provider(max_connections=2)
    anthropic_server.enqueue(*(api.text("ok").slow(0.05) for _ in range(6)))
    results: list[str] = []

    def one() -> None:
        results.append(provider.complete(request(), CallControl()).text)

    workers = [threading.Thread(target=one) for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert results == ["ok"] * 6


def test_close_is_idempotent_and_later_calls_fail(anthropic_server: AnthropicServer,
                                                  provider: AnthropicProvider) -> None:
    provider.close()
    provider.close()
    with pytest.raises(ProviderError, match="closed"):
        provider.complete(request(), CallControl())
    assert anthropic_server.requests == []


# -- with wmo_trio's retry policy (build_provider) ---------------------------------------


def test_a_429_storm_is_ridden_out(anthropic_server: AnthropicServer,
                                   make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(*(api.error(429) for _ in range(4)), api.text("finally"))
    response = make_built(retry=FAST_RETRY).complete(request(), CallControl())
    assert response.text == "finally"
    assert len(anthropic_server.requests) == 5


def test_an_hour_long_retry_after_is_capped(anthropic_server: AnthropicServer,
                                            make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(api.error(429, headers={"retry-after": "3600"}), api.text("ok"))
    provider = make_built(retry={**FAST_RETRY, "retry_after_cap_s": 0.2})
    # With a budget, an uncapped wait fails fast (it would outlast the budget) instead of
    # sleeping for the hour.
    control = RecordingControl(deadline=time.monotonic() + 60)
    started = time.monotonic()
    assert provider.complete(request(), control).text == "ok"
    assert control.sleeps == [0.2]
    assert time.monotonic() - started < PROMPTLY_S


def test_a_cancel_during_backoff_returns_promptly(anthropic_server: AnthropicServer,
                                                  make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(api.error(429, headers={"retry-after": "20"}), api.text("too late"))
    provider = make_built(retry={"retry_after_cap_s": 20})
    control = RecordingControl()
    interrupter = interrupt_when(lambda: bool(control.sleeps), control)  # i.e. in the backoff
    started = time.monotonic()
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), control)
    assert time.monotonic() - started < PROMPTLY_S
    assert control.sleeps == [20]
    assert len(anthropic_server.requests) == 1
    interrupter.join()


def test_a_400_is_not_retried(anthropic_server: AnthropicServer, make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(api.error(400, "bad request"), api.text("unused"))
    with pytest.raises(ProviderError) as caught:
        make_built(retry=FAST_RETRY).complete(request(), CallControl())
    assert caught.value.status == 400
    assert len(anthropic_server.requests) == 1


def test_a_dropped_connection_is_retried(anthropic_server: AnthropicServer,
                                         make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(api.dropped(), api.text("second try"))
    assert make_built(retry=FAST_RETRY).complete(request(), CallControl()).text == "second try"
    assert len(anthropic_server.requests) == 2


def test_retries_stop_at_max_attempts(anthropic_server: AnthropicServer,
                                      make_built: Callable[..., Provider]) -> None:
    anthropic_server.enqueue(*(api.error(529) for _ in range(5)))
    with pytest.raises(ProviderError) as caught:
        make_built(retry={**FAST_RETRY, "max_attempts": 3}).complete(request(), CallControl())
    assert caught.value.status == 529
    assert len(anthropic_server.requests) == 3


# -- record and replay -----------------------------------------------------------------

DOC = parse_harness({"name": "record-replay", "surfaces": [
    {"id": "prompt:system", "kind": "prompt", "content": "You are a careful test agent."},
]})
INSTRUCTION = "Write 'hello' into greeting.txt, then submit."


def run_episode(provider: Provider, workdir: Path) -> Any:
    workdir.mkdir()
    runtime = EpisodeRuntime(DOC, provider, episode_timeout_s=60)
    try:
        return runtime.run("greeting", INSTRUCTION, LocalDirEnvironment(workdir, command_timeout_sec=10))
    finally:
        runtime.close()


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


def test_a_lone_surrogate_in_a_reply_becomes_a_replacement_character(
        anthropic_server: AnthropicServer, provider: AnthropicProvider) -> None:
    # As the openai provider does: such a string could not be sent back, recorded or traced.
    anthropic_server.enqueue(api.message([api.text_block("half \ud800 pair"),
                                          api.tool_use_block("bash", {"command": "echo \udc00"})],
                                         stop_reason="tool_use"))
    response = provider.complete(request(), CallControl())
    assert response.text == "half \ufffd pair"
    assert response.tool_calls[0].arguments == {"command": "echo \ufffd"}


def test_a_reply_without_usage_counts_no_tokens(anthropic_server: AnthropicServer,
                                                provider: AnthropicProvider) -> None:
    reply = api.text("ok")
    body = {key: value for key, value in dict(reply.body or {}).items() if key != "usage"}
    anthropic_server.enqueue(api.Reply(200, body))
    assert provider.complete(request(), CallControl()).usage == TokenUsage(calls=1)
