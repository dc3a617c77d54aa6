"""The OpenAI-compatible provider, through the real `openai` SDK against a loopback server.

Nothing of the SDK is mocked: every test sends real HTTP to `ChatCompletionsServer` (see
tests/openai_server.py), which answers from a queue, records what it received, and plays
the unfaithful servers real users point the provider at (broken tool-call arguments,
missing usage, 429s, 5xx storms, connection resets). What every HTTP provider does alike
(errors, retries, budgets, interrupts, the pool, the shared settings) is in
tests/test_provider_contract.py; here is what only this one does.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai_server as api
import pytest
from console_scripts import run_in_one_process
from doubles import untimed
from openai_server import ChatCompletionsServer
from provider_wires import (
    FAST_RETRY,
    NESTED_TOO_DEEPLY,
    call,
    closing_all,
    count_root_loads,
    request,
    tool_result,
    user,
)

from wmo_trio.episode._environment import DirectoryShell
from wmo_trio.episode._execution import LocalExecution
from wmo_trio.harness import parse_harness
from wmo_trio.models import RunResult, TokenUsage
from wmo_trio.providers import build_provider
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
from wmo_trio.providers._openai import OpenAIProvider
from wmo_trio.trace import FinishedTrace

KEY_ENV = "WMO_TEST_OPENAI_KEY"


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, api.API_KEY)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


@pytest.fixture
def server() -> Iterator[ChatCompletionsServer]:
    with ChatCompletionsServer() as running:
        yield running


@pytest.fixture
def keyless_server() -> Iterator[ChatCompletionsServer]:
    """A server that takes no key, like a local vLLM started without --api-key."""
    with ChatCompletionsServer(api_key=None) as running:
        yield running


def settings(server: ChatCompletionsServer, **extra: Any) -> dict[str, Any]:
    return {"kind": "openai", "model": api.MODEL, "api_key_env": KEY_ENV,
            "base_url": server.base_url, **extra}


@pytest.fixture
def make_provider(server: ChatCompletionsServer) -> Iterator[Callable[..., OpenAIProvider]]:
    yield from closing_all(
        lambda **extra: OpenAIProvider.from_config(ProviderConfig(**settings(server, **extra))))


@pytest.fixture
def provider(make_provider: Callable[..., OpenAIProvider]) -> OpenAIProvider:
    return make_provider()


@pytest.fixture
def make_built(server: ChatCompletionsServer) -> Iterator[Callable[..., Provider]]:
    """Providers from `build_provider`, i.e. wrapped in the retry policy."""
    yield from closing_all(lambda **extra: build_provider(settings(server, **extra)))


def sent(server: ChatCompletionsServer, provider: OpenAIProvider, req: ProviderRequest) -> dict[str, Any]:
    """The body the provider sends for `req`."""
    server.enqueue(api.text("ok"))
    provider.complete(req, CallControl())
    body: dict[str, Any] = server.bodies[-1]
    return body


def answer(server: ChatCompletionsServer, provider: Provider, reply: api.Reply) -> Any:
    server.enqueue(reply)
    return provider.complete(request(), CallControl())


def closed_port() -> socket.socket:
    """A socket bound to a loopback port and not listening: connecting to it is refused,
    and no other process can take the port while the socket is held."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held


# -- request mapping -------------------------------------------------------------------


def test_the_system_prompt_is_the_first_message(server: ChatCompletionsServer,
                                                provider: OpenAIProvider) -> None:
    body = sent(server, provider, request(user("hi"), system="Be brief."))
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert body["model"] == api.MODEL
    assert server.completions[-1].path == "/v1/chat/completions"


def test_a_blank_system_prompt_sends_no_system_message(server: ChatCompletionsServer,
                                                        provider: OpenAIProvider) -> None:
    body = sent(server, provider, request(user("hi"), system="  \n"))
    assert [m["role"] for m in body["messages"]] == ["user"]


def test_tool_specs_are_sent_as_function_tools(server: ChatCompletionsServer,
                                               provider: OpenAIProvider) -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    body = sent(server, provider, request(
        tools=[ToolSpec(name="bash", description="Run a command.", parameters=schema)]))
    assert body["tools"] == [{"type": "function", "function": {
        "name": "bash", "description": "Run a command.", "parameters": schema}}]


def test_no_tools_sends_no_tools_field(server: ChatCompletionsServer, provider: OpenAIProvider) -> None:
    assert "tools" not in sent(server, provider, request())


def test_assistant_tool_calls_and_their_results_are_sent_in_order(server: ChatCompletionsServer,
                                                                  provider: OpenAIProvider) -> None:
    body = sent(server, provider, request(
        user("go"),
        Message(role="assistant", content="Looking first.", tool_calls=[
            call("c1", "bash", {"command": "ls"}, raw='{"command":  "ls"}'),
            call("c2", "read_file", {"path": "a.txt"}),
        ]),
        tool_result("c1", "a.txt"), tool_result("c2", "boom", is_error=True), user("nudge"),
    ))
    assert body["messages"][1:] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Looking first.", "tool_calls": [
            # The model's own text goes back unchanged, so a prefix cache still matches.
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command":  "ls"}'}},
            {"id": "c2", "type": "function", "function": {"name": "read_file",
                                                          "arguments": '{"path":"a.txt"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "boom"},
        {"role": "user", "content": "nudge"},
    ]


def test_an_unparsed_tool_call_goes_back_with_empty_object_arguments(server: ChatCompletionsServer,
                                                                     provider: OpenAIProvider) -> None:
    # Servers that re-parse the history (vLLM for its chat templates) refuse invalid JSON
    # there, which would fail every later turn of an episode that could recover.
    unparsed = ToolCall(id="c1", name="write_file", arguments=None, raw_arguments='{"path": ',
                        parse_error="invalid JSON: Expecting value")
    body = sent(server, provider, request(
        user("go"), Message(role="assistant", content="", tool_calls=[unparsed]),
        tool_result("c1", "invalid write_file arguments"),
    ))
    assert body["messages"][2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": "{}"}}]}


def test_an_assistant_message_without_tool_calls_is_plain_text(server: ChatCompletionsServer,
                                                               provider: OpenAIProvider) -> None:
    body = sent(server, provider, request(
        user("go"), Message(role="assistant", content=""), user("call a tool")))
    assert body["messages"][1:] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "call a tool"},
    ]


def test_a_tool_message_without_a_call_id_is_refused_before_sending(server: ChatCompletionsServer,
                                                                    provider: OpenAIProvider) -> None:
    with pytest.raises(ProviderError, match="tool_call_id"):
        provider.complete(request(user("go"), Message(role="tool", content="x")), CallControl())
    assert server.completions == []


def test_max_output_tokens_is_max_tokens_by_default(server: ChatCompletionsServer,
                                                    provider: OpenAIProvider) -> None:
    body = sent(server, provider, request(max_output_tokens=777))
    assert body["max_tokens"] == 777
    assert "max_completion_tokens" not in body


def test_max_tokens_field_selects_max_completion_tokens(server: ChatCompletionsServer,
                                                        make_provider: Callable[..., OpenAIProvider]) -> None:
    provider = make_provider(max_tokens_field="max_completion_tokens")
    body = sent(server, provider, request(max_output_tokens=99))
    assert body["max_completion_tokens"] == 99
    assert "max_tokens" not in body


def test_temperature_is_sent_when_set_and_left_out_when_none(server: ChatCompletionsServer,
                                                             provider: OpenAIProvider) -> None:
    assert sent(server, provider, request(temperature=0.3))["temperature"] == 0.3
    assert "temperature" not in sent(server, provider, request(temperature=None))


def test_send_temperature_false_leaves_it_out(server: ChatCompletionsServer,
                                              make_provider: Callable[..., OpenAIProvider]) -> None:
    assert "temperature" not in sent(server, make_provider(send_temperature=False), request(temperature=0.3))


def test_extra_body_fields_join_the_request(server: ChatCompletionsServer,
                                            make_provider: Callable[..., OpenAIProvider]) -> None:
    extra = {"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}, "tool_choice": "required"}
    body = sent(server, make_provider(extra_body=extra), request(temperature=0.5))
    assert {key: body[key] for key in extra} == extra
    assert body["temperature"] == 0.5 and body["max_tokens"] == 256


def test_headers_are_sent_with_every_request(server: ChatCompletionsServer,
                                             make_provider: Callable[..., OpenAIProvider]) -> None:
    provider = make_provider(headers={"HTTP-Referer": "https://example.org", "X-Title": "wmo"})
    sent(server, provider, request())
    headers = server.completions[-1].headers
    assert (headers["http-referer"], headers["x-title"]) == ("https://example.org", "wmo")
    assert headers["authorization"] == f"Bearer {api.API_KEY}"


def test_without_a_key_no_authorization_header_is_sent(keyless_server: ChatCompletionsServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK would read OPENAI_API_KEY by itself and send it to whatever server this is.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    provider = build_provider({"kind": "openai", "model": api.MODEL, "base_url": keyless_server.base_url,
                               "api_key_env": None})
    with provider:
        keyless_server.enqueue(api.text("no key needed"))
        assert provider.complete(request(), CallControl()).text == "no key needed"
    assert all("authorization" not in r.headers for r in keyless_server.requests)


# -- response mapping ------------------------------------------------------------------


def test_arguments_that_are_not_json_give_an_unparsed_call(server: ChatCompletionsServer,
                                                           provider: OpenAIProvider) -> None:
    response = answer(server, provider, api.tool_calls(
        api.tool_call("write_file", '{"path": "a.txt", "content": "unterminated', id_="bad"),
        api.tool_call("bash", {"command": "ls"}, id_="good")))
    bad, good = response.tool_calls
    assert bad.arguments is None
    assert bad.raw_arguments == '{"path": "a.txt", "content": "unterminated'
    assert bad.parse_error is not None and bad.parse_error.startswith("invalid JSON: ")
    assert good.arguments == {"command": "ls"} and good.parse_error is None


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_arguments_with_a_number_json_does_not_have_give_an_unparsed_call(
        server: ChatCompletionsServer, provider: OpenAIProvider, constant: str) -> None:
    # Python's parser takes these; a call holding one could never be sent back to the model.
    arguments = '{"command": ' + constant + "}"
    [tool_call] = answer(server, provider, api.tool_calls(api.tool_call("bash", arguments))).tool_calls
    assert (tool_call.arguments, tool_call.raw_arguments) == (None, arguments)
    assert tool_call.parse_error == f"invalid JSON: {constant} is not JSON"


# A list or a number is in the contract suite; a string or null as the Messages API's tool
# input is read otherwise, so these two are this provider's own.
@pytest.mark.parametrize("arguments", ['"ls"', "null"])
def test_arguments_that_are_a_json_string_or_null_give_an_unparsed_call(
        server: ChatCompletionsServer, provider: OpenAIProvider, arguments: str) -> None:
    [tool_call] = answer(server, provider, api.tool_calls(api.tool_call("bash", arguments))).tool_calls
    assert (tool_call.arguments, tool_call.raw_arguments) == (None, arguments)
    assert tool_call.parse_error == "arguments are not a JSON object"


def test_arguments_sent_as_an_object_are_taken_as_they_are(server: ChatCompletionsServer,
                                                           provider: OpenAIProvider) -> None:
    raw_call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
    [tool_call] = answer(server, provider, api.tool_calls(raw_call)).tool_calls
    assert tool_call.arguments == {"command": "ls"}


@pytest.mark.parametrize("arguments", ["", "  ", None])
def test_empty_arguments_are_a_call_without_arguments(server: ChatCompletionsServer,
                                                      provider: OpenAIProvider, arguments: Any) -> None:
    raw_call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    [tool_call] = answer(server, provider, api.tool_calls(raw_call)).tool_calls
    assert (tool_call.arguments, tool_call.parse_error) == ({}, None)


def test_missing_and_repeated_call_ids_are_made_distinct(server: ChatCompletionsServer,
                                                         provider: OpenAIProvider) -> None:
    response = answer(server, provider, api.tool_calls(
        {"function": {"name": "bash", "arguments": '{"command": "a"}'}},
        {"id": "same", "function": {"name": "bash", "arguments": '{"command": "b"}'}},
        {"id": "same", "function": {"name": "bash", "arguments": '{"command": "c"}'}}))
    ids = [c.id for c in response.tool_calls]
    assert len(set(ids)) == 3 and all(ids) and ids[1] == "same"
    assert [c.arguments for c in response.tool_calls] == [
        {"command": "a"}, {"command": "b"}, {"command": "c"}]


def test_deeply_nested_arguments_give_an_unparsed_call(server: ChatCompletionsServer,
                                                      provider: OpenAIProvider) -> None:
    nested = "[" * 100_000 + "]" * 100_000
    [tool_call] = answer(server, provider, api.tool_calls(api.tool_call("bash", nested))).tool_calls
    assert (tool_call.arguments, tool_call.parse_error) == (None, "invalid JSON: nested too deeply")


@pytest.mark.parametrize(("finish_reason", "with_calls", "finish"), [
    ("stop", False, FinishReason.STOP),
    ("length", False, FinishReason.LENGTH),
    ("length", True, FinishReason.LENGTH),
    ("content_filter", False, FinishReason.CONTENT_FILTER),
    ("tool_calls", True, FinishReason.TOOL_CALLS),
    ("function_call", True, FinishReason.TOOL_CALLS),
    ("stop", True, FinishReason.STOP),  # vLLM and others say stop after tool calls
    (None, False, FinishReason.STOP),
    (None, True, FinishReason.TOOL_CALLS),
    ("eos", False, FinishReason.STOP),
    ("abort", True, FinishReason.TOOL_CALLS),
])
def test_the_finish_reason_is_mapped_and_a_missing_or_unknown_one_follows_the_tool_calls(
        server: ChatCompletionsServer, provider: OpenAIProvider, finish_reason: str | None, with_calls: bool,
        finish: FinishReason) -> None:
    calls = [api.tool_call("bash", {"command": "ls"})] if with_calls else []
    reply = api.completion({"content": "x", "tool_calls": calls or None}, finish_reason=finish_reason)
    assert answer(server, provider, reply).finish_reason is finish


def test_text_content_parts_are_joined_and_other_parts_left_out(server: ChatCompletionsServer,
                                                                provider: OpenAIProvider) -> None:
    reply = api.completion({"content": ["Hello, ", {"type": "text", "text": "world."}, {"type": "image"}]})
    assert answer(server, provider, reply).text == "Hello, world."


def test_a_refusal_is_the_text_and_a_content_filter_finish(server: ChatCompletionsServer,
                                                           provider: OpenAIProvider) -> None:
    response = answer(server, provider, api.completion({"content": None, "refusal": "I can't help."}))
    assert (response.text, response.finish_reason) == ("I can't help.", FinishReason.CONTENT_FILTER)


def test_reasoning_fields_are_left_out_of_the_text(server: ChatCompletionsServer,
                                                   provider: OpenAIProvider) -> None:
    reply = api.completion({"content": "Answer.", "reasoning_content": "secret", "reasoning": "secret"})
    assert answer(server, provider, reply).text == "Answer."


def test_cached_tokens_are_counted_within_the_input_tokens(server: ChatCompletionsServer,
                                                           provider: OpenAIProvider) -> None:
    response = answer(server, provider, api.text("x", usage_=api.usage(1200, 34, cached=1000)))
    assert response.usage == TokenUsage(
        input_tokens=1200, output_tokens=34, cached_input_tokens=1000, calls=1)


def test_deepseek_cache_hit_tokens_count_as_cached_input(server: ChatCompletionsServer,
                                                         provider: OpenAIProvider) -> None:
    reply = api.text("x", usage_={"prompt_tokens": 500, "completion_tokens": 7,
                                  "prompt_cache_hit_tokens": 300})
    assert answer(server, provider, reply).usage == TokenUsage(
        input_tokens=500, output_tokens=7, cached_input_tokens=300, calls=1)


@pytest.mark.parametrize("usage", [{}, {"prompt_tokens": None, "completion_tokens": -3},
                                   {"prompt_tokens": "many", "prompt_tokens_details": None}])
def test_empty_or_broken_usage_counts_the_call_with_zero_tokens(
        server: ChatCompletionsServer, provider: OpenAIProvider, usage: Any) -> None:
    response = answer(server, provider, api.text("still fine", usage_=usage))
    assert response.text == "still fine"
    assert response.usage == TokenUsage(calls=1)


@pytest.mark.parametrize("body", [
    {"choices": []},
    {"id": "x", "object": "chat.completion"},
    {"error": {"message": "upstream model failed", "code": 502}},
])
def test_a_reply_without_choices_is_a_retryable_failure(server: ChatCompletionsServer,
                                                         provider: OpenAIProvider, body: Any) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(server, provider, api.Reply(200, body))
    assert caught.value.retryable
    assert "without a choice" in str(caught.value)
    if "error" in body:
        assert "upstream model failed" in str(caught.value) and caught.value.status == 502


def test_a_reply_without_choices_with_a_client_error_code_is_not_retried(
        server: ChatCompletionsServer, provider: OpenAIProvider) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(server, provider, api.Reply(200, {"error": {"message": "context too long", "code": 400}}))
    assert (caught.value.status, caught.value.retryable) == (400, False)


def test_a_reply_that_is_a_web_page_names_base_url(server: ChatCompletionsServer,
                                                   provider: OpenAIProvider) -> None:
    # Not retried (tests/test_provider_contract.py); the kind says where it asked.
    with pytest.raises(ProviderError) as caught:
        answer(server, provider, api.raw(b"<html>Welcome to nginx</html>"))
    assert server.base_url in str(caught.value)


def test_json_that_is_not_an_object_is_no_chat_completion(server: ChatCompletionsServer,
                                                          provider: OpenAIProvider) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(server, provider, api.Reply(200, ["not", "a", "completion"]))
    assert not caught.value.retryable and "not a chat completion" in str(caught.value)


# -- errors ----------------------------------------------------------------------------


def test_an_error_page_that_is_not_json_is_quoted(server: ChatCompletionsServer,
                                                  provider: OpenAIProvider) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(server, provider, api.raw(b"<html>502 Bad Gateway</html>", status=502))
    assert caught.value.status == 502 and caught.value.retryable
    assert "502 Bad Gateway" in str(caught.value)


# -- with wmo_trio's retry policy (build_provider) ---------------------------------------


def test_usage_of_a_reply_without_choices_is_kept_across_the_retry(
        server: ChatCompletionsServer, make_built: Callable[..., Provider]) -> None:
    server.enqueue(api.Reply(200, {"choices": [], "usage": api.usage(100, 0)}),
                   api.text("ok", usage_=api.usage(100, 5)))
    response = make_built(retry=FAST_RETRY).complete(request(), CallControl())
    assert response.usage == TokenUsage(input_tokens=200, output_tokens=5, calls=2)


# -- configuration ---------------------------------------------------------------------


def test_a_missing_api_key_is_refused_suggesting_api_key_env_null_for_a_keyless_server(
        server: ChatCompletionsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ProviderConfigError, match=KEY_ENV) as caught:
        build_provider(settings(server))
    assert '"api_key_env": null' in str(caught.value)
    assert server.requests == []


def test_no_key_without_a_base_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ProviderConfigError, match="needs a base_url"):
        build_provider({"kind": "openai", "model": "m", "api_key_env": None})


def test_an_unreachable_base_url_fails_at_construction_naming_it() -> None:
    with closed_port() as held:
        base_url = f"http://127.0.0.1:{held.getsockname()[1]}/v1"
        with pytest.raises(ProviderConfigError) as caught:
            build_provider({"kind": "openai", "model": "m", "api_key_env": KEY_ENV, "base_url": base_url})
    message = str(caught.value)
    assert f"cannot reach base_url {base_url}" in message
    assert "ConnectionRefusedError" in message and "check_server" in message


def test_an_unreachable_base_url_may_skip_the_check() -> None:
    with closed_port() as held:
        base_url = f"http://127.0.0.1:{held.getsockname()[1]}/v1"
        built = build_provider({"kind": "openai", "model": "m", "api_key_env": KEY_ENV,
                                "base_url": base_url, "check_server": False, "retry": FAST_RETRY})
        with pytest.raises(ProviderError, match="connection failed") as caught:
            built.complete(request(), CallControl())
    assert caught.value.retryable


def test_a_server_that_wants_a_key_refuses_api_key_env_null(server: ChatCompletionsServer) -> None:
    with pytest.raises(ProviderConfigError, match="wants an API key") as caught:
        build_provider({**settings(server), "api_key_env": None})
    assert "api_key_env" in str(caught.value)


def test_a_wrong_key_is_refused_naming_its_variable(server: ChatCompletionsServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    with pytest.raises(ProviderConfigError, match=f"refused the API key in {KEY_ENV}"):
        build_provider(settings(server))


def test_a_base_url_without_the_api_path_is_refused_suggesting_v1(server: ChatCompletionsServer) -> None:
    root = server.base_url.removesuffix("/v1")
    with pytest.raises(ProviderConfigError, match="/v1") as caught:
        build_provider(settings(server, base_url=root))
    assert f"no OpenAI-compatible API at base_url {root}" in str(caught.value)


def test_the_server_is_checked_once_per_process_and_configuration(
        server: ChatCompletionsServer, make_provider: Callable[..., OpenAIProvider]) -> None:
    # Harbor's preflight builds the provider first, then every trial does: only the
    # first asks the server.
    make_provider(), make_provider(), make_provider(timeout_s=5)
    assert [(r.method, r.path) for r in server.requests] == [("GET", "/v1/models")]
    make_provider(headers={"X-Title": "other"})
    assert len(server.requests) == 2
    assert server.requests[1].headers["x-title"] == "other"


def test_a_check_of_another_server_loads_no_certificate_roots_again(
        server: ChatCompletionsServer, make_provider: Callable[..., OpenAIProvider],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The checks share the process's one TLS context with the SDK clients: loading the
    # roots is most of what a check would cost (for an http:// server too).
    make_provider()
    loads = count_root_loads(monkeypatch)
    make_provider(headers={"X-Title": "other"})  # another check, of another configuration
    assert loads == []
    assert [(r.method, r.path) for r in server.requests] == [("GET", "/v1/models")] * 2


def test_a_model_the_server_does_not_list_is_refused_naming_some_it_does() -> None:
    offered = ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-72B-Instruct", "meta-llama/Llama-3.1-8B",
               "mistral-7b", "phi-3", "gemma-2-9b", "deepseek-coder"]
    with ChatCompletionsServer(models=offered) as listing:
        with pytest.raises(ProviderConfigError) as caught:
            build_provider(settings(listing, model="Qwen/Qwen2.5-7B-Instruc"))
        requests = listing.requests
    message = str(caught.value)
    assert "does not serve model 'Qwen/Qwen2.5-7B-Instruc'" in message
    assert "'Qwen/Qwen2.5-7B-Instruct'" in message and "and 2 more" in message
    assert "-m openai/<model>" in message and "check_server" in message
    assert [(r.method, r.path) for r in requests] == [("GET", "/v1/models")]


def test_each_model_is_checked_against_the_list_asked_for_once(
        server: ChatCompletionsServer, make_provider: Callable[..., OpenAIProvider]) -> None:
    make_provider()
    with pytest.raises(ProviderConfigError, match="does not serve model 'other-model'"):
        make_provider(model="other-model")
    assert [(r.method, r.path) for r in server.requests] == [("GET", "/v1/models")]


@pytest.mark.parametrize("model", ["llama3", "llama3:latest", "qwen/qwen3-coder:nitro"])
def test_a_model_is_listed_under_the_names_servers_take_for_it(model: str) -> None:
    # Ollama takes `llama3` for the `llama3:latest` it lists; OpenRouter takes `:nitro` and
    # the like on any model it lists.
    with ChatCompletionsServer(models=["llama3:latest", "qwen/qwen3-coder"]) as listing:
        with build_provider(settings(listing, model=model)):
            pass


@pytest.mark.parametrize("reply", [
    api.raw(b"<html>models</html>"),
    api.raw(b'{"data": [', content_type="application/json"),
    api.Reply(200, {"object": "list"}),
    api.Reply(200, {"object": "list", "data": []}),
    api.Reply(200, {"data": [{"name": "no-id"}]}),
    api.Reply(200, ["test-model"]),
], ids=["web-page", "broken", "no-data", "empty", "no-ids", "not-an-object"])
def test_a_model_list_that_cannot_be_read_says_nothing(server: ChatCompletionsServer,
                                                       reply: api.Reply) -> None:
    server.models_reply = reply
    with build_provider(settings(server, model="any-model-at-all")):
        pass


def test_the_key_is_not_sent_across_a_redirect_to_another_host(
        server: ChatCompletionsServer, keyless_server: ChatCompletionsServer,
        caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = keyless_server.base_url.replace("127.0.0.1", "localhost") + "/models"
    server.redirects["/v1/models"] = elsewhere
    with caplog.at_level(logging.WARNING, logger="wmo_trio.providers._openai"):
        build_provider(settings(server, model="not-listed-anywhere")).close()
    assert keyless_server.requests == []  # not followed: neither the key nor the model went there
    assert [(r.method, r.path) for r in server.requests] == [("GET", "/v1/models")]
    assert any(elsewhere in record.getMessage() and "not followed" in record.getMessage()
               for record in caplog.records)


def test_a_redirect_within_the_server_is_followed_with_the_key(server: ChatCompletionsServer) -> None:
    server.redirects["/v1/models"] = "/v1/models?page=1"
    with pytest.raises(ProviderConfigError, match="does not serve model 'not-listed'"):
        build_provider(settings(server, model="not-listed"))
    asked, followed = server.requests
    assert asked.path == "/v1/models" and followed.path == "/v1/models?page=1"
    assert followed.headers["authorization"] == f"Bearer {api.API_KEY}"


@pytest.mark.parametrize("extra", [
    {"base_url": "localhost:8000/v1"}, {"base_url": "ftp://example.org/v1"}, {"base_url": "http://[::1/v1"},
    {"max_tokens_field": "max_new_tokens"}, {"send_temperature": "no"},
    {"headers": {"Authorization": "Bearer sk-in-a-config-file"}}, {"headers": {"X-Title": 1}},
    {"headers": {"bad name": "x"}}, {"headers": {"X-Title": "a\r\nInjected: yes"}},
    {"extra_body": {"messages": []}}, {"extra_body": {"stream": True}}, {"extra_body": {"max_tokens": 5}},
    {"extra_body": "top_k=20"}, {"extra_body": {"top_k": float("nan")}}, {"check_server": 0},
])
def test_a_bad_value_of_an_openai_setting_is_refused_naming_it_before_any_request(
        server: ChatCompletionsServer, extra: dict[str, Any]) -> None:
    with pytest.raises(ProviderConfigError, match=next(iter(extra))):
        build_provider(settings(server, **extra))
    assert server.requests == []


def test_a_key_put_in_headers_is_refused_without_quoting_it(server: ChatCompletionsServer) -> None:
    with pytest.raises(ProviderConfigError, match="api_key_env") as caught:
        build_provider(settings(server, headers={"authorization": "Bearer sk-secret-value"}))
    assert "sk-secret-value" not in str(caught.value)


def test_building_a_provider_imports_no_sdk() -> None:
    # The SDK is imported, and its client built, in a worker thread on the first call:
    # never where a provider is built (harbor's event loop, for each trial's agent).
    script = ("import sys\n"
              "from wmo_trio.providers import build_provider\n"
              "build_provider({'kind': 'openai', 'model': 'm', 'api_key_env': None,\n"
              "                'base_url': 'http://127.0.0.1:9/v1', 'check_server': False})\n"
              "assert 'openai' not in sys.modules and 'httpx2' not in sys.modules, 'imported'\n")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr


# -- whole episodes: each unfaithful reply becomes what the contract says ------------------

DOC = parse_harness({"name": "openai-episodes", "surfaces": [
    {"id": "prompt:system", "kind": "prompt", "content": "You are a careful test agent."},
]})
INSTRUCTION = "Write 'hello' into greeting.txt, then submit."


def run_episode(provider: Provider, workdir: Path) -> RunResult:
    workdir.mkdir()
    with LocalExecution(DOC, provider, {"episode_timeout_sec": 60}) as runtime:
        return runtime.run("greeting", INSTRUCTION, DirectoryShell(workdir, command_timeout_sec=10))


def test_an_episode_recovers_from_broken_arguments_and_runs_every_call_of_a_reply(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(
        api.tool_calls(api.tool_call("write_file", '{"path": "greeting.txt", "content": "hel', id_="c1")),
        api.tool_calls(api.tool_call("write_file", {"path": "greeting.txt", "content": "hello"}, id_="c2"),
                       api.tool_call("bash", {"command": "cat greeting.txt"}, id_="c3"),
                       text_="Writing, then checking."),
        api.tool_calls(api.tool_call("submit", {"answer": "done"}, id_="c4"), usage_=None),
    )
    result = run_episode(make_built(retry=FAST_RETRY), tmp_path / "work")
    assert (result.stop_reason, result.answer) == ("submitted", "done")
    assert (tmp_path / "work" / "greeting.txt").read_text() == "hello"
    nudge, write, cat, submit = result.steps
    assert submit.action.name == "submit"
    assert nudge.observation.is_error and "could not be parsed" in nudge.observation.content
    assert write.action.content == "Writing, then checking."
    assert (cat.action.name, cat.observation.content.strip()) == ("bash", "hello")
    # The model saw its broken call answered, as a tool message with the same id, then the nudge.
    second_turn = server.bodies[1]["messages"]
    assert second_turn[-2]["role"] == "tool" and second_turn[-2]["tool_call_id"] == "c1"
    assert "could not parse them (invalid JSON" in second_turn[-2]["content"]
    assert second_turn[-1] == {"role": "user", "content": nudge.observation.content}
    assert result.worker_usage == TokenUsage(input_tokens=20, output_tokens=10, calls=3)


def test_an_episode_whose_replies_are_cut_off_ends_as_output_truncated(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(*(api.text("I will now write a very long", finish_reason="length") for _ in range(3)))
    result = run_episode(make_built(retry=FAST_RETRY), tmp_path / "work")
    assert result.stop_reason == "output_truncated"
    assert result.worker_usage is not None and result.worker_usage.calls == 3


def test_an_episode_whose_server_stays_down_ends_as_provider_error_with_its_usage(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(api.tool_calls(api.tool_call("bash", {"command": "true"})),
                   *(api.error(503) for _ in range(3)))
    result = run_episode(make_built(retry={**FAST_RETRY, "max_attempts": 3}), tmp_path / "work")
    assert result.stop_reason == "provider_error"
    assert result.worker_usage is not None and result.worker_usage.calls == 1
    assert "503" in result.steps[-1].observation.content


def test_an_episode_goes_on_past_a_reply_with_lone_surrogates_and_records_it(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(
        api.tool_calls(api.tool_call("bash", {"command": "echo \ud800ok"}), text_="odd \udc00"),
        api.tool_calls(api.tool_call("submit", {"answer": "done"})),
    )
    recording = tmp_path / "calls.jsonl"
    result = run_episode(make_built(retry=FAST_RETRY, record=str(recording)), tmp_path / "work")
    assert (result.stop_reason, result.answer) == ("submitted", "done")
    assert result.steps[0].observation.content.strip() == "\ufffdok"
    assert len(recording.read_text(encoding="utf-8").splitlines()) == 2


# -- record and replay -----------------------------------------------------------------


def test_a_recorded_episode_replays_the_same_through_scripted(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    recording = tmp_path / "calls.jsonl"
    server.enqueue(
        api.error(429, headers={"retry-after": "0"}),  # recorded as a failed attempt; replay skips it
        api.tool_calls(api.tool_call("write_file", '["greeting.txt"]', id_="c_bad")),  # not an object
        api.tool_calls(api.tool_call("write_file", '{"path": "greeting.txt", "content": "hel', id_="c_cut")),
        api.tool_calls(api.tool_call("write_file", {"path": "greeting.txt", "content": "hello"}, id_="c_w"),
                       text_="Writing the file.", usage_=api.usage(50, 20, cached=40)),
        api.tool_calls(api.tool_call("submit", {"answer": "wrote greeting.txt"}, id_="c_s"), usage_=None),
    )
    recorded = run_episode(make_built(retry=FAST_RETRY, record=str(recording)), tmp_path / "live")
    assert recorded.stop_reason == "submitted"
    assert (tmp_path / "live" / "greeting.txt").read_text() == "hello"
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert ["error" in line for line in lines] == [True, False, False, False, False]

    replayer = build_provider({"kind": "scripted", "model": "x", "replay": str(recording)})
    try:
        replayed = run_episode(replayer, tmp_path / "replay")
    finally:
        replayer.close()
    assert (tmp_path / "replay" / "greeting.txt").read_text() == "hello"
    assert untimed(replayed.steps) == untimed(recorded.steps)
    assert (replayed.stop_reason, replayed.answer) == (recorded.stop_reason, recorded.answer)
    assert replayed.worker_usage == recorded.worker_usage
    assert [step.observation.is_error for step in recorded.steps] == [True, True, False, False]
    assert len(server.completions) == 5


def record_and_replay(make_built: Callable[..., Provider], tmp_path: Path,
                      **extra: Any) -> tuple[RunResult, RunResult]:
    """An episode run live with a recording, then replayed from it through `scripted`."""
    recording = tmp_path / "calls.jsonl"
    recorded = run_episode(make_built(record=str(recording), **extra), tmp_path / "live")
    replayer = build_provider({"kind": "scripted", "model": "x", "replay": str(recording)})
    try:
        return recorded, run_episode(replayer, tmp_path / "replay")
    finally:
        replayer.close()


def test_arguments_nested_too_deeply_replay_as_they_ran_live(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(
        api.tool_calls(api.tool_call("bash", NESTED_TOO_DEEPLY.decode(), id_="c_deep")),
        api.tool_calls(api.tool_call("submit", {"answer": "done"}, id_="c_s")),
    )
    recorded, replayed = record_and_replay(make_built, tmp_path, retry=FAST_RETRY)
    assert recorded.stop_reason == "submitted"
    answered = server.bodies[1]["messages"][-2]["content"]  # the call's tool message
    assert "could not parse them (invalid JSON: nested too deeply)" in answered
    assert untimed(replayed.steps) == untimed(recorded.steps)
    assert (replayed.stop_reason, replayed.worker_usage) == (recorded.stop_reason, recorded.worker_usage)


def test_a_replay_counts_the_calls_of_replies_without_choices(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(
        api.Reply(200, {"choices": [], "usage": api.usage(100, 0)}),  # counted, then retried
        api.tool_calls(api.tool_call("submit", {"answer": "done"}), usage_=api.usage(110, 5)),
    )
    recorded, replayed = record_and_replay(make_built, tmp_path, retry=FAST_RETRY)
    assert recorded.worker_usage == TokenUsage(input_tokens=210, output_tokens=5, calls=2)
    assert replayed.worker_usage == recorded.worker_usage
    assert (replayed.stop_reason, untimed(replayed.steps)) == (recorded.stop_reason, untimed(recorded.steps))


def test_a_turn_that_failed_live_fails_alike_on_replay(
        server: ChatCompletionsServer, make_built: Callable[..., Provider], tmp_path: Path) -> None:
    server.enqueue(
        api.tool_calls(api.tool_call("bash", {"command": "true"})),
        *(api.Reply(200, {"choices": [], "usage": api.usage(100, 0)}) for _ in range(2)),
    )
    recorded, replayed = record_and_replay(make_built, tmp_path, retry={**FAST_RETRY, "max_attempts": 2})
    assert recorded.stop_reason == "provider_error"
    assert recorded.worker_usage is not None and recorded.worker_usage.calls == 3
    assert replayed.worker_usage == recorded.worker_usage
    assert (replayed.stop_reason, untimed(replayed.steps)) == (recorded.stop_reason, untimed(recorded.steps))


# -- the command lines -------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def wmo_trio_environment(**env: str) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")}
    return {**environment, **env}


def run_arguments(*args: str) -> list[str]:
    """`wmo-trio run`'s arguments for the hello-file task, into ./jobs."""
    return ["run", "-o", "jobs", "-p", str(ROOT / "examples/tasks/hello-file"), *args]


def wmo_trio_run(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from wmo_trio.cli import main; main()", *run_arguments(*args)],
        cwd=cwd, capture_output=True, text=True, timeout=300, env=wmo_trio_environment(**env))


@pytest.mark.slow
def test_wmo_trio_run_refuses_a_missing_key_and_an_unreachable_server_in_one_line(tmp_path: Path) -> None:
    # Both refusals end before any job: one process runs the two commands, as its console
    # script would (tests/console_scripts.py), and pays the command line's start once.
    with closed_port() as held:
        unreachable_config = {"base_url": f"http://127.0.0.1:{held.getsockname()[1]}/v1", "api_key_env": None}
        missing_key, unreachable = run_in_one_process("wmo_trio.cli:main", "wmo-trio", [
            (run_arguments("-m", "openai/test-model"), wmo_trio_environment()),
            (run_arguments("-m", "openai/test-model", "--provider-config", json.dumps(unreachable_config)),
             wmo_trio_environment()),
        ], cwd=tmp_path, timeout=300)
    for completed, fragment in ((missing_key, "OPENAI_API_KEY"), (unreachable, "cannot reach base_url")):
        lines = [line for line in completed.stderr.splitlines() if line.strip()]
        assert completed.returncode == 2 and len(lines) == 1, completed.stderr
        assert fragment in lines[0]
    assert not (tmp_path / "jobs").exists()


# -- a real harbor trial through harbor's command line -------------------------------------

GREETING = {"path": "/app/greeting.txt", "content": "Hello from wmo_trio\n"}  # solves hello-file


@pytest.mark.harbor
def test_a_harbor_cli_trial_with_openai_model_runs_against_the_server(tmp_path: Path) -> None:
    from support.harbor_runs import harbor_run

    with ChatCompletionsServer() as server:
        server.enqueue(
            api.error(429, headers={"retry-after": "0"}),
            api.tool_calls(api.tool_call("write_file", '{"path": "/app/greeting.txt", "content": "Hel')),
            api.tool_calls(
                api.tool_call("write_file", GREETING),
                api.tool_call("bash", {"command": "cat /app/greeting.txt"}),
                text_="Writing the file, then reading it back.", usage_=api.usage(900, 40, cached=600)),
            api.tool_calls(api.tool_call("submit", {"answer": "wrote /app/greeting.txt"}), usage_=None),
        )
        provider_config = {"kind": "openai", "model": api.MODEL, "base_url": server.base_url,
                           "api_key_env": KEY_ENV}
        # The one trial here without --skip-model-parsing-and-provider-mapping: litellm
        # knows openai/<model>, so harbor maps the model to its provider before the job, and
        # the agent must still work as it does with the flag the README passes.
        [trial] = harbor_run(tmp_path / "jobs", ROOT / "examples/tasks/hello-file",
                             provider_config=provider_config, env={KEY_ENV: api.API_KEY},
                             litellm_lookup=True).trials()
        requests = server.requests

    assert (trial.reward, trial.exception_type) == (1.0, None), trial.describe()
    trace = trial.trace
    assert isinstance(trace, FinishedTrace) and trace.stop_reason == "submitted"
    assert [step.action.name for step in trace.steps] == [None, "write_file", "bash", "submit"]
    assert trace.steps[2].observation.content.strip() == "Hello from wmo_trio"
    # Usage reaches the trace and harbor's context, the cached tokens included.
    assert trace.worker_usage == TokenUsage(input_tokens=910, output_tokens=45, cached_input_tokens=600,
                                            calls=3)
    agent = trial.agent_result
    assert (agent["n_input_tokens"], agent["n_cache_tokens"], agent["n_output_tokens"]) == (910, 600, 45)
    # The server was checked once, before the first call; then one request per attempt.
    assert [(r.method, r.path) for r in requests] == [("GET", "/v1/models")] + [
        ("POST", "/v1/chat/completions")] * 4
    for recorded in requests[1:]:
        assert recorded.headers["authorization"] == f"Bearer {api.API_KEY}"
        assert recorded.body["model"] == api.MODEL
        assert recorded.body["temperature"] == 0.2  # the example document's param:temperature
        assert [t["function"]["name"] for t in recorded.body["tools"]] == [
            "bash", "read_file", "write_file", "submit", "read_skill"]  # the example has a skill


@pytest.mark.harbor
def test_wmo_trio_run_with_openai_model_runs_a_job_against_a_keyless_server(tmp_path: Path) -> None:
    with ChatCompletionsServer(api_key=None) as server:
        server.enqueue(
            api.tool_calls(
                api.tool_call("write_file", GREETING)),
            api.tool_calls(api.tool_call("submit", {"answer": "done"}), usage_=api.usage(300, 9, cached=256)),
        )
        completed = wmo_trio_run(
            "-m", f"openai/{api.MODEL}", "--job-name", "keyless", "-e", "wmo_trio.harbor:LocalEnvironment",
            "--provider-config", json.dumps({"base_url": server.base_url, "api_key_env": None}),
            cwd=tmp_path, env={})
        requests = server.requests
    assert completed.returncode == 0, completed.stderr[-3000:]
    [result_file] = (tmp_path / "jobs" / "keyless").glob("*/result.json")
    result = json.loads(result_file.read_text())
    assert result["verifier_result"]["rewards"]["reward"] == 1.0
    assert result["agent_result"]["metadata"]["stop_reason"] == "submitted"
    assert (result["agent_result"]["n_input_tokens"], result["agent_result"]["n_cache_tokens"]) == (310, 256)
    assert [(r.method, r.path) for r in requests] == [("GET", "/v1/models")] + [
        ("POST", "/v1/chat/completions")] * 2
    assert all("authorization" not in r.headers for r in requests)


Refusal = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def harbor_refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Refusal]:
    """`harbor run` of an openai model without its key, and without its server: each
    refusal (and where its jobs would be), from harbor's own command line as its console
    script runs it, the two one after another in one process (tests/console_scripts.py)."""
    from support.harbor_runs import harbor_env, harbor_run

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # a port nobody listens on once this is closed
        port = unused.getsockname()[1]
    provider_config = {"kind": "openai", "model": api.MODEL,
                       "base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": KEY_ENV}
    root = tmp_path_factory.mktemp("harbor-refusals")
    commands, jobs = [], {}
    for problem in ("no key", "no server"):
        jobs[problem] = root / problem / "jobs"
        job = harbor_run(jobs[problem], ROOT / "examples/tasks/hello-file", provider_config=provider_config)
        environment = harbor_env(**{KEY_ENV: api.API_KEY})
        environment.pop("OPENAI_BASE_URL", None)  # as the api_key fixture leaves the tests
        if problem == "no key":
            del environment[KEY_ENV]
        commands.append((job.argv[1:], environment))
    completed = run_in_one_process("harbor.cli.main:app", "harbor", commands, cwd=ROOT, timeout=300)
    return {problem: (done, jobs[problem]) for problem, done in zip(jobs, completed, strict=True)}


@pytest.mark.harbor
@pytest.mark.parametrize("problem", ["no key", "no server"])
def test_harbor_refuses_an_openai_model_it_cannot_use_before_any_trial(
        harbor_refusals: dict[str, Refusal], problem: str) -> None:
    # harbor's own CLI: the agent's preflight says what is wrong, once, and no trial starts.
    completed, jobs = harbor_refusals[problem]
    output = " ".join((completed.stdout + completed.stderr).split())  # harbor wraps its lines
    assert completed.returncode != 0, output[-3000:]
    expected = (f"no API key; set the environment variable {KEY_ENV}" if problem == "no key"
                else "cannot reach base_url")
    assert expected in output, output[-3000:]
    assert not list(jobs.glob("*/*/result.json"))  # no trial ran
