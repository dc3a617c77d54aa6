"""What the provider tests share: request builders, and one `Wire` per HTTP provider.

A `Wire` is one provider kind with its loopback server: the settings that point the
provider at the server, and builders for the replies the server sends, in that kind's
wire format. tests/test_provider_contract.py runs once per wire (as anyio runs its suite
once per backend); the cases only one kind has stay in tests/test_<kind>_provider.py.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anthropic_server
import openai_server

from wmo_trio.providers._anthropic import AnthropicProvider
from wmo_trio.providers._base import CallControl, Message, Provider, ProviderRequest, ToolCall, ToolSpec
from wmo_trio.providers._openai import OpenAIProvider

FAST_RETRY = {"max_attempts": 6, "base_delay_s": 0.01, "max_delay_s": 0.05, "retry_after_cap_s": 0.05}
# A generous bound for things that would take many seconds (or an hour) if broken; real
# runs take a fraction of it even on a loaded two-core machine.
PROMPTLY_S = 5.0
NESTED_TOO_DEEPLY = b"[" * 100_000 + b"]" * 100_000  # what no JSON parser here goes into


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


def tool_result(call_id: str, text: str, is_error: bool = False) -> Message:
    return Message(role="tool", tool_call_id=call_id, content=text, is_error=is_error)


def call(call_id: str, name: str = "bash", arguments: dict[str, Any] | None = None,
         raw: str | None = None) -> ToolCall:
    return ToolCall(id=call_id, name=name, raw_arguments=raw,
                    arguments=arguments if arguments is not None else {"command": "ls"})


def closing_all[P: Provider](make: Callable[..., P]) -> Iterator[Callable[..., P]]:
    """A fixture's body: `make`, and every provider it made closed once the test is done."""
    made: list[P] = []

    def tracked(**extra: Any) -> P:
        provider = make(**extra)
        made.append(provider)
        return provider

    yield tracked
    for provider in made:
        provider.close()


def count_root_loads(monkeypatch: Any) -> list[str]:
    """From now on, each load of certificate roots into an SSL context (the bulk of
    building one, and of building an SDK client) appends its kind to the returned list."""
    loads: list[str] = []

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(ssl.SSLContext, name)

        def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> Any:
            loads.append(name)
            return original(self, *args, **kwargs)
        return counted

    for name in ("load_verify_locations", "set_default_verify_paths"):
        monkeypatch.setattr(ssl.SSLContext, name, counting(name))
    return loads


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


# A reply is the server module's own `Reply`; a wire only hands them from builder to server.
Reply = Any
Arguments = Any


class Wire(ABC):
    """One provider kind and its running loopback server (a context manager)."""

    kind: str
    key_env: str  # the variable the tests put the server's key in
    default_key_env: str  # the variable read when the settings name none
    base_url_env: str  # the variable read when the settings give no base_url
    timeout_header: str  # where the SDK tells the server how long it will wait
    setting_names: tuple[str, ...]  # every setting the kind takes besides kind and model
    arguments_as_text: bool  # the wire carries tool-call arguments as JSON text, kept as raw_arguments
    provider_class: type[AnthropicProvider] | type[OpenAIProvider]
    api_key: str
    server: anthropic_server.AnthropicServer | openai_server.ChatCompletionsServer

    def __enter__(self) -> Wire:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @abstractmethod
    def settings(self, **extra: Any) -> dict[str, Any]:
        """Provider settings that reach the server with the test key."""

    def enqueue(self, *replies: Reply) -> None:
        self.server.enqueue(*replies)

    @property
    @abstractmethod
    def calls(self) -> list[Any]:
        """The model calls the server received (a model-list check is no call)."""

    @abstractmethod
    def text(self, text: str, *, with_usage: bool = True) -> Reply:
        """A reply holding only text, with a finish the kind calls a plain stop."""

    @abstractmethod
    def tool_calls(self, *calls: tuple[str, str, Arguments], text: str = "") -> Reply:
        """A reply with `text`, then a tool call for each (id, name, arguments)."""

    @abstractmethod
    def reply_text(self, body: bytes) -> str:
        """The text of a reply body, read straight from the wire."""

    @abstractmethod
    def arguments_from_json(self, text: str) -> Arguments:
        """Tool-call arguments that the server sends as this JSON text."""

    @abstractmethod
    def sent_key(self, headers: Mapping[str, str]) -> str | None:
        """The API key a model call carried, read from its (lowercased) headers."""

    def error(self, status: int, message: str = "test error", *,
              headers: Mapping[str, str] | None = None) -> Reply:
        return self._api.error(status, message, headers=headers)

    def raw(self, payload: bytes, *, status: int = 200, content_type: str = "application/json") -> Reply:
        return self._api.raw(payload, status=status, content_type=content_type)

    def dropped(self) -> Reply:
        return self._api.dropped()

    def reset(self) -> Reply:
        return self._api.reset()

    @property
    @abstractmethod
    def _api(self) -> Any:
        """The server module, for the builders both kinds have."""


class AnthropicWire(Wire):
    kind = "anthropic"
    key_env = "WMO_TEST_ANTHROPIC_KEY"
    default_key_env = "ANTHROPIC_API_KEY"
    base_url_env = "ANTHROPIC_BASE_URL"
    timeout_header = "x-stainless-timeout"
    setting_names = ("api_key_env", "base_url", "timeout_s", "thinking", "max_connections",
                     "api_version", "retry", "record")
    arguments_as_text = False
    provider_class = AnthropicProvider
    api_key = anthropic_server.API_KEY

    def __init__(self) -> None:
        self.server = anthropic_server.AnthropicServer()

    @property
    def _api(self) -> Any:
        return anthropic_server

    def settings(self, **extra: Any) -> dict[str, Any]:
        return {"kind": "anthropic", "model": "claude-test", "api_key_env": self.key_env,
                "base_url": self.server.base_url, **extra}

    @property
    def calls(self) -> list[Any]:
        return self.server.requests

    def text(self, text: str, *, with_usage: bool = True) -> Reply:
        reply = anthropic_server.text(text)
        if with_usage:
            return reply
        return anthropic_server.Reply(200, {k: v for k, v in dict(reply.body or {}).items() if k != "usage"})

    def tool_calls(self, *calls: tuple[str, str, Arguments], text: str = "") -> Reply:
        blocks = [anthropic_server.text_block(text)] if text else []
        blocks += [anthropic_server.tool_use_block(name, arguments, id_=id_)
                   for id_, name, arguments in calls]
        return anthropic_server.message(blocks, stop_reason="tool_use")

    def reply_text(self, body: bytes) -> str:
        text: str = json.loads(body)["content"][0]["text"]
        return text

    def arguments_from_json(self, text: str) -> Arguments:
        return json.loads(text)  # the API's tool input is JSON in the body, not a string

    def sent_key(self, headers: Mapping[str, str]) -> str | None:
        # The SDK sends it as x-api-key (or as a bearer token, with an auth token instead).
        bearer = headers.get("authorization", "").removeprefix("Bearer ")
        return headers.get("x-api-key") or bearer or None


class OpenAIWire(Wire):
    kind = "openai"
    key_env = "WMO_TEST_OPENAI_KEY"
    default_key_env = "OPENAI_API_KEY"
    base_url_env = "OPENAI_BASE_URL"
    timeout_header = "x-stainless-read-timeout"
    setting_names = ("api_key_env", "base_url", "timeout_s", "max_connections", "max_tokens_field",
                     "send_temperature", "headers", "extra_body", "check_server", "retry", "record")
    arguments_as_text = True
    provider_class = OpenAIProvider
    api_key = openai_server.API_KEY

    def __init__(self) -> None:
        self.server = openai_server.ChatCompletionsServer()

    @property
    def _api(self) -> Any:
        return openai_server

    def settings(self, **extra: Any) -> dict[str, Any]:
        return {"kind": "openai", "model": openai_server.MODEL, "api_key_env": self.key_env,
                "base_url": self.server.base_url, **extra}

    @property
    def calls(self) -> list[Any]:
        assert isinstance(self.server, openai_server.ChatCompletionsServer)
        return self.server.completions

    def text(self, text: str, *, with_usage: bool = True) -> Reply:
        return openai_server.text(text) if with_usage else openai_server.text(text, usage_=None)

    def tool_calls(self, *calls: tuple[str, str, Arguments], text: str = "") -> Reply:
        return openai_server.tool_calls(
            *(openai_server.tool_call(name, arguments, id_=id_) for id_, name, arguments in calls),
            text_=text or None)

    def reply_text(self, body: bytes) -> str:
        text: str = json.loads(body)["choices"][0]["message"]["content"]
        return text

    def arguments_from_json(self, text: str) -> Arguments:
        return text  # the wire format carries the arguments as a string

    def sent_key(self, headers: Mapping[str, str]) -> str | None:
        authorization = headers.get("authorization")
        return authorization.removeprefix("Bearer ") if authorization else None


WIRES: dict[str, type[Wire]] = {"anthropic": AnthropicWire, "openai": OpenAIWire}
