"""A loopback stand-in for the Anthropic Messages API, for testing the real SDK.

`AnthropicServer` is a real HTTP server on 127.0.0.1 (stdlib `ThreadingHTTPServer` in a
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
import json
import socket
import struct
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_KEY = "sk-ant-test-key"
_ids = itertools.count(1)


@dataclass(frozen=True)
class Reply:
    """One scripted answer: a status and JSON body (or raw bytes), optionally late or never
    sent.

    `delay_s` sleeps before answering (the sleep ends early when the server stops);
    `drop` closes the connection without sending any response at all; `reset` aborts it
    with a TCP reset.
    """

    status: int = 200
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    drop: bool = False
    reset: bool = False
    raw_body: bytes | None = None
    content_type: str = "application/json"

    def slow(self, delay_s: float) -> Reply:
        return replace(self, delay_s=delay_s)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: Mapping[str, str]  # lower-cased names
    body: Any
    client_port: int = 0  # the connection it came on (keep-alive reuses one)


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


def dropped() -> Reply:
    return Reply(drop=True)


def reset() -> Reply:
    return Reply(reset=True)


class AnthropicServer:
    """See the module docstring. Use as a context manager, or `start()`/`stop()`."""

    def __init__(self, api_key: str = API_KEY) -> None:
        self.api_key = api_key
        self._queue: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._queue.extend(replies)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def bodies(self) -> list[Any]:
        return [request.body for request in self.requests]

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def start(self) -> None:
        # stop() waits up to one poll for the serving loop: a short one keeps each test's teardown short.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01},
                                        name="anthropic-test-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping in a slow reply
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> AnthropicServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling -----------------------------------------------------------------

    def _next_reply(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self._requests.append(request)
            if request.method != "POST" or request.path.split("?")[0] != "/v1/messages":
                return error(404, f"test server: no route {request.method} {request.path}")
            if not self._authorized(request.headers):
                return error(401, "test server: missing or wrong API key")
            if not self._queue:
                return error(400, "test server: no reply queued for this request")
            return self._queue.popleft()

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        bearer = headers.get("authorization", "")
        return headers.get("x-api-key") == self.api_key or bearer == f"Bearer {self.api_key}"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's connection pool expects

            def do_POST(self) -> None:
                self._answer()

            def do_GET(self) -> None:
                self._answer()

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode("utf-8", "replace")
                recorded = RecordedRequest(
                    method=self.command,
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                    client_port=self.client_address[1],
                )
                reply = server._next_reply(recorded)
                if reply.delay_s > 0 and server._stopping.wait(reply.delay_s):
                    reply = dropped()
                if reply.reset:
                    # SO_LINGER with a zero timeout: close() sends a RST, not a FIN.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if reply.drop:
                    self.close_connection = True
                    return
                if reply.raw_body is not None:
                    payload = reply.raw_body
                else:
                    payload = json.dumps(reply.body if reply.body is not None else {}).encode()
                self.send_response(reply.status)
                self.send_header("content-type", reply.content_type)
                self.send_header("content-length", str(len(payload)))
                self.send_header("request-id", f"req_test_{next(_ids)}")
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler
