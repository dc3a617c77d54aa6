"""A loopback stand-in for an OpenAI-compatible server (vLLM, SGLang, Ollama, OpenRouter),
for testing the real `openai` SDK.

`ChatCompletionsServer` is a real HTTP server on 127.0.0.1 (stdlib `ThreadingHTTPServer` in
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
import socket
import struct
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_KEY = "sk-test-openai-key"
MODEL = "test-model"
_ids = itertools.count(1)


@dataclass(frozen=True)
class Reply:
    """One scripted answer: a status and a JSON body (or raw bytes), optionally late, or
    never sent.

    `delay_s` sleeps before answering (the sleep ends early when the server stops);
    `drop` closes the connection without a response; `reset` aborts it with a TCP reset.
    """

    status: int = 200
    body: Any = None
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


def dropped() -> Reply:
    return Reply(drop=True)


def reset() -> Reply:
    return Reply(reset=True)


class ChatCompletionsServer:
    """See the module docstring. Use as a context manager, or `start()`/`stop()`."""

    def __init__(self, api_key: str | None = API_KEY, models: Sequence[str] = (MODEL,)) -> None:
        self.api_key = api_key
        self.models = list(models)
        self.models_reply: Reply | None = None
        self.redirects: dict[str, str] = {}  # path (query included) -> Location
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
        return f"http://{host!s}:{port}/v1"

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._queue.extend(replies)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received, the model-list checks included."""
        with self._lock:
            return list(self._requests)

    @property
    def completions(self) -> list[RecordedRequest]:
        """The chat-completion requests only."""
        return [r for r in self.requests if r.path.split("?")[0].endswith("/chat/completions")]

    @property
    def bodies(self) -> list[Any]:
        return [request.body for request in self.completions]

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def start(self) -> None:
        # stop() waits up to one poll for the serving loop: a short one keeps each test's teardown short.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01},
                                        name="openai-test-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping in a slow reply
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> ChatCompletionsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling -----------------------------------------------------------------

    def _next_reply(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self._requests.append(request)
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
            if not self._queue:
                return error(400, "test server: no reply queued for this request")
            return self._queue.popleft()

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
                raw_request = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw_request) if raw_request else None
                except json.JSONDecodeError:
                    body = raw_request.decode("utf-8", "replace")
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
                self.send_header("x-request-id", f"req_test_{next(_ids)}")
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler
