"""What the loopback stand-ins for the model APIs share (`anthropic_server`,
`openai_server`): a real HTTP/1.1 server on 127.0.0.1 (stdlib `ThreadingHTTPServer` in a
daemon thread) that answers from a queue of `Reply` values a test fills in advance, one a
request, and records every request it receives. Each API's server says which requests it
serves and how (`answer`, under the server's lock); the wire (keep-alive, late, dropped
and reset replies, raw bytes) is here, once."""

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
from typing import Any, Self

_request_ids = itertools.count(1)


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


def dropped() -> Reply:
    return Reply(drop=True)


def reset() -> Reply:
    return Reply(reset=True)


class LoopbackServer:
    """A server of scripted replies; a subclass answers each request (`answer`). Use as a
    context manager, or `start()`/`stop()`."""

    thread_name = "loopback-test-server"
    request_id_header = "request-id"

    def __init__(self) -> None:
        self._queue: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def origin(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._queue.extend(replies)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received."""
        with self._lock:
            return list(self._requests)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def start(self) -> None:
        # stop() waits up to one poll for the serving loop: a short one keeps each test's teardown short.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01},
                                        name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping in a slow reply
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling -----------------------------------------------------------------

    def answer(self, request: RecordedRequest) -> Reply:
        """The reply to `request`, called with the lock held: the next queued one, or what
        the API answers a request it does not serve."""
        raise NotImplementedError

    def next_queued(self) -> Reply | None:
        """The next queued reply (the lock held), None when the queue is empty."""
        return self._queue.popleft() if self._queue else None

    def _next_reply(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self._requests.append(request)
            return self.answer(request)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the SDKs' connection pools expect

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
                self.send_header(server.request_id_header, f"req_test_{next(_request_ids)}")
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler
