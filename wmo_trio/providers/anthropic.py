"""The Anthropic worker provider: the Messages API through the official `anthropic` SDK.

Request mapping: the system prompt goes at the top level; `tool` messages become user
`tool_result` blocks; consecutive messages of one API role merge into one message with
several blocks; assistant tool calls become `tool_use` blocks. One prompt-cache breakpoint
sits on the last block of the last message (on the system prompt when there are no
messages), so every turn of a long episode reads the previous turns from the cache.

Response mapping: text blocks are concatenated, `tool_use` blocks become tool calls and
thinking blocks are left out of the response. With extended thinking on, the API wants an
assistant turn's thinking blocks sent back unchanged together with its tool calls; the
provider keeps them (keyed by the turn's first tool-call id, in a bounded table) and puts
them back when the conversation is sent again.

Retries belong to wmo_trio's retry policy (`retry.py`), so the SDK's own are off. Errors
become `ProviderError`s that say whether a retry may help and how long the server asked
us to wait.

Cancellation: the SDK call blocks, so it runs in a daemon helper thread while the calling
worker waits for its result or the episode's interruption, whichever comes first. On
interruption the worker raises `ProviderInterrupted` at once and the HTTP call is
abandoned; it never touches the task environment, and it ends by itself because each call
is bounded by the episode's remaining budget (and by `timeout_s`).
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Self

import anthropic
import httpx2

from wmo_trio.models import JsonObject, TokenUsage
from wmo_trio.providers.base import (
    CallControl,
    FinishReason,
    Message,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
    ToolCall,
)
from wmo_trio.providers.retry import is_retryable_status

DEFAULT_API_KEY_ENV = "ANTHROPIC_API_KEY"
DEFAULT_TIMEOUT_S = 600.0
MIN_THINKING_BUDGET = 1024  # the API's floor for `budget_tokens`

_SETTINGS = frozenset({"api_key_env", "base_url", "timeout_s", "thinking", "max_connections", "api_version"})
# The SDK sends API version 2026-10-21, which refuses sampling parameters (temperature
# included, even at its default) with a 400, and the SDK has no argument for them any more.
# Only under an older version, chosen with the `api_version` setting, is temperature sent.
_VERSIONS_WITH_TEMPERATURE = frozenset({"2023-06-01"})
# Body fields `messages.create` takes as arguments; any other field goes in `extra_body`.
_SDK_ARGUMENTS = frozenset({"model", "max_tokens", "messages", "system", "tools", "thinking"})
_CACHE_BREAKPOINT = {"type": "ephemeral"}
_FINISH_REASONS = {
    "tool_use": FinishReason.TOOL_CALLS,
    "max_tokens": FinishReason.LENGTH,
    "refusal": FinishReason.CONTENT_FILTER,
}
# CallControl offers no way to wait for "interrupted or my result is ready" at once, so the
# worker waits on the result and looks at the interruption this often.
_INTERRUPT_POLL_S = 0.05
# A connection that cannot even be opened within this long will not do better later.
_CONNECT_TIMEOUT_S = 10.0
# Thinking blocks kept for sending back: the API needs only each episode's latest tool-use
# turn, so this covers far more concurrent episodes than one process runs.
_THINKING_TABLE_SIZE = 4096


class AnthropicProvider:
    """Claude through the Messages API. Safe to call from many worker threads at once.

    Settings: `api_key_env` (the variable holding the key, default `ANTHROPIC_API_KEY`),
    `base_url` (default: `ANTHROPIC_BASE_URL`, else the SDK's), `timeout_s` (the longest
    one HTTP call may take, default 600), `thinking` (the API's thinking configuration,
    for example `{"type": "enabled", "budget_tokens": 2048}`), `max_connections`, and
    `api_version` (the `anthropic-version` header; default: the SDK's). The request's
    temperature is sent only under API version 2023-06-01 and without thinking: the newer
    API refuses it.
    """

    def __init__(
        self,
        config: ProviderConfig,
        client: anthropic.Anthropic,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        thinking: JsonObject | None = None,
        api_version: str | None = None,
    ) -> None:
        self.config = config
        self._client = client
        self._timeout_s = timeout_s
        self._thinking = thinking
        self._sends_temperature = api_version in _VERSIONS_WITH_TEMPERATURE
        self._thinking_blocks: OrderedDict[str, list[JsonObject]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, config: ProviderConfig) -> Self:
        """Validate the settings and create the client; a missing API key fails here."""
        from wmo_trio.providers import GENERIC_SETTINGS

        settings = config.settings
        known = _SETTINGS | GENERIC_SETTINGS
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ProviderConfigError(
                f"anthropic provider: unknown settings {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        key_env = settings.get("api_key_env", DEFAULT_API_KEY_ENV)
        if not isinstance(key_env, str) or not key_env:
            raise ProviderConfigError("anthropic provider: api_key_env must name an environment variable")
        base_url = settings.get("base_url")
        if base_url is not None and (not isinstance(base_url, str) or not base_url):
            raise ProviderConfigError("anthropic provider: base_url must be a URL string")
        timeout_s = settings.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not (
            math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise ProviderConfigError(
                f"anthropic provider: timeout_s must be a positive number of seconds, got {timeout_s!r}"
            )
        max_connections = settings.get("max_connections")
        if max_connections is not None and (
            isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1
        ):
            raise ProviderConfigError(
                f"anthropic provider: max_connections must be an integer >= 1, got {max_connections!r}"
            )
        thinking = _check_thinking(settings.get("thinking"))
        api_version = settings.get("api_version")
        if api_version is not None and (not isinstance(api_version, str) or not api_version.strip()):
            raise ProviderConfigError(
                f"anthropic provider: api_version must be an API version string such as "
                f"'2023-06-01', got {api_version!r}"
            )

        api_key = os.environ.get(key_env, "").strip()
        if not api_key:
            raise ProviderConfigError(
                f"anthropic provider: no API key; set the environment variable {key_env} "
                f"(or point the api_key_env setting at the variable that holds it)"
            )
        http_client = None
        if max_connections is not None:
            http_client = anthropic.DefaultHttpxClient(
                limits=httpx2.Limits(max_connections=max_connections,
                                     max_keepalive_connections=max_connections)
            )
        client = anthropic.Anthropic(
            api_key=api_key,
            base_url=base_url,  # None lets the SDK read ANTHROPIC_BASE_URL
            max_retries=0,  # retry.py decides; the SDK would obey retry-after without a cap
            timeout=float(timeout_s),
            http_client=http_client,
            default_headers={"anthropic-version": api_version} if api_version else None,
        )
        return cls(config, client, timeout_s=float(timeout_s), thinking=thinking, api_version=api_version)

    # -- the call ------------------------------------------------------------------------

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        """One Messages API call.

        If `control` is interrupted while the call is in flight, this raises
        `ProviderInterrupted` within about 50 ms and abandons the HTTP call, which then
        ends by its own timeout at the latest. The timeout is the episode's remaining
        budget, capped by `timeout_s`.
        """
        if self._closed:
            raise ProviderError("anthropic provider: closed")
        if control.interrupted:
            raise ProviderInterrupted("anthropic call not started: the episode was interrupted")
        timeout = self._timeout_s
        remaining = control.remaining()
        if remaining is not None:
            if remaining <= 0:
                raise ProviderInterrupted("anthropic call not started: no wall-clock budget left")
            timeout = min(timeout, remaining)
        body = self.request_body(request)
        arguments = {key: value for key, value in body.items() if key in _SDK_ARGUMENTS}
        extra_body = {key: value for key, value in body.items() if key not in _SDK_ARGUMENTS}
        http_timeout = httpx2.Timeout(timeout, connect=min(timeout, _CONNECT_TIMEOUT_S))
        call = _BackgroundCall(lambda: self._client.messages.create(
            **arguments, extra_body=extra_body or None, timeout=http_timeout))

        # httpx's timeout bounds each network operation, not the whole exchange; the give-up
        # time bounds the whole.
        give_up = time.monotonic() + timeout
        while not call.done.wait(_INTERRUPT_POLL_S):
            if control.interrupted:
                raise ProviderInterrupted("anthropic call abandoned: the episode was interrupted")
            if time.monotonic() >= give_up:
                raise ProviderError(f"anthropic call: no response within {timeout:g} s", retryable=True)
        if call.error is not None:
            failure = self._provider_error(call.error)
            if failure is None:  # not an API failure: a defect, which must stay visible as itself
                raise call.error
            raise failure from call.error
        if not isinstance(call.result, anthropic.types.Message):
            raise ProviderError(f"anthropic call: unexpected result {type(call.result).__name__}")
        return self._response(call.result)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    # -- request mapping -----------------------------------------------------------------

    def request_body(self, request: ProviderRequest) -> JsonObject:
        """The JSON body of the Messages API request for `request`."""
        thinking_on = self._thinking is not None and self._thinking.get("type") != "disabled"
        body: JsonObject = {
            "model": self.config.model,
            "max_tokens": request.max_output_tokens,
            "messages": self._messages(request.messages),
        }
        system: list[JsonObject] = (
            [{"type": "text", "text": request.system}] if request.system.strip() else []
        )
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = [
                {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}
                for tool in request.tools
            ]
        if self._thinking is not None:
            budget = self._thinking.get("budget_tokens")
            if isinstance(budget, int) and request.max_output_tokens <= budget:
                raise ProviderError(
                    f"anthropic provider: max_output_tokens ({request.max_output_tokens}) must be "
                    f"larger than thinking.budget_tokens ({budget})"
                )
            body["thinking"] = self._thinking
        # With thinking on, the API takes no temperature but its default.
        if request.temperature is not None and self._sends_temperature and not thinking_on:
            body["temperature"] = request.temperature

        messages = body["messages"]
        last_blocks = messages[-1]["content"] if messages else system
        if last_blocks:
            last_blocks[-1] = {**last_blocks[-1], "cache_control": dict(_CACHE_BREAKPOINT)}
        return body

    def _messages(self, messages: list[Message]) -> list[JsonObject]:
        merged: list[JsonObject] = []
        for message in messages:
            role = "assistant" if message.role == "assistant" else "user"
            blocks = self._blocks(message)
            if not blocks:
                continue  # the API rejects empty messages and empty text blocks
            if merged and merged[-1]["role"] == role:
                merged[-1]["content"].extend(blocks)
            else:
                merged.append({"role": role, "content": blocks})
        return merged

    def _blocks(self, message: Message) -> list[JsonObject]:
        if message.role == "tool":
            if message.tool_call_id is None:
                raise ProviderError("anthropic provider: a tool message has no tool_call_id")
            result: JsonObject = {"type": "tool_result", "tool_use_id": message.tool_call_id,
                                  "is_error": message.is_error}
            if message.content:
                result["content"] = message.content
            return [result]
        blocks: list[JsonObject] = []
        if message.role == "assistant" and message.tool_calls:
            with self._lock:
                kept = self._thinking_blocks.get(message.tool_calls[0].id, [])
            blocks.extend(dict(block) for block in kept)
        if message.content.strip():
            blocks.append({"type": "text", "text": message.content})
        if message.role == "assistant":
            blocks.extend(
                {"type": "tool_use", "id": call.id, "name": call.name,
                 "input": call.arguments if call.arguments is not None else {}}
                for call in message.tool_calls
            )
        return blocks

    # -- response mapping ----------------------------------------------------------------

    def _response(self, message: anthropic.types.Message) -> ProviderResponse:
        texts: list[str] = []
        calls: list[ToolCall] = []
        thinking: list[JsonObject] = []
        for block in message.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_use":
                calls.append(_tool_call(block.id, block.name, block.input))
            elif block.type == "thinking":
                thinking.append({"type": "thinking", "thinking": block.thinking,
                                 "signature": block.signature})
            elif block.type == "redacted_thinking":
                thinking.append({"type": "redacted_thinking", "data": block.data})
        if thinking and calls:
            with self._lock:
                self._thinking_blocks[calls[0].id] = thinking
                while len(self._thinking_blocks) > _THINKING_TABLE_SIZE:
                    self._thinking_blocks.popitem(last=False)
        usage = message.usage
        cache_read = usage.cache_read_input_tokens or 0
        cache_write = usage.cache_creation_input_tokens or 0
        return ProviderResponse(
            text="".join(texts),
            tool_calls=calls,
            finish_reason=_FINISH_REASONS.get(message.stop_reason or "", FinishReason.STOP),
            usage=TokenUsage(
                input_tokens=usage.input_tokens + cache_read + cache_write,
                output_tokens=usage.output_tokens,
                cached_input_tokens=cache_read,
                cache_write_input_tokens=cache_write,
                calls=1,
            ),
        )

    # -- errors --------------------------------------------------------------------------

    def _provider_error(self, error: BaseException) -> ProviderError | None:
        if isinstance(error, anthropic.APIStatusError):
            status = error.status_code
            kind = error.type or "error"
            detail = error.api_message or error.message
            return ProviderError(
                f"anthropic API returned {status} ({kind}): {detail}",
                status=status,
                retryable=is_retryable_status(status),
                retry_after=retry_after_seconds(error.response.headers),
            )
        if isinstance(error, anthropic.APITimeoutError):
            return ProviderError("anthropic call timed out", retryable=True)
        if isinstance(error, anthropic.APIConnectionError):
            cause = error.__cause__
            reason = f": {type(cause).__name__}: {cause}" if cause is not None else ""
            return ProviderError(f"anthropic connection failed{reason}", retryable=True)
        if self._closed:
            return ProviderError("anthropic provider: closed while the call was in flight")
        if isinstance(error, anthropic.AnthropicError):
            return ProviderError(f"anthropic SDK error: {type(error).__name__}: {error}")
        return None


class _BackgroundCall:
    """Runs `fn` in a daemon thread; `done` is set once `result` or `error` is there.

    Daemon, so that an abandoned call never holds up interpreter exit.
    """

    def __init__(self, fn: Callable[[], object]) -> None:
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn,), name="wmo-anthropic-call", daemon=True).start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except BaseException as error:
            self.error = error
        finally:
            self.done.set()


def _tool_call(call_id: str, name: str, arguments: object) -> ToolCall:
    if isinstance(arguments, dict):
        return ToolCall(id=call_id, name=name, arguments=dict(arguments))
    try:
        raw = json.dumps(arguments)
    except (TypeError, ValueError):
        raw = repr(arguments)
    # The scripted provider's wording, so that a replayed conversation reads the same.
    return ToolCall(id=call_id, name=name, arguments=None, raw_arguments=raw,
                    parse_error="arguments are not a JSON object")


def _check_thinking(value: object) -> JsonObject | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ProviderConfigError(
            'anthropic provider: thinking must be an object with a "type", for example '
            '{"type": "enabled", "budget_tokens": 2048}'
        )
    if value["type"] == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise ProviderConfigError(
                f"anthropic provider: thinking.budget_tokens must be an integer >= "
                f"{MIN_THINKING_BUDGET}, got {budget!r}"
            )
    return dict(value)


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """The wait a response asks for: `retry-after-ms` (milliseconds), else `retry-after`
    (seconds, or an HTTP date). None when absent or unreadable; never negative."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            seconds = _seconds_until(value) if name == "retry-after" else math.nan
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


def _seconds_until(http_date: str) -> float:
    try:
        when = email.utils.parsedate_to_datetime(http_date)
    except (TypeError, ValueError, IndexError):
        return math.nan
    if when.tzinfo is None:  # "-0000" dates: UTC, by RFC 5322
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp() - time.time()
