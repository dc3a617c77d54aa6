"""Host side of the in-sandbox helper: start commands, stream and cap their output, kill
them with their whole process tree."""

from __future__ import annotations

import array
import asyncio
import codecs
import contextlib
import fcntl
import json
import marshal
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from wmo_trio.sandbox._errors import ChannelClosed, SpawnFailed

__all__ = ["Channel", "Completed", "OutputCap", "read_pipe", "wait_readable"]

# After the command exits, how long to wait for EOF on pipes that background processes
# still hold open (Docker's exec returns at exit too). What the command itself wrote is
# read in full whatever this is.
OUTPUT_DRAIN_SEC = 0.25
# How long a killed command may take to be reported gone before the trial is declared
# broken; the helper kills synchronously (giving up after its KILL_WAIT_SEC), so this
# is only reached if it hangs.
KILL_REPORT_SEC = 30.0

OutputCallback = Callable[[str, str], Awaitable[None]]


@dataclass(frozen=True)
class Completed:
    return_code: int
    stdout: bytes
    stderr: bytes


class OutputCap:
    """Keeps the head and the tail of a stream, never more than ``limit`` bytes, and
    counts what it dropped in between."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            # Trimmed only once it holds twice what it keeps: trimming on every chunk moves
            # the whole tail per chunk, so a long output costs its length times the tail
            # (no benchmark measures it; tests/test_sandbox_hostile.py floods many times the cap).
            if len(self.tail) > 2 * self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - min(len(self.tail), self.tail_limit)

    def value(self) -> bytes:
        return bytes(self.head) + bytes(self.tail[max(0, len(self.tail) - self.tail_limit):])


class Channel:
    """The host's end of the helper's control socket. One reader task dispatches the
    helper's replies to the commands waiting for them."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._next_id = 0
        self._waiting: dict[int, asyncio.Queue[dict[str, Any]]] = {}
        self._closed = False
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def wait_ready(self) -> None:
        await asyncio.shield(self._ready)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(self._sock, 1 << 16)
                if not data:
                    break
                message = json.loads(data)
                if message.get("op") == "ready":
                    if not self._ready.done():
                        self._ready.set_result(None)
                    continue
                queue = self._waiting.get(message.get("id", -1))
                if queue is not None:
                    queue.put_nowait(message)
        except (OSError, ValueError):
            pass
        finally:
            self._closed = True
            if not self._ready.done():
                self._ready.set_exception(ChannelClosed("the sandbox's helper exited"))
                self._ready.exception()  # seen: a launch that failed earlier never waits
            for queue in self._waiting.values():
                queue.put_nowait({"closed": True})

    async def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if self._closed:
            raise ChannelClosed("the sandbox is stopped")
        # The helper reads marshal, which it parses faster than it can import json.
        payload = marshal.dumps(message, 4)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._sock.sendmsg([payload], ancillary)
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self._sock, writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(self._sock)
            except OSError as error:
                raise ChannelClosed(f"the sandbox's helper is gone: {error}") from None

    async def close(self) -> None:
        """Stop reading, then close the socket. In that order: the reader's
        ``sock_recv`` keeps the socket's descriptor number registered in the loop's
        selector until its cancellation is processed, and once the socket is closed
        that number may belong to another file (a child process's pidfd that asyncio
        starts to watch meanwhile); the selector would then keep the stale entry for
        it, and the stale entry's removal would unwatch the new file for good."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.cancel()
        try:
            await asyncio.wait([self._reader])
        finally:
            if not self._reader.done():  # this close was cancelled before the reader ended
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        user: str | int | None = None,
        stdin: int | IO[bytes] | None = None,
        stdout: int | IO[bytes] | None = None,
        timeout_sec: float | None = None,
        output_limit: int = 4 << 20,
        callback: OutputCallback | None = None,
        stream_limit: int | None = None,
    ) -> Completed:
        """Run ``argv`` in the sandbox and wait for it.

        stdout is captured unless ``stdout`` (a host file) is given; stderr always is.
        Captured output keeps its head and tail within ``output_limit`` bytes a stream;
        a cut is reported at the end of stderr. ``callback`` receives the first
        ``stream_limit`` bytes of each stream (default ``output_limit``) as they come.
        On timeout the command's processes are killed and :class:`TimeoutError` is
        raised; if cancelled, they are killed before the cancellation propagates.
        """
        caps = {"stdout": OutputCap(output_limit), "stderr": OutputCap(output_limit)}
        with self._request() as (request_id, queue), contextlib.ExitStack() as read_ends:
            with contextlib.ExitStack() as passed:  # the command's ends: the helper's once sent
                fds, pipes = _stdio(stdin, stdout, passed, read_ends)
                await self._send({"op": "spawn", "id": request_id, "argv": list(argv),
                                  "env": dict(env), "cwd": cwd, "user": user,
                                  "tag": uuid.uuid4().hex}, fds)
            streams = [_Stream(fd, name, caps[name], callback,
                               output_limit if stream_limit is None else stream_limit)
                       for name, fd in pipes.items()]
            async with _pumping(streams) as pumps:
                finished = await self._finished(request_id, queue, timeout_sec)
                # Until EOF, or for a while if background processes hold the pipes open.
                await asyncio.wait(pumps, timeout=OUTPUT_DRAIN_SEC)
                for stream in streams:
                    stream.finish()
                await asyncio.wait(pumps)
        return _completed(int(finished["exit"]), caps)

    async def _finished(self, request_id: int, queue: asyncio.Queue[dict[str, Any]],
                        timeout_sec: float | None) -> dict[str, Any]:
        """The helper's report that the command exited. From the moment the request is
        sent, the command may be running, whether or not its start was read back yet: a
        timeout or a cancellation in this window kills it too."""
        try:
            async with asyncio.timeout(timeout_sec or None) as scope:
                started = await queue.get()
                if "error" in started:
                    raise SpawnFailed(started["error"], int(started["code"]))
                if "closed" in started:
                    raise ChannelClosed("the sandbox's helper exited")
                finished = await queue.get()
        except (SpawnFailed, ChannelClosed):
            raise
        except TimeoutError:
            if not scope.expired():
                raise
            await self._kill(request_id, queue)
            raise
        except BaseException:
            await self._kill(request_id, queue)
            raise
        if "closed" in finished:
            raise ChannelClosed("the sandbox's helper exited while a command ran")
        return finished

    async def end_others(self) -> None:
        """End every process of the sandbox but its helper, however it detached; once it
        returns, none of them is left, zombies included."""
        await self._ask({"op": "end_others"})

    async def prepare(self, dirs: Sequence[str], shared: Sequence[str]) -> str:
        """Make ``dirs`` and ``shared`` (with their parents) in the sandbox, as ``mkdir -p``
        does, the ``shared`` ones world-writable; the shell commands run with there
        (``bash``, else ``sh``)."""
        reply = await self._ask({"op": "prepare", "dirs": list(dirs), "shared": list(shared)})
        return "bash" if reply.get("shell") == "bash" else "sh"

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send a request that has one reply, and return that reply."""
        with self._request() as (request_id, queue):
            await self._send({**request, "id": request_id})
            reply = await queue.get()
        if "closed" in reply:
            raise ChannelClosed("the sandbox's helper exited")
        return reply

    @contextlib.contextmanager
    def _request(self) -> Iterator[tuple[int, asyncio.Queue[dict[str, Any]]]]:
        """A new request's id, and the queue its replies arrive on until the block ends."""
        request_id = self._next_id
        self._next_id += 1
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._waiting[request_id] = queue
        try:
            yield request_id, queue
        finally:
            del self._waiting[request_id]

    async def _kill(self, request_id: int, queue: asyncio.Queue[dict[str, Any]]) -> None:
        """Kill a command's process tree and wait until the helper reports it gone;
        shielded, so a second cancellation cannot leave it running."""

        async def kill_and_wait() -> None:
            with contextlib.suppress(ChannelClosed):
                await self._send({"op": "kill", "id": request_id})
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KILL_REPORT_SEC):
                        while True:
                            message = await queue.get()
                            if message.keys() & {"exit", "error", "closed"}:
                                return

        task = asyncio.get_running_loop().create_task(kill_and_wait())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise


def _stdio(stdin: int | IO[bytes] | None, stdout: int | IO[bytes] | None,
           passed: contextlib.ExitStack, read_ends: contextlib.ExitStack
           ) -> tuple[list[int], dict[str, int]]:
    """A command's three standard descriptors: those given, else /dev/null for stdin and
    a pipe for each captured stream; and the read ends of those pipes, by stream. What
    was opened here is closed with ``passed`` (the command's ends) and ``read_ends``."""
    fds: list[int] = []
    pipes: dict[str, int] = {}
    for name, given in (("stdin", stdin), ("stdout", stdout), ("stderr", None)):
        if given is not None:
            fds.append(given if isinstance(given, int) else given.fileno())
        elif name == "stdin":
            fds.append(os.open(os.devnull, os.O_RDONLY))
            passed.callback(os.close, fds[-1])
        else:
            read_fd, write_fd = os.pipe()
            read_ends.callback(os.close, read_fd)
            passed.callback(os.close, write_fd)
            pipes[name] = read_fd
            fds.append(write_fd)
    return fds, pipes


@contextlib.asynccontextmanager
async def _pumping(streams: Sequence[_Stream]) -> AsyncIterator[list[asyncio.Task[None]]]:
    """Each stream pumped by a task of its own until the block ends."""
    pumps = [asyncio.get_running_loop().create_task(stream.pump()) for stream in streams]
    try:
        yield pumps
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _completed(code: int, caps: Mapping[str, OutputCap]) -> Completed:
    """The command's outcome: a death by signal reported as a shell would, and a note at
    the end of stderr for each stream whose middle was cut."""
    if code < 0:
        code = 128 - code
    stderr = caps["stderr"].value()
    notes = [
        f"[wmo-trio sandbox: {name} was {cap.total:,} bytes; {cap.dropped:,} bytes in "
        f"its middle were not kept]\n"
        for name, cap in caps.items() if cap.dropped
    ]
    if notes:
        stderr += "".join(notes).encode()
    return Completed(code, caps["stdout"].value(), stderr)


class _Stream:
    """Reads one of a command's output pipes into an :class:`OutputCap`, forwarding text
    to the callback until ``limit`` bytes were forwarded, then saying once that the rest
    is not shown."""

    def __init__(self, fd: int, name: str, cap: OutputCap, callback: OutputCallback | None,
                 limit: int) -> None:
        self.fd = fd
        self.name = name
        self.cap = cap
        self.callback = callback
        self.limit = limit
        self.forwarded = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.wake: asyncio.Future[None] | None = None
        self.budget: int | None = None  # bytes still read once the command exited

    def finish(self) -> None:
        """The command exited: stop once the pipe is empty instead of waiting for EOF.
        What the command wrote is in the pipe already, so it is read whatever the
        scheduler did meanwhile; a background process that keeps writing is not
        followed beyond one pipe's worth."""
        self.budget = fcntl.fcntl(self.fd, fcntl.F_GETPIPE_SZ)
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def pump(self) -> None:
        os.set_blocking(self.fd, False)
        loop = asyncio.get_running_loop()
        while self.budget is None or self.budget > 0:
            try:
                chunk = os.read(self.fd, min(self.budget or 1 << 16, 1 << 16))
            except BlockingIOError:
                if self.budget is not None:
                    break
                self.wake = loop.create_future()
                loop.add_reader(self.fd, _settle, self.wake)
                try:
                    await self.wake
                finally:
                    loop.remove_reader(self.fd)
                    self.wake = None
                continue
            if not chunk:
                break
            if self.budget is not None:
                self.budget -= len(chunk)
            await self._forward(chunk)
        if self.callback is not None and self.forwarded <= self.limit:
            if text := self.decoder.decode(b"", final=True):
                await self.callback(text, self.name)

    async def _forward(self, chunk: bytes) -> None:
        self.cap.add(chunk)
        if self.callback is None or self.forwarded > self.limit:
            return
        if self.forwarded + len(chunk) > self.limit:
            await self.callback(f"\n[wmo-trio sandbox: further {self.name} is not streamed]\n",
                                self.name)
            self.forwarded = self.limit + 1
            return
        self.forwarded += len(chunk)
        if text := self.decoder.decode(chunk):
            await self.callback(text, self.name)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def read_pipe(fd: int, limit: int) -> bytes:
    """Read a pipe until EOF (at most ``limit`` bytes) without blocking the loop."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except BlockingIOError:
            await wait_readable(fd)
            continue
        if not chunk:
            break
        data += chunk
    return data


async def wait_readable(fd: int) -> None:
    """Wait until a non-blocking descriptor has data or EOF."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await readable
    finally:
        loop.remove_reader(fd)
