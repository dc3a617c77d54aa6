"""The contract every HTTP provider keeps, run once per provider kind.

Each test runs against the real SDK of each kind over loopback (see tests/provider_wires.py
for the wires, tests/anthropic_server.py and tests/openai_server.py for the servers). What
only one kind does (its request mapping, its reply shapes, its settings) is tested in
tests/test_anthropic_provider.py and tests/test_openai_provider.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
from doubles import RecordingControl
from provider_wires import (
    FAST_RETRY,
    NESTED_TOO_DEEPLY,
    PROMPTLY_S,
    WIRES,
    Wire,
    closing_all,
    count_root_loads,
    interrupt_when,
    request,
)

from wmo_trio.models import TokenUsage
from wmo_trio.providers import build_provider
from wmo_trio.providers._base import (
    CallControl,
    FinishReason,
    Provider,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
)
from wmo_trio.providers._http import HTTPProvider, HTTPReply

AnyHTTPProvider = HTTPProvider[Any]


@pytest.fixture(autouse=True)
def api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for wire_class in WIRES.values():
        monkeypatch.setenv(wire_class.key_env, wire_class.api_key)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


@pytest.fixture(params=sorted(WIRES))
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    with WIRES[request.param]() as running:
        yield running


@pytest.fixture
def make_provider(wire: Wire) -> Iterator[Callable[..., AnyHTTPProvider]]:
    yield from closing_all(
        lambda **extra: wire.provider_class.from_config(ProviderConfig(**wire.settings(**extra))))


@pytest.fixture
def provider(make_provider: Callable[..., AnyHTTPProvider]) -> AnyHTTPProvider:
    return make_provider()


@pytest.fixture
def make_built(wire: Wire) -> Iterator[Callable[..., Provider]]:
    """Providers from `build_provider`, i.e. wrapped in the retry policy."""
    yield from closing_all(lambda **extra: build_provider(wire.settings(**extra)))


def answer(wire: Wire, provider: Provider, reply: Any) -> Any:
    wire.enqueue(reply)
    return provider.complete(request(), CallControl())


# -- replies ---------------------------------------------------------------------------


def test_a_text_only_reply_is_its_text_with_no_calls_and_a_stop_finish(
        wire: Wire, provider: AnyHTTPProvider) -> None:
    response = answer(wire, provider, wire.text("Hello."))
    assert (response.text, response.tool_calls, response.finish_reason) == ("Hello.", [], FinishReason.STOP)


def test_text_and_several_tool_calls_in_one_reply_are_all_kept_in_order(
        wire: Wire, provider: AnyHTTPProvider) -> None:
    calls = [("c1", "bash", {"command": "ls -l"}), ("c2", "read_file", {"path": "x"}),
             ("c3", "submit", {"answer": "done"})]
    response = answer(wire, provider, wire.tool_calls(*calls, text="Looking."))
    assert response.text == "Looking."
    assert [(c.id, c.name, c.arguments, c.parse_error) for c in response.tool_calls] == [
        (id_, name, arguments, None) for id_, name, arguments in calls]
    # The model's own text is kept to be sent back unchanged; an object has no such text.
    assert [c.raw_arguments for c in response.tool_calls] == [
        json.dumps(arguments) if wire.arguments_as_text else None for _, _, arguments in calls]
    assert response.finish_reason is FinishReason.TOOL_CALLS


# A string or null as the Messages API's tool input is read otherwise (see
# tests/test_anthropic_provider.py), so those two stay with the openai tests.
@pytest.mark.parametrize("arguments", ['["ls"]', "42"])
def test_arguments_that_are_json_but_not_an_object_give_an_unparsed_call(
        wire: Wire, provider: AnyHTTPProvider, arguments: str) -> None:
    reply = wire.tool_calls(("c1", "bash", wire.arguments_from_json(arguments)))
    [tool_call] = answer(wire, provider, reply).tool_calls
    assert (tool_call.arguments, tool_call.raw_arguments) == (None, arguments)
    assert tool_call.parse_error == "arguments are not a JSON object"


def test_lone_surrogates_in_a_reply_become_replacement_characters(wire: Wire,
                                                                  provider: AnyHTTPProvider) -> None:
    # JSON may escape half of a surrogate pair; such a string could not be sent back,
    # recorded or traced.
    response = answer(wire, provider, wire.tool_calls(
        ("c1", "bash", {"command": "echo \ud800ok", "\udfff": "x"}), text="odd \udc00 text"))
    assert response.text == "odd \ufffd text"
    assert response.tool_calls[0].arguments == {"command": "echo \ufffdok", "\ufffd": "x"}
    assert "\ud800" not in (response.tool_calls[0].raw_arguments or "")


def test_a_reply_without_usage_counts_the_call_with_zero_tokens(wire: Wire,
                                                                provider: AnyHTTPProvider) -> None:
    response = answer(wire, provider, wire.text("still fine", with_usage=False))
    assert response.text == "still fine"
    assert response.usage == TokenUsage(calls=1)


def test_the_three_steps_of_a_call_can_be_driven_alone(wire: Wire, provider: AnyHTTPProvider) -> None:
    # The trio thread serves every episode's calls: there, send only does the exchange, and
    # the body is parsed into the response in the worker thread.
    wire.enqueue(wire.text("one step at a time"))
    body = provider.request_body(request())
    reply = trio.run(provider.send, body, 30.0)
    assert isinstance(reply, HTTPReply) and reply.content_type == "application/json"
    assert wire.calls[-1].body == body  # the same body, however it was encoded
    assert wire.reply_text(reply.body) == "one step at a time"
    assert provider.response(reply).text == "one step at a time"


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "retryable"), [
    (400, False), (401, False), (403, False), (404, False), (413, False), (422, False),
    (408, True), (409, True), (429, True), (500, True), (502, True), (503, True), (504, True), (529, True),
])
def test_status_errors_say_whether_a_retry_may_help(wire: Wire, provider: AnyHTTPProvider,
                                                    status: int, retryable: bool) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.error(status, "nope"))
    assert (caught.value.status, caught.value.retryable) == (status, retryable)
    assert "nope" in str(caught.value)
    assert len(wire.calls) == 1  # the SDK's own retries are off


def test_retry_after_is_read_as_seconds(wire: Wire, provider: AnyHTTPProvider) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.error(529, headers={"retry-after": "7"}))
    assert caught.value.retry_after == 7.0


def test_retry_after_ms_is_read_as_milliseconds(wire: Wire, provider: AnyHTTPProvider) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.error(429, headers={"retry-after-ms": "1500", "retry-after": "9"}))
    assert caught.value.retry_after == pytest.approx(1.5)


@pytest.mark.parametrize("failure", ["reset", "dropped"])
def test_a_broken_connection_is_a_retryable_error(wire: Wire, provider: AnyHTTPProvider,
                                                  failure: str) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.reset() if failure == "reset" else wire.dropped())
    assert caught.value.retryable
    assert caught.value.status is None
    assert "connection failed" in str(caught.value)


def test_a_reply_that_is_a_web_page_is_a_failure_naming_what_came_and_base_url(
        wire: Wire, provider: AnyHTTPProvider) -> None:
    # One rule for every kind (wmo_trio.providers._http.reply_json): the same server would
    # send the same page, and neither SDK retries a 200 whatever its body.
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.raw(b"<html>Welcome to nginx</html>", content_type="text/html"))
    assert not caught.value.retryable
    assert "text/html" in str(caught.value) and "nginx" in str(caught.value)
    assert "base_url" in str(caught.value)


@pytest.mark.parametrize(("body", "problem"), [
    (b'{"choices": [', "not JSON"),
    (NESTED_TOO_DEEPLY, "not JSON (nested too deeply)"),
], ids=["broken", "too-deep"])
def test_a_json_reply_that_cannot_be_read_is_a_retryable_failure(
        wire: Wire, provider: AnyHTTPProvider, body: bytes, problem: str) -> None:
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.raw(body))
    assert caught.value.retryable
    assert problem in str(caught.value)


def test_a_reply_slower_than_timeout_s_is_a_retryable_timeout(
        wire: Wire, make_provider: Callable[..., AnyHTTPProvider]) -> None:
    provider = make_provider(timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        answer(wire, provider, wire.text("late").slow(30))
    assert caught.value.retryable
    assert not isinstance(caught.value, ProviderInterrupted)
    assert time.monotonic() - started < PROMPTLY_S


# -- budgets, interrupts and the connection pool ---------------------------------------


def test_the_http_timeout_is_the_episode_remaining_budget(wire: Wire, provider: AnyHTTPProvider) -> None:
    wire.enqueue(wire.text("ok"))
    provider.complete(request(), CallControl(deadline=time.monotonic() + 42))
    assert 30 < float(wire.calls[-1].headers[wire.timeout_header]) <= 42


def test_the_http_timeout_is_capped_by_timeout_s(wire: Wire,
                                                 make_provider: Callable[..., AnyHTTPProvider]) -> None:
    wire.enqueue(wire.text("ok"))
    make_provider(timeout_s=7).complete(request(), CallControl(deadline=time.monotonic() + 1000))
    assert float(wire.calls[-1].headers[wire.timeout_header]) == 7


def test_an_interrupt_cancels_the_call_in_flight(wire: Wire, provider: AnyHTTPProvider) -> None:
    wire.enqueue(wire.text("never seen").slow(60))
    control = CallControl()
    interrupter = interrupt_when(lambda: bool(wire.calls), control)
    started = time.monotonic()
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), control)
    assert time.monotonic() - started < PROMPTLY_S
    interrupter.join()


def test_an_interrupt_cancels_the_call_in_flight_on_the_trio_run(wire: Wire,
                                                                  provider: AnyHTTPProvider) -> None:
    # As in an engine episode: the worker thread's call runs in the trio run that waits for it.
    wire.enqueue(wire.text("never seen").slow(60))
    control = CallControl()
    interrupter = interrupt_when(lambda: bool(wire.calls), control)

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(ProviderInterrupted):
            await trio.to_thread.run_sync(provider.complete, request(), control)
        return time.monotonic() - started

    assert trio.run(main) < PROMPTLY_S
    interrupter.join()


def test_providers_of_one_configuration_share_a_client_per_trio_run(
        wire: Wire, make_provider: Callable[..., AnyHTTPProvider]) -> None:
    # One connection pool per process and configuration: two agents' providers reuse one
    # keep-alive connection; other settings get a client of their own.
    first, second, other = make_provider(), make_provider(), make_provider(timeout_s=99)
    wire.enqueue(*(wire.text("ok") for _ in range(4)))

    async def main() -> None:
        for one in (first, second, first, other):
            await trio.to_thread.run_sync(one.complete, request(), CallControl())

    trio.run(main)
    ports = [recorded.client_port for recorded in wire.calls]
    assert ports[0] == ports[1] == ports[2] != ports[3]


def test_a_client_of_another_configuration_loads_no_certificate_roots_again(
        wire: Wire, make_provider: Callable[..., AnyHTTPProvider], monkeypatch: pytest.MonkeyPatch) -> None:
    # Loading the roots is most of what building a client costs: a process loads them
    # once, however many configurations (each a client of its own) it serves.
    wire.enqueue(wire.text("ok"), wire.text("ok"))
    make_provider().complete(request(), CallControl())
    loads = count_root_loads(monkeypatch)
    make_provider(timeout_s=99).complete(request(), CallControl())
    assert loads == []
    first, other = (recorded.client_port for recorded in wire.calls)
    assert first != other  # the other configuration did build a client of its own


@pytest.mark.parametrize("callers", ["threads", "trio"])
def test_max_connections_bounds_the_pool_and_still_serves_concurrent_calls(
        wire: Wire, make_provider: Callable[..., AnyHTTPProvider], callers: str) -> None:
    provider = make_provider(max_connections=2)
    wire.enqueue(*(wire.text("ok").slow(0.05) for _ in range(6)))
    results: list[str] = []

    def one() -> None:
        results.append(provider.complete(request(), CallControl()).text)

    async def in_trio() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(trio.to_thread.run_sync, one)

    if callers == "trio":
        trio.run(in_trio)
    else:
        workers = [threading.Thread(target=one) for _ in range(6)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert results == ["ok"] * 6
    if callers == "trio":  # the pool is per trio run; plain threads each run one of their own
        assert len({r.client_port for r in wire.calls}) <= 2


def test_an_interrupted_control_sends_nothing(wire: Wire, provider: AnyHTTPProvider) -> None:
    control = CallControl()
    control.interrupt()
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), control)
    assert wire.calls == []


def test_a_spent_budget_sends_nothing(wire: Wire, provider: AnyHTTPProvider) -> None:
    with pytest.raises(ProviderInterrupted):
        provider.complete(request(), CallControl(deadline=time.monotonic() - 1))
    assert wire.calls == []


def test_close_is_idempotent_and_later_calls_fail(wire: Wire, provider: AnyHTTPProvider) -> None:
    provider.close()
    provider.close()
    with pytest.raises(ProviderError, match="closed"):
        provider.complete(request(), CallControl())
    assert wire.calls == []


def test_a_built_provider_is_closed_when_its_with_block_ends(wire: Wire) -> None:
    with build_provider(wire.settings()) as provider:
        assert answer(wire, provider, wire.text("inside")).text == "inside"
    with pytest.raises(ProviderError, match="closed"):
        provider.complete(request(), CallControl())
    assert len(wire.calls) == 1


# -- configuration ---------------------------------------------------------------------


def test_a_missing_api_key_fails_at_construction_naming_the_variable(
        wire: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wire.key_env)
    with pytest.raises(ProviderConfigError, match=wire.key_env):
        build_provider(wire.settings())
    assert wire.server.requests == []


def test_a_blank_key_is_no_key(wire: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(wire.key_env, " \n")
    with pytest.raises(ProviderConfigError, match=f"no API key; set the environment variable {wire.key_env}"):
        build_provider(wire.settings())
    assert wire.server.requests == []


def test_the_key_is_sent_as_its_variable_holds_it_without_surrounding_whitespace(
        wire: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(wire.key_env, f"  {wire.api_key}\n")  # pasted with its line break
    with build_provider(wire.settings()) as provider:
        assert answer(wire, provider, wire.text("keyed")).text == "keyed"
    assert wire.sent_key(wire.calls[-1].headers) == wire.api_key


def test_without_api_key_env_the_kinds_own_key_variable_is_read(
        wire: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wire.default_key_env, raising=False)
    settings = {key: value for key, value in wire.settings().items() if key != "api_key_env"}
    with pytest.raises(ProviderConfigError, match=wire.default_key_env):
        build_provider(settings)


def test_without_base_url_the_kinds_own_base_url_variable_is_read(
        wire: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(wire.base_url_env, wire.server.base_url)
    built = build_provider({key: value for key, value in wire.settings().items() if key != "base_url"})
    try:
        wire.enqueue(wire.text("via env"))
        assert built.complete(request(), CallControl()).text == "via env"
    finally:
        built.close()


def test_an_unknown_setting_is_refused_naming_the_known_ones(wire: Wire) -> None:
    with pytest.raises(ProviderConfigError) as caught:
        build_provider(wire.settings(temprature=0.2))
    message = str(caught.value)
    assert "temprature" in message
    for known in wire.setting_names:
        assert known in message


@pytest.mark.parametrize("extra", [
    {"timeout_s": 0}, {"timeout_s": "600"}, {"max_connections": 0}, {"base_url": ""}, {"api_key_env": ""},
])
def test_a_bad_value_of_a_shared_setting_is_refused_naming_it_before_any_request(
        wire: Wire, extra: dict[str, Any]) -> None:
    with pytest.raises(ProviderConfigError, match=next(iter(extra))):
        build_provider(wire.settings(**extra))
    assert wire.server.requests == []


# -- with wmo_trio's retry policy (build_provider) ---------------------------------------


def test_a_429_storm_is_ridden_out(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(*(wire.error(429) for _ in range(4)), wire.text("finally"))
    assert make_built(retry=FAST_RETRY).complete(request(), CallControl()).text == "finally"
    assert len(wire.calls) == 5


def test_a_5xx_storm_is_ridden_out(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.error(500), wire.error(502), wire.error(503),
                 wire.raw(b"busy", status=504, content_type="text/html"), wire.text("up"))
    assert make_built(retry=FAST_RETRY).complete(request(), CallControl()).text == "up"
    assert len(wire.calls) == 5


def test_a_429_with_retry_after_waits_as_asked_then_succeeds(wire: Wire,
                                                             make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.error(429, headers={"retry-after": "0.2"}), wire.text("finally"))
    control = RecordingControl()
    built = make_built(retry={**FAST_RETRY, "retry_after_cap_s": 10})
    assert built.complete(request(), control).text == "finally"
    assert control.sleeps == [0.2]
    assert len(wire.calls) == 2


def test_an_hour_long_retry_after_is_capped(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.error(429, headers={"retry-after": "3600"}), wire.text("ok"))
    built = make_built(retry={**FAST_RETRY, "retry_after_cap_s": 0.2})
    # With a budget, an uncapped wait fails fast (it would outlast the budget) instead of
    # sleeping for the hour.
    control = RecordingControl(deadline=time.monotonic() + 60)
    started = time.monotonic()
    assert built.complete(request(), control).text == "ok"
    assert control.sleeps == [0.2]
    assert time.monotonic() - started < PROMPTLY_S


def test_a_cancel_during_backoff_returns_promptly(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.error(429, headers={"retry-after": "20"}), wire.text("too late"))
    built = make_built(retry={"retry_after_cap_s": 20})
    control = RecordingControl()
    interrupter = interrupt_when(lambda: bool(control.sleeps), control)  # i.e. in the backoff
    started = time.monotonic()
    with pytest.raises(ProviderInterrupted):
        built.complete(request(), control)
    assert time.monotonic() - started < PROMPTLY_S
    assert control.sleeps == [20]
    assert len(wire.calls) == 1
    interrupter.join()


def test_a_400_is_not_retried(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.error(400, "bad request"), wire.text("unused"))
    with pytest.raises(ProviderError) as caught:
        make_built(retry=FAST_RETRY).complete(request(), CallControl())
    assert caught.value.status == 400
    assert len(wire.calls) == 1


def test_a_broken_connection_is_retried(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.reset(), wire.dropped(), wire.text("third try"))
    assert make_built(retry=FAST_RETRY).complete(request(), CallControl()).text == "third try"
    assert len(wire.calls) == 3


def test_retries_stop_at_max_attempts(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(*(wire.error(529) for _ in range(5)))
    with pytest.raises(ProviderError) as caught:
        make_built(retry={**FAST_RETRY, "max_attempts": 3}).complete(request(), CallControl())
    assert caught.value.status == 529
    assert len(wire.calls) == 3


def test_a_reply_that_is_a_web_page_is_not_retried(wire: Wire, make_built: Callable[..., Provider]) -> None:
    wire.enqueue(wire.raw(b"<html>login</html>", content_type="text/html; charset=utf-8"),
                 wire.text("unused"))
    with pytest.raises(ProviderError, match="login"):
        make_built(retry=FAST_RETRY).complete(request(), CallControl())
    assert len(wire.calls) == 1


@pytest.mark.parametrize("body", [b'{"choices": [', NESTED_TOO_DEEPLY], ids=["broken", "too-deep"])
def test_a_json_reply_that_cannot_be_read_is_retried(wire: Wire, make_built: Callable[..., Provider],
                                                     body: bytes) -> None:
    wire.enqueue(wire.raw(body), wire.text("readable"))
    assert make_built(retry=FAST_RETRY).complete(request(), CallControl()).text == "readable"
    assert len(wire.calls) == 2
