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

Model I/O is `HTTPProvider`'s (`http.py`): the episode's worker thread builds the request
body, and parses and maps the reply's body; the HTTP exchange alone runs on the trio thread
(`CallControl.run_async`) through an `AsyncAnthropic` client shared by every episode of the
trio run with the same settings. No thread per call and no polling: an interrupted episode
cancels its call at once through trio's cancel scope. The SDK is imported and the client
built in a worker thread the first time a run needs it, never on an event loop's thread;
building a provider does neither.

Retries belong to wmo_trio's retry policy (`retry.py`), so the SDK's own are off. Errors
become `ProviderError`s that say whether a retry may help and how long the server asked
us to wait. A reply's body that cannot be read is judged as for every kind
(`wmo_trio.providers._http.reply_json`); one that is JSON but not a message is a retryable
failure.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Self

from pydantic import Field, field_validator

from wmo_trio.models import JsonObject, TokenUsage
from wmo_trio.providers import _base, _http
from wmo_trio.settings import NonEmptyText

if TYPE_CHECKING:
    import anthropic
    import httpx2

DEFAULT_API_KEY_ENV = "ANTHROPIC_API_KEY"
MIN_THINKING_BUDGET = 1024  # the API's floor for `budget_tokens`

# The SDK sends API version 2026-10-21, which refuses sampling parameters (temperature
# included, even at its default) with a 400, and the SDK has no argument for them any more.
# Only under an older version, chosen with the `api_version` setting, is temperature sent.
_VERSIONS_WITH_TEMPERATURE = frozenset({"2023-06-01"})
_CACHE_BREAKPOINT = {"type": "ephemeral"}
_FINISH_REASONS = {
    "tool_use": _base.FinishReason.TOOL_CALLS,
    "max_tokens": _base.FinishReason.LENGTH,
    "refusal": _base.FinishReason.CONTENT_FILTER,
}
# Thinking blocks kept for sending back: the API needs only each episode's latest tool-use
# turn, so this covers far more concurrent episodes than one process runs.
_THINKING_TABLE_SIZE = 4096


class AnthropicSettings(_http.HTTPSettings):
    """Settings of the `anthropic` kind."""

    api_key_env: NonEmptyText = Field(
        default=DEFAULT_API_KEY_ENV, description="the name of the environment variable holding the key")
    base_url: NonEmptyText | None = Field(default=None, description="a URL string")
    thinking: dict[str, Any] | None = Field(
        default=None, description='an object with a "type", for example '
        '{"type": "enabled", "budget_tokens": 2048}')
    api_version: NonEmptyText | None = Field(
        default=None, description="an API version string such as '2023-06-01'")

    @field_validator("thinking")
    @classmethod
    def _thinking_is_an_api_configuration(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value.get("type"), str):
            raise ValueError('it must have a "type", for example {"type": "enabled", "budget_tokens": 2048}')
        budget = value.get("budget_tokens")
        if value["type"] == "enabled" and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET
        ):
            raise ValueError(f"budget_tokens must be an integer >= {MIN_THINKING_BUDGET}")
        return value


class AnthropicProvider(_http.HTTPProvider[AnthropicSettings]):
    """Claude through the Messages API. Safe to call from many worker threads at once.

    Settings (`AnthropicSettings`): `api_key_env` (the variable holding the key, default
    `ANTHROPIC_API_KEY`), `base_url` (default: `ANTHROPIC_BASE_URL`, else the SDK's),
    `timeout_s` (the longest one call may take, default 600), `thinking` (the API's
    thinking configuration), `max_connections` (default: no limit; the pool is shared by
    every episode of the run), and `api_version` (the `anthropic-version` header; default:
    the SDK's). The request's temperature is sent only under API version 2023-06-01 and
    without thinking: the newer API refuses it.
    """

    sdk = "anthropic"
    sdk_error = "AnthropicError"

    def __init__(self, config: _base.ProviderConfig, settings: AnthropicSettings, api_key: str) -> None:
        super().__init__(config, settings, (api_key, settings.base_url, settings.api_version))
        self._api_key = api_key
        self._sends_temperature = settings.api_version in _VERSIONS_WITH_TEMPERATURE
        self._thinking_on = settings.thinking is not None and settings.thinking.get("type") != "disabled"
        self._thinking_blocks: OrderedDict[str, list[JsonObject]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: _base.ProviderConfig) -> Self:
        """Check the settings and that the API key is there; no SDK import, no client."""
        settings: AnthropicSettings = AnthropicSettings.of(config)
        return cls(config, settings, _base.api_key_from_environment("anthropic", settings.api_key_env))

    # -- the exchange and the client ------------------------------------------------------

    async def _exchange(self, client: anthropic.AsyncAnthropic, content: bytes,
                        http_timeout: httpx2.Timeout) -> _http.HTTPReply:
        import httpx2  # imported already, with the client

        response = await client.post("/v1/messages", content=content, cast_to=httpx2.Response,
                                     options={"timeout": http_timeout})
        return _http.HTTPReply.of(response)

    def _client(self, **options: Any) -> anthropic.AsyncAnthropic:
        import anthropic

        version = self._settings.api_version
        return anthropic.AsyncAnthropic(
            api_key=self._api_key,
            base_url=self._settings.base_url,  # None lets the SDK read ANTHROPIC_BASE_URL
            default_headers={"anthropic-version": version} if version else None,
            **options,
        )

    # -- request mapping -----------------------------------------------------------------

    def request_body(self, request: _base.ProviderRequest) -> JsonObject:
        """The JSON body of the Messages API request for `request`."""
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
        thinking = self._settings.thinking
        if thinking is not None:
            budget = thinking.get("budget_tokens")
            if isinstance(budget, int) and request.max_output_tokens <= budget:
                raise _base.ProviderError(
                    f"anthropic provider: max_output_tokens ({request.max_output_tokens}) must be "
                    f"larger than thinking.budget_tokens ({budget})"
                )
            body["thinking"] = thinking
        # With thinking on, the API takes no temperature but its default.
        if request.temperature is not None and self._sends_temperature and not self._thinking_on:
            body["temperature"] = request.temperature

        messages = body["messages"]
        last_blocks = messages[-1]["content"] if messages else system
        if last_blocks:
            last_blocks[-1] = {**last_blocks[-1], "cache_control": dict(_CACHE_BREAKPOINT)}
        return body

    def _messages(self, messages: list[_base.Message]) -> list[JsonObject]:
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

    def _blocks(self, message: _base.Message) -> list[JsonObject]:
        if message.role == "tool":
            if message.tool_call_id is None:
                raise _base.ProviderError("anthropic provider: a tool message has no tool_call_id")
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

    def response(self, reply: _http.HTTPReply) -> _base.ProviderResponse:
        """The `ProviderResponse` for what `send` returned. A body that is not the API's
        message object is a retryable failure (a proxy's error page, a truncated reply)."""
        message = _http.reply_json(reply, "anthropic call")
        if not isinstance(message, dict) or message.get("type") != "message":
            raise _base.ProviderError(f"anthropic call: the reply is not a message: {reply.body[:200]!r}",
                                retryable=True)
        texts: list[str] = []
        calls: list[_base.ToolCall] = []
        thinking: list[JsonObject] = []
        for block in message.get("content") or []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use":
                calls.append(_base.parse_tool_call(str(block.get("id", "")), str(block.get("name", "")),
                                             block.get("input")))
            elif kind == "thinking":
                thinking.append({"type": "thinking", "thinking": block.get("thinking", ""),
                                 "signature": block.get("signature", "")})
            elif kind == "redacted_thinking":
                thinking.append({"type": "redacted_thinking", "data": block.get("data", "")})
        if thinking and calls:
            with self._lock:
                self._thinking_blocks[calls[0].id] = thinking
                while len(self._thinking_blocks) > _THINKING_TABLE_SIZE:
                    self._thinking_blocks.popitem(last=False)
        usage = message.get("usage") if isinstance(message.get("usage"), dict) else {}
        assert isinstance(usage, dict)
        cache_read = _http.token_count(usage.get("cache_read_input_tokens"))
        cache_write = _http.token_count(usage.get("cache_creation_input_tokens"))
        return _base.ProviderResponse(
            text="".join(texts),
            tool_calls=calls,
            finish_reason=_FINISH_REASONS.get(str(message.get("stop_reason") or ""), _base.FinishReason.STOP),
            usage=TokenUsage(
                input_tokens=_http.token_count(usage.get("input_tokens")) + cache_read + cache_write,
                output_tokens=_http.token_count(usage.get("output_tokens")),
                cached_input_tokens=cache_read,
                cache_write_input_tokens=cache_write,
                calls=1,
            ),
        )

    # -- errors --------------------------------------------------------------------------

    def _status_text(self, error: anthropic.APIStatusError) -> str:
        detail = error.api_message or error.message
        return f"anthropic API returned {error.status_code} ({error.type or 'error'}): {detail}"
