"""A loopback model API for load, Anthropic's Messages API and OpenAI's Chat Completions
both: one cheap server process, thousands of keep-alive connections, every reply after a
fixed delay.

    with messages_server.serve(delay_s=2.0, tool_calls=4) as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="any")

`serve` starts the server in a process of its own (so its CPU never counts as the measured
process's) on an ephemeral port and returns when it accepts connections. Standalone:
`python benchmarks/messages_server.py --delay 2 --tool-calls 4` prints its base URL.

Replies script an episode from the request alone, so one server serves every episode at
once: a request whose `messages` hold k assistant messages gets, for k < tool_calls, a
`tool_use` block of `bash`, and from then on a `tool_use` block of `submit`. Requests must
carry an API key (`x-api-key` or `Authorization: Bearer`, any value). `POST /v1/messages`
answers in the Messages API's format, `POST /v1/chat/completions` in Chat Completions' (a
`tool_calls` entry whose `arguments` is JSON text; the turn is the number of `assistant`
messages either way), and `GET /v1/models` lists one model, the one the benchmarks name
(`MODEL`), as OpenAI-compatible servers do (the `openai` provider asks it before a run
whether the server serves its model).

Per request, `x-bench-delay-ms` overrides the delay (the SDK's own cost is measured at
delay 0 against the same server). `GET /stats` answers counters and the server's own CPU
time (and how many replies are held); `POST /stats/reset` answers them too and starts new
ones. `POST /hold` makes model replies wait, unanswered, until `POST /release` (tests that
act while calls are in flight).

The server is a bare `asyncio.Protocol` with just enough HTTP/1.1: a request line,
headers, a `Content-Length` body, keep-alive (and pipelining, answered in order). It is
meant for loopback benchmarks and tests, not for untrusted peers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

DEFAULT_TOOL_CALLS = 4
# The model benchmarks/traffic.py and benchmarks/sdk_cost.py name.
MODEL = "claude-bench"
# Far above what a benchmark needs, far below what a buggy client could make us buffer.
_MAX_HEAD = 64 * 1024
_MAX_BODY = 16 * 2**20
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            411: "Length Required", 413: "Content Too Large", 431: "Request Header Fields Too Large"}


def raise_open_files_limit(wanted: int = 65536) -> int:
    """Raise this process's soft limit on open files toward `wanted` (at most the hard
    limit); returns the new soft limit. Each connection is a file descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


class _Counters:
    def __init__(self) -> None:
        self.open = 0
        self.reset()

    def reset(self) -> None:
        """New counters; open connections stay open, so they start the new peak."""
        self.requests = 0
        self.tool_uses: dict[str, int] = {}
        self.errors = 0
        self.connections_opened = 0
        self.peak_open = self.open
        self.cpu_mark = _cpu_s()

    def snapshot(self) -> dict[str, Any]:
        return {"requests": self.requests, "tool_uses": dict(self.tool_uses), "errors": self.errors,
                "connections_opened": self.connections_opened, "open_connections": self.open,
                "peak_open_connections": self.peak_open, "cpu_s": _cpu_s() - self.cpu_mark}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Reply:
    """A response slot: filled when its delay has passed, written in request order."""

    __slots__ = ("close", "data")

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.close = False


class _Connection(asyncio.Protocol):
    def __init__(self, server: _Server) -> None:
        self._server = server
        self._buffer = bytearray()
        self._head: tuple[str, str, dict[str, str]] | None = None
        self._length = 0
        self._replies: deque[_Reply] = deque()
        self._transport: asyncio.Transport | None = None
        self._reading = True  # False once a request could not be framed
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        counters = self._server.counters
        counters.open += 1
        counters.connections_opened += 1
        counters.peak_open = max(counters.peak_open, counters.open)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.counters.open -= 1
        self._lost = True
        self._replies.clear()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._reading and not self._lost:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > _MAX_HEAD:
                        self._fail(431, "request head too large")
                    return
                head = bytes(self._buffer[:end]).decode("latin-1")
                del self._buffer[:end + 4]
                if not self._parse_head(head):
                    return
            if len(self._buffer) < self._length:
                return
            body = bytes(self._buffer[:self._length])
            del self._buffer[:self._length]
            assert self._head is not None
            method, target, headers = self._head
            self._head, self._length = None, 0
            self._answer(method, target, headers, body)

    def _parse_head(self, head: str) -> bool:
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._fail(400, "malformed request line")
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                self._fail(400, "malformed header line")
                return False
            headers[name.strip().lower()] = value.strip()
        if parts[2] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._fail(411, "send the body with a Content-Length")
            return False
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_BODY:
            self._fail(413 if length > _MAX_BODY else 400, "bad Content-Length")
            return False
        self._head, self._length = (parts[0], parts[1], headers), length
        return True

    def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        server = self._server
        path = target.split("?", 1)[0]
        delay = 0.0
        if method == "POST" and path in _REPLIERS:
            status, payload = _REPLIERS[path](server, headers, body)
            delay = server.delay_s
            override = headers.get("x-bench-delay-ms")
            if override is not None:
                try:
                    delay = max(0.0, float(override) / 1000)
                except ValueError:
                    status, payload = 400, _error("invalid_request_error", "x-bench-delay-ms: a number")
        elif method == "GET" and path == "/v1/models":
            status, payload = 200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
        elif method == "POST" and path in ("/hold", "/release"):
            status, payload = 200, {"held": len(server.held)}
            server.holding = path == "/hold"
            if not server.holding:
                for connection, held, data in server.held:
                    connection._fill(held, data)
                server.held.clear()
        elif method == "GET" and path == "/stats":
            status, payload = 200, {**server.counters.snapshot(), "held": len(server.held)}
        elif method == "POST" and path == "/stats/reset":
            status, payload = 200, server.counters.snapshot()
            server.counters.reset()
        else:
            status, payload = 404, _error("not_found_error", f"no route {method} {path}")
        if status >= 400:
            server.counters.errors += 1
        reply = _Reply()
        reply.close = headers.get("connection", "").lower() == "close"
        self._replies.append(reply)
        data = _response(status, payload, close=reply.close)
        if server.holding and method == "POST" and path in _REPLIERS:
            server.held.append((self, reply, data))
        elif delay > 0:
            asyncio.get_running_loop().call_later(delay, self._fill, reply, data)
        else:
            self._fill(reply, data)

    def _fill(self, reply: _Reply, data: bytes) -> None:
        reply.data = data
        transport = self._transport
        while self._replies and self._replies[0].data is not None and not self._lost:
            ready = self._replies.popleft()
            assert transport is not None and ready.data is not None
            transport.write(ready.data)
            if ready.close:
                self._reading = False
                self._replies.clear()
                transport.close()

    def _fail(self, status: int, message: str) -> None:
        """A request we cannot frame: answer it (after any earlier replies) and close."""
        self._server.counters.errors += 1
        self._reading = False
        reply = _Reply()
        reply.close = True
        self._replies.append(reply)
        self._fill(reply, _response(status, _error("invalid_request_error", message), close=True))


def scripted_tool_use(turn: int, tool_calls: int, call_id: str) -> dict[str, Any]:
    """The episode every reply follows: turn k (0-based) runs `bash` while k < tool_calls,
    then submits. A `tool_use` content block."""
    if turn < tool_calls:
        return {"type": "tool_use", "id": call_id, "name": "bash",
                "input": {"command": f"echo step {turn + 1}"}}
    return {"type": "tool_use", "id": call_id, "name": "submit", "input": {"answer": "done"}}


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _response(status: int, payload: dict[str, Any], *, close: bool) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            + ("connection: close\r\n" if close else "") + "\r\n")
    return head.encode("latin-1") + body


class _Call(NamedTuple):
    number: int
    model: str
    block: dict[str, Any]  # a Messages API `tool_use` block


class _Server:
    def __init__(self, delay_s: float, tool_calls: int) -> None:
        self.delay_s = delay_s
        self.tool_calls = tool_calls
        self.counters = _Counters()
        self._ids = itertools.count(1)
        # POST /hold: model replies wait, unanswered, until POST /release (tests that must
        # act while calls are in flight: a worker killed, a Ctrl-C).
        self.holding = False
        self.held: list[tuple[_Connection, _Reply, bytes]] = []

    def _turn(self, headers: dict[str, str], body: bytes, api: str) -> _Call | tuple[int, dict[str, Any]]:
        """The turn's tool call, or (status, error payload) for a request we refuse."""
        if "x-api-key" not in headers and not headers.get("authorization", "").startswith("Bearer "):
            return 401, _error("authentication_error", "send an API key (any value)")
        try:
            request = json.loads(body)
            messages = request["messages"]
            turn = sum(1 for m in messages if m.get("role") == "assistant")
            model = str(request.get("model", "bench"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return 400, _error("invalid_request_error", f"the body must be a {api} request")
        number = next(self._ids)
        block = scripted_tool_use(turn, self.tool_calls, f"call_bench_{number}")
        counters = self.counters
        counters.requests += 1
        counters.tool_uses[block["name"]] = counters.tool_uses.get(block["name"], 0) + 1
        return _Call(number, model, block)

    def message_reply(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """An Anthropic Messages API reply: one `tool_use` block."""
        turn = self._turn(headers, body, "Messages API")
        if not isinstance(turn, _Call):
            return turn
        number, model, block = turn
        return 200, {
            "id": f"msg_bench_{number}", "type": "message", "role": "assistant", "model": model,
            "content": [block], "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": len(body) // 4, "output_tokens": 20,
                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        }

    def chat_reply(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """An OpenAI Chat Completions reply: one tool call, its arguments as JSON text."""
        turn = self._turn(headers, body, "Chat Completions")
        if not isinstance(turn, _Call):
            return turn
        number, model, block = turn
        call = {"id": block["id"], "type": "function",
                "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}
        prompt = len(body) // 4
        return 200, {
            "id": f"chatcmpl-bench-{number}", "object": "chat.completion", "created": 0,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 20, "total_tokens": prompt + 20},
        }


_REPLIERS = {"/v1/messages": _Server.message_reply, "/v1/chat/completions": _Server.chat_reply}


async def _serve_forever(delay_s: float, tool_calls: int, port: int, watch_parent: bool) -> None:
    loop = asyncio.get_running_loop()
    state = _Server(delay_s, tool_calls)
    # The kernel caps the backlog at net.core.somaxconn; ask for enough for a burst.
    listener = await loop.create_server(lambda: _Connection(state), "127.0.0.1", port,
                                        backlog=8192, reuse_address=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    def wait_for_parent() -> None:
        # The parent holds our stdin: when it exits, however it exits, so do we.
        with contextlib.suppress(OSError, ValueError):
            sys.stdin.buffer.read()
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)

    if watch_parent:
        threading.Thread(target=wait_for_parent, name="parent-watch", daemon=True).start()
    host, bound = listener.sockets[0].getsockname()[:2]
    print(f"http://{host}:{bound}", flush=True)
    async with listener:
        await stop.wait()


@dataclass
class MessagesServer:
    """A running server process (see `serve`)."""

    base_url: str
    process: subprocess.Popen[bytes]

    def stats(self, *, reset: bool = False) -> dict[str, Any]:
        """The server's counters since the last reset; `reset` starts new ones after reading."""
        request = urllib.request.Request(self.base_url + ("/stats/reset" if reset else "/stats"),
                                         method="POST" if reset else "GET")
        with urllib.request.urlopen(request, timeout=30) as response:
            result: dict[str, Any] = json.load(response)
        return result

    def hold(self, holding: bool = True) -> None:
        """From now on, model replies wait unanswered (`held` in `stats`) until
        `hold(False)` answers them all."""
        request = urllib.request.Request(self.base_url + ("/hold" if holding else "/release"),
                                         method="POST")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def start(delay_s: float = 2.0, tool_calls: int = DEFAULT_TOOL_CALLS, *,
          startup_timeout_s: float = 30.0) -> MessagesServer:
    """Start a server process on an ephemeral loopback port; `stop()` it when done (or use
    `serve`). Raises `RuntimeError` with the server's stderr if it does not come up."""
    if delay_s < 0 or tool_calls < 0:
        raise ValueError("delay_s and tool_calls must be >= 0")
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--delay", repr(delay_s),
         "--tool-calls", str(tool_calls), "--port", "0", "--announce"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    reader.join(startup_timeout_s)
    url = line[0].decode().strip() if line else ""
    if not url.startswith("http://"):
        process.kill()
        _, err = process.communicate()
        raise RuntimeError(f"the messages server did not start:\n{err.decode(errors='replace')[-2000:]}")
    # Nothing more comes on stderr unless it fails; do not let a full pipe stall it.
    threading.Thread(target=_drain, args=(process,), daemon=True).start()
    return MessagesServer(url, process)


def _drain(process: subprocess.Popen[bytes]) -> None:
    if process.stderr is not None:
        for chunk in iter(lambda: process.stderr.read(4096), b""):  # type: ignore[union-attr]
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()


@contextlib.contextmanager
def serve(delay_s: float = 2.0, tool_calls: int = DEFAULT_TOOL_CALLS) -> Iterator[MessagesServer]:
    server = start(delay_s, tool_calls)
    try:
        yield server
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--delay", type=float, default=2.0, help="seconds before every reply")
    parser.add_argument("--tool-calls", type=int, default=DEFAULT_TOOL_CALLS,
                        help="bash calls before submit")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--announce", action="store_true",
                        help="started by serve(): exit when stdin closes")
    args = parser.parse_args()
    raise_open_files_limit()
    started = time.monotonic()
    try:
        asyncio.run(_serve_forever(args.delay, args.tool_calls, args.port, args.announce))
    except KeyboardInterrupt:
        pass
    if not args.announce:
        print(f"served for {time.monotonic() - started:.0f} s", file=sys.stderr)
    os._exit(0)  # the parent-watch thread may still block on stdin


if __name__ == "__main__":
    main()
