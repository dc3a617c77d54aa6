"""The OpenAI-compatible worker provider: Chat Completions through the official `openai`
SDK, for OpenAI itself and for the servers that speak its API (vLLM, SGLang, Ollama,
llama.cpp, OpenRouter and other gateways).

Request mapping: the system prompt is a `system` message; assistant tool calls go back as
`tool_calls` whose `arguments` are the model's own text when it parsed (so a server's
prefix cache sees the tokens it generated), and `{}` when it did not (servers that re-parse
the history refuse an invalid string, which would turn a recoverable slip into a failed
episode); each tool result is a `tool` message. Chat Completions has no error flag for a
tool result: the observation's text says what went wrong. The document's tools are sent
as `tools` of type `function`; temperature and the output limit come from the request.

Response mapping, for faithful and unfaithful servers alike: the text (a string or a list
of text parts) and every tool call of the first choice; `arguments` that are not a JSON
object give a tool call without arguments and with a `parse_error` (the scripted
provider's wording), which the episode answers with an observation the model can recover
from; a missing id is made up; `finish_reason` `length` is the output limit, an unknown or
missing one is read from whether there are tool calls; a missing `usage` counts the call
with zero tokens; a lone surrogate (half of an escaped pair) becomes U+FFFD. A reply
without choices is a retryable failure, unless its error says otherwise; a body that cannot
be read is judged as for every kind (`wmo_trio.providers._http.reply_json`), and JSON that is
not an object is no chat completion (base_url names another API).

Model I/O is `HTTPProvider`'s (`http.py`), as for the Anthropic provider: the worker thread
builds the body, and parses and maps the reply's body; the HTTP exchange alone runs on the
trio thread (`CallControl.run_async`) through one `AsyncOpenAI` client per trio run and
configuration, built (with the SDK's import) in a worker thread on first use and closed
when the run ends. An interrupt cancels the call at once. The SDK's retries are off:
wmo_trio's retry policy (`retry.py`) decides.

Before anything runs, `from_config` checks that the server is there and serves the model
(`GET <base_url>/models`; see `wmo_trio.providers._openai_check`), once per process and
configuration, so harbor's preflight and `wmo-trio run`, which build the provider before any
trial and off any event loop, pay for it and every trial's provider finds it done.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import Field

from wmo_trio.models import JsonObject, TokenUsage
from wmo_trio.providers import _base, _http
from wmo_trio.providers._openai_check import check_server
from wmo_trio.providers._retry import is_retryable_status
from wmo_trio.settings import NonEmptyText

if TYPE_CHECKING:
    import httpx2
    import openai

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_BASE_URL = "https://api.openai.com/v1"

# Fields the provider sets from the request, or that would change the reply's shape.
_OWNED_FIELDS = frozenset({"model", "messages", "tools", "max_tokens", "max_completion_tokens",
                           "temperature", "stream", "n"})
_FINISH_REASONS = {
    "stop": _base.FinishReason.STOP,
    "tool_calls": _base.FinishReason.TOOL_CALLS,
    "function_call": _base.FinishReason.TOOL_CALLS,
    "length": _base.FinishReason.LENGTH,
    "content_filter": _base.FinishReason.CONTENT_FILTER,
}
# The SDK refuses to build a client without a key; with none, this stands in and the
# Authorization header is left out of every request.
_NO_KEY = "no-key"
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_ERROR_DETAIL_CHARS = 300


class OpenAISettings(_http.HTTPSettings):
    """Settings of the `openai` kind."""

    base_url: NonEmptyText | None = Field(
        default=None, description="an http(s) URL such as http://localhost:8000/v1")
    api_key_env: NonEmptyText | None = Field(
        default=DEFAULT_API_KEY_ENV,
        description="the name of the environment variable holding the key, or null for a "
        "server that takes no key")
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = Field(
        default="max_tokens", description='"max_tokens" or "max_completion_tokens"')
    send_temperature: bool = True
    headers: dict[str, str] | None = Field(
        default=None, description="an object of header names and string values")
    extra_body: dict[str, Any] | None = Field(
        default=None, description="a JSON object of extra request fields")
    check_server: bool = True


class OpenAIProvider(_http.HTTPProvider[OpenAISettings]):
    """A model behind the Chat Completions API. Safe to call from many worker threads.

    Settings (`OpenAISettings`): `base_url` (default: `OPENAI_BASE_URL`, else OpenAI's
    API), `api_key_env` (the variable holding the key, default `OPENAI_API_KEY`; `null` for
    a server that takes no key: no Authorization header is sent), `timeout_s` (the longest
    one call may take, default 600), `max_connections` (default: no limit; the pool is
    shared by every episode of the run), `max_tokens_field` (`max_tokens`, the default,
    which vLLM, SGLang, Ollama, llama.cpp and OpenRouter read; `max_completion_tokens` for
    OpenAI's reasoning models, which refuse `max_tokens`), `send_temperature` (false for
    models that refuse a temperature), `headers` (sent with every request, e.g. OpenRouter's
    `HTTP-Referer` and `X-Title`), `extra_body` (extra request fields, e.g. vLLM's `top_k`
    or `chat_template_kwargs`, OpenRouter's `provider`), `check_server` (false skips the
    check that the server is there and serves the model).

    A call is `HTTPProvider`'s three steps, each usable alone: `request_body(request)` and
    `response(reply)` in the worker thread, and `send(body, limit_s)`, the HTTP exchange,
    in any trio run.
    """

    sdk = "openai"
    sdk_error = "OpenAIError"

    def __init__(self, config: _base.ProviderConfig, settings: OpenAISettings, api_key: str | None,
                 base_url: str) -> None:
        super().__init__(config, settings,
                         (api_key, base_url, tuple(sorted((settings.headers or {}).items()))))
        self._api_key = api_key
        self._base_url = base_url

    @classmethod
    def from_config(cls, config: _base.ProviderConfig) -> Self:
        """Check the settings, the API key and (once per process, unless `check_server` is
        false) that the server answers; no SDK import, no client."""
        settings: OpenAISettings = OpenAISettings.of(config)
        _check_headers(settings.headers or {})
        _check_extra_body(settings.extra_body or {})
        api_key: str | None = None
        if settings.api_key_env is not None:
            api_key = _base.api_key_from_environment(
                "openai", settings.api_key_env,
                instead='; for a server that takes no key, such as a local vLLM, set "api_key_env": null')
        base_url = _checked_base_url(settings.base_url, api_key)
        if settings.check_server:
            check_server(base_url, api_key, settings.headers or {}, model=config.model,
                         key_env=settings.api_key_env)
        return cls(config, settings, api_key, base_url)

    # -- the exchange and the client ------------------------------------------------------

    async def _exchange(self, client: openai.AsyncOpenAI, content: bytes,
                        http_timeout: httpx2.Timeout) -> _http.HTTPReply:
        import httpx2  # imported already, with the client
        import openai

        # Without a key, the SDK's stand-in key is not sent (see _NO_KEY).
        headers = {"Authorization": openai.Omit()} if self._api_key is None else {}
        response = await client.post("/chat/completions", content=content, cast_to=httpx2.Response,
                                     options={"timeout": http_timeout, "headers": headers})
        return _http.HTTPReply.of(response)

    def _client(self, **options: Any) -> openai.AsyncOpenAI:
        import openai

        client = openai.AsyncOpenAI(
            # Always explicit: the SDK would otherwise read OPENAI_API_KEY and send it to
            # whatever server base_url names.
            api_key=self._api_key if self._api_key is not None else _NO_KEY,
            base_url=self._base_url,
            default_headers=self._settings.headers,
            **options,
        )
        # The SDK imports a resource's modules on its first use (`client.chat`): here, not
        # in the first call on the trio thread.
        client.chat.completions  # noqa: B018
        return client

    # -- request mapping -----------------------------------------------------------------

    def request_body(self, request: _base.ProviderRequest) -> JsonObject:
        """The JSON body of the Chat Completions request for `request`."""
        messages: list[JsonObject] = []
        if request.system.strip():
            messages.append({"role": "system", "content": request.system})
        messages.extend(_message(message) for message in request.messages)
        body: JsonObject = {"model": self.config.model, "messages": messages}
        if request.tools:
            body["tools"] = [
                {"type": "function", "function": {
                    "name": tool.name, "description": tool.description, "parameters": tool.parameters}}
                for tool in request.tools
            ]
        body[self._settings.max_tokens_field] = request.max_output_tokens
        if request.temperature is not None and self._settings.send_temperature:
            body["temperature"] = request.temperature
        if self._settings.extra_body:
            body.update(self._settings.extra_body)
        return body

    # -- response mapping ----------------------------------------------------------------

    def response(self, reply: _http.HTTPReply) -> _base.ProviderResponse:
        """The `ProviderResponse` for what `send` returned; a `ProviderError` when the
        server's reply holds no answer."""
        completion = _http.reply_json(reply, f"openai-compatible server at {self._base_url}")
        if not isinstance(completion, dict):
            raise _base.ProviderError(
                f"openai-compatible server at {self._base_url}: the reply is not a chat "
                f"completion: {reply.shown(_ERROR_DETAIL_CHARS)!r}; is base_url the API's root?")
        usage = _usage(_get(completion, "usage"))
        choices = _get(completion, "choices")
        if not isinstance(choices, list) or not choices:
            raise _no_choices(completion, usage)
        message = _get(choices[0], "message")
        calls = _tool_calls(_get(message, "tool_calls"))
        text = _text(_get(message, "content"))
        finish = _get(choices[0], "finish_reason")
        refusal = _get(message, "refusal")
        if isinstance(refusal, str) and refusal and not text and not calls:
            text, finish = refusal, "content_filter"
        reason = _FINISH_REASONS.get(finish) if isinstance(finish, str) else None
        if reason is None:
            reason = _base.FinishReason.TOOL_CALLS if calls else _base.FinishReason.STOP
        return _base.ProviderResponse(text=text, tool_calls=calls, finish_reason=reason, usage=usage)

    # -- errors --------------------------------------------------------------------------

    def _status_text(self, error: openai.APIStatusError) -> str:
        return f"openai-compatible server returned {error.status_code}: {_error_detail(error)}"


def _get(value: object, name: str) -> Any:
    """A field of a JSON object of the reply; None where an unfaithful server's reply
    lacks it, or has something else than an object there."""
    return value.get(name) if isinstance(value, dict) else None


def _message(message: _base.Message) -> JsonObject:
    if message.role == "tool":
        if message.tool_call_id is None:
            raise _base.ProviderError("openai provider: a tool message has no tool_call_id")
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if message.role == "user" or not message.tool_calls:
        return {"role": message.role, "content": message.content}
    return {
        "role": "assistant",
        "content": message.content if message.content.strip() else None,
        "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _sent_arguments(call)}}
            for call in message.tool_calls
        ],
    }


def _sent_arguments(call: _base.ToolCall) -> str:
    if call.arguments is None:
        return "{}"
    if call.raw_arguments:
        return call.raw_arguments
    return json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":"))


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts, from servers that send them back
        parts = (part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
                 for part in content)
        return "".join(part for part in parts if isinstance(part, str))
    return ""


def _tool_calls(raw_calls: object) -> list[_base.ToolCall]:
    if not isinstance(raw_calls, list):
        return []
    calls: list[_base.ToolCall] = []
    seen: set[str] = set()
    for index, raw_call in enumerate(raw_calls):
        function = _get(raw_call, "function")
        name = _get(function, "name")
        call_id = _get(raw_call, "id")
        if not isinstance(call_id, str) or not call_id or call_id in seen:
            # The id only pairs the call with its result; a server that sends none (or the
            # same one twice) still gets distinct ids back.
            call_id = f"call_{index}_{os.urandom(6).hex()}"
        seen.add(call_id)
        calls.append(_base.parse_tool_call(call_id, name if isinstance(name, str) else "",
                                     _get(function, "arguments")))
    return calls


def _usage(usage: object) -> TokenUsage:
    """Usage as reported: `prompt_tokens` includes the cached tokens, which come from
    `prompt_tokens_details.cached_tokens` (DeepSeek: `prompt_cache_hit_tokens`)."""
    if usage is None:
        return TokenUsage(calls=1)
    prompt = _http.token_count(_get(usage, "prompt_tokens"))
    details = _get(usage, "prompt_tokens_details")
    if details is not None:
        cached = _http.token_count(_get(details, "cached_tokens"))
    else:
        cached = _http.token_count(_get(usage, "prompt_cache_hit_tokens"))
    return TokenUsage(input_tokens=prompt, output_tokens=_http.token_count(_get(usage, "completion_tokens")),
                      cached_input_tokens=min(cached, prompt), calls=1)


def _no_choices(completion: Any, usage: TokenUsage) -> _base.ProviderError:
    """A 200 reply without an answer: gateways send one when the model behind them failed,
    sometimes with an `error` object (its `code` an HTTP status)."""
    problem = _get(completion, "error")
    detail, status = "", None
    if isinstance(problem, dict):
        detail = f": {problem.get('message') or problem}"
        code = problem.get("code")
        if isinstance(code, int) and 400 <= code <= 599:
            status = code
    elif problem is not None:
        detail = f": {problem}"
    return _base.ProviderError(
        f"openai-compatible server answered without a choice{detail}"[:_ERROR_DETAIL_CHARS * 2],
        status=status, retryable=status is None or is_retryable_status(status), usage=usage)


def _error_detail(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])[:_ERROR_DETAIL_CHARS]
    if isinstance(body, str) and body.strip():
        return body.strip()[:_ERROR_DETAIL_CHARS]
    return error.message[:_ERROR_DETAIL_CHARS]


# -- configuration checks ------------------------------------------------------------------


def _check_headers(headers: Mapping[str, str]) -> None:
    # Values are never quoted back: a header may carry a credential.
    for name, value in headers.items():
        if name.lower() == "authorization":
            raise _base.ProviderConfigError(
                "openai provider: headers must not hold Authorization; put the key in an "
                "environment variable and name it in api_key_env")
        if not _HEADER_NAME.match(name):
            raise _base.ProviderConfigError(f"openai provider: headers: {name!r} is not an HTTP header name")
        if any(c in value for c in "\r\n\x00"):
            raise _base.ProviderConfigError(
                f"openai provider: headers: the value of {name!r} holds a line break or NUL")


def _check_extra_body(extra_body: Mapping[str, Any]) -> None:
    owned = sorted(_OWNED_FIELDS.intersection(extra_body))
    if owned:
        raise _base.ProviderConfigError(
            f"openai provider: extra_body must not set {', '.join(owned)}: wmo_trio sets the "
            "model, messages and tools, the document's params set the output limit and the "
            "temperature, and stream or n would change the reply's shape")
    try:
        json.dumps(extra_body, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise _base.ProviderConfigError(f"openai provider: extra_body must be JSON ({error})") from None


def _checked_base_url(configured: str | None, api_key: str | None) -> str:
    if configured is not None:
        url, source = configured, "base_url"
    elif os.environ.get("OPENAI_BASE_URL", "").strip():
        url, source = os.environ["OPENAI_BASE_URL"].strip(), "OPENAI_BASE_URL"
    else:
        if api_key is None:
            raise _base.ProviderConfigError(
                'openai provider: "api_key_env": null needs a base_url (a server that takes '
                "no key, such as http://localhost:8000/v1); OpenAI's own API needs a key")
        return DEFAULT_BASE_URL
    try:
        parts = urllib.parse.urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # a malformed address, such as an unclosed IPv6 bracket
        usable = False
    if not usable:
        raise _base.ProviderConfigError(
            f"openai provider: {source} must be an http(s) URL such as http://localhost:8000/v1, "
            f"got {url!r}")
    return url.rstrip("/")
