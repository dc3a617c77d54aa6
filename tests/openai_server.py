"""A loopback stand-in for an OpenAI-compatible server (vLLM, SGLang, Ollama, OpenRouter),
for testing the real `openai` SDK.

`ChatCompletionsServer` is a real HTTP server on 127.0.0.1 (`support.loopback_server`, in
a daemon thread) that speaks the Chat Completions wire format in JSON. It answers
`POST /v1/chat/completions` from a queue of `Reply` values that a test fills in advance,
one reply per request, and `GET /v1/models` with a list of its `models` (the provider's
check that the server is there and serves the model), or with `models_reply` when a test
sets one. A path in `redirects` answers 307 to its location. Every request is recorded so
that a test can assert what the provider sent. The builders below (`text`, `tool_calls`,
`completion`, `error`, `dropped`, `reset`, `raw`) produce what faithful and unfaithful
servers send.

With `api_key=None` the server asks for no key (a local vLLM); with a key, a request
without `Authorization: Bearer <key>` gets a 401. A completion request that arrives when
the queue is empty gets a 400, which no retry policy retries, so a test that under-fills
the queue fails loudly instead of spinning.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from support.loopback_server import LoopbackServer, RecordedRequest, Reply, dropped, reset

__all__ = ["API_KEY", "MODEL", "ChatCompletionsServer", "RecordedRequest", "Reply", "completion",
           "dropped", "error", "raw", "reset", "text", "tool_call", "tool_calls", "usage"]

API_KEY = "sk-test-openai-key"
MODEL = "test-model"
_ids = itertools.count(1)


def usage(prompt_tokens: int = 10, completion_tokens: int = 5, *,
          cached: int | None = None) -> dict[str, Any]:
    """A `usage` object; `cached` adds `prompt_tokens_details.cached_tokens`."""
    value: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        value["prompt_tokens_details"] = {"cached_tokens": cached}
    return value


def tool_call(name: str, arguments: Any, *, id_: str | None = None) -> dict[str, Any]:
    """One entry of `message.tool_calls`. `arguments` is sent as given when it is a string
    (valid JSON or not), JSON-encoded otherwise."""
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": id_ or f"call_test_{next(_ids)}", "type": "function",
            "function": {"name": name, "arguments": encoded}}


_NO_USAGE = object()


def completion(message: Mapping[str, Any], *, finish_reason: str | None = "stop",
               usage_: Any = _NO_USAGE, headers: Mapping[str, str] | None = None) -> Reply:
    """A 200 reply with one choice holding `message`. `usage_=None` leaves `usage` out."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-test-{next(_ids)}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", **message},
                     "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage_ is _NO_USAGE:
        body["usage"] = usage()
    elif usage_ is not None:
        body["usage"] = usage_
    return Reply(200, body, dict(headers or {}))


def text(text_: str, *, finish_reason: str = "stop", usage_: Any = _NO_USAGE) -> Reply:
    return completion({"content": text_}, finish_reason=finish_reason, usage_=usage_)


def tool_calls(*calls: Mapping[str, Any], text_: str | None = None,
               finish_reason: str = "tool_calls", usage_: Any = _NO_USAGE) -> Reply:
    return completion({"content": text_, "tool_calls": list(calls)},
                      finish_reason=finish_reason, usage_=usage_)


def error(status: int, message_: str = "test error", *,
          headers: Mapping[str, str] | None = None) -> Reply:
    """An error reply in the shape OpenAI (and vLLM's `{"object": "error"}` variant) use."""
    body = {"error": {"message": message_, "type": "test_error", "param": None, "code": status}}
    return Reply(status, body, dict(headers or {}))


def raw(payload: bytes, *, status: int = 200, content_type: str = "text/html") -> Reply:
    return Reply(status, raw_body=payload, content_type=content_type)


class ChatCompletionsServer(LoopbackServer):
    """See the module docstring. Use as a context manager, or `start()`/`stop()`."""

    thread_name = "openai-test-server"
    request_id_header = "x-request-id"

    def __init__(self, api_key: str | None = API_KEY, models: Sequence[str] = (MODEL,)) -> None:
        super().__init__()
        self.api_key = api_key
        self.models = list(models)
        self.models_reply: Reply | None = None
        self.redirects: dict[str, str] = {}  # path (query included) -> Location

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    @property
    def completions(self) -> list[RecordedRequest]:
        """The chat-completion requests only."""
        return [r for r in self.requests if r.path.split("?")[0].endswith("/chat/completions")]

    @property
    def bodies(self) -> list[Any]:
        return [request.body for request in self.completions]

    def answer(self, request: RecordedRequest) -> Reply:
        if request.path in self.redirects:
            return Reply(307, {}, {"location": self.redirects[request.path]})
        route = (request.method, request.path.split("?")[0])
        if route not in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            return error(404, f"test server: no route {request.method} {request.path}")
        if self.api_key is not None and (
                request.headers.get("authorization") != f"Bearer {self.api_key}"):
            return error(401, "test server: missing or wrong API key")
        if route[0] == "GET" and self.models_reply is not None:
            return self.models_reply
        if route[0] == "GET":
            return Reply(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "test"}
                for name in self.models]})
        queued = self.next_queued()
        return queued or error(400, "test server: no reply queued for this request")
