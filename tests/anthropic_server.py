"""A loopback stand-in for the Anthropic Messages API, for testing the real SDK.

`AnthropicServer` is a real HTTP server on 127.0.0.1 (`support.loopback_server`, in a
daemon thread). It answers `POST /v1/messages` from a queue of `Reply` values that a test
fills in advance, one reply per request, and records every request it receives so that a
test can assert what the provider sent. The reply builders below (`text`, `tool_use`,
`message`, `error`, `dropped`, `reset`) produce bodies in the shapes the API uses; `raw`
sends bytes as they are, as an unfaithful server or a proxy does.

A request that arrives when the queue is empty gets a 400 `invalid_request_error`, which
no retry policy retries, so a test that under-fills the queue fails loudly instead of
spinning.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from support.loopback_server import LoopbackServer, RecordedRequest, Reply, dropped, reset

__all__ = ["API_KEY", "AnthropicServer", "RecordedRequest", "Reply", "dropped", "error", "message",
           "raw", "redacted_thinking_block", "reset", "text", "text_block", "thinking_block",
           "tool_use", "tool_use_block", "usage"]

API_KEY = "sk-ant-test-key"
_ids = itertools.count(1)


def usage(input_tokens: int = 10, output_tokens: int = 5, *, cache_read: int = 0,
          cache_creation: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_creation,
    }


def message(content: list[dict[str, Any]], *, stop_reason: str = "end_turn",
            usage_: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None) -> Reply:
    """A 200 reply holding an assistant message with these content blocks."""
    body = {
        "id": f"msg_test_{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": dict(usage_) if usage_ is not None else usage(),
    }
    return Reply(200, body, dict(headers or {}))


def text_block(text_: str) -> dict[str, Any]:
    return {"type": "text", "text": text_, "citations": None}


def tool_use_block(name: str, input_: Any, *, id_: str | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": id_ or f"toolu_test_{next(_ids)}", "name": name, "input": input_}


def thinking_block(thinking: str, signature: str = "sig-test") -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": signature}


def redacted_thinking_block(data: str = "opaque") -> dict[str, Any]:
    return {"type": "redacted_thinking", "data": data}


def text(text_: str, *, stop_reason: str = "end_turn", usage_: Mapping[str, Any] | None = None) -> Reply:
    return message([text_block(text_)], stop_reason=stop_reason, usage_=usage_)


def tool_use(name: str, input_: Any, *, id_: str | None = None, text_: str = "",
             usage_: Mapping[str, Any] | None = None) -> Reply:
    blocks = [text_block(text_)] if text_ else []
    blocks.append(tool_use_block(name, input_, id_=id_))
    return message(blocks, stop_reason="tool_use", usage_=usage_)


_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 503: "api_error", 529: "overloaded_error",
}


def error(status: int, message_: str = "test error", *, error_type: str | None = None,
          headers: Mapping[str, str] | None = None) -> Reply:
    """An error reply in the API's error shape."""
    kind = error_type or _ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message_}}
    return Reply(status, body, dict(headers or {}))


def raw(payload: bytes, *, status: int = 200, content_type: str = "application/json") -> Reply:
    return Reply(status, raw_body=payload, content_type=content_type)


class AnthropicServer(LoopbackServer):
    """See the module docstring. Use as a context manager, or `start()`/`stop()`."""

    thread_name = "anthropic-test-server"

    def __init__(self, api_key: str = API_KEY) -> None:
        super().__init__()
        self.api_key = api_key

    @property
    def base_url(self) -> str:
        return self.origin

    @property
    def bodies(self) -> list[Any]:
        return [request.body for request in self.requests]

    def answer(self, request: RecordedRequest) -> Reply:
        if request.method != "POST" or request.path.split("?")[0] != "/v1/messages":
            return error(404, f"test server: no route {request.method} {request.path}")
        if not self._authorized(request.headers):
            return error(401, "test server: missing or wrong API key")
        queued = self.next_queued()
        return queued or error(400, "test server: no reply queued for this request")

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        bearer = headers.get("authorization", "")
        return headers.get("x-api-key") == self.api_key or bearer == f"Bearer {self.api_key}"
