"""A loopback stand-in for E2B: its control-plane API and the daemon inside each sandbox.

The real `e2b` SDK (and harbor's `E2BEnvironment`, which uses it) talks to this server
unchanged once `E2B_API_URL` and `E2B_SANDBOX_URL` point at it (see `FakeE2B.environment`).
It serves:

- the API: `POST /v2/sandboxes` (create), `DELETE /sandboxes/{id}` (kill),
  `POST /sandboxes/{id}/timeout`, `GET /templates/aliases/{alias}` (every alias exists,
  so harbor never asks for a template build);
- envd, the in-sandbox daemon (one server for every sandbox; the SDK names the sandbox in
  its `E2b-Sandbox-Id` header): the Connect services `process.Process` (Start streams a
  command's stdout, stderr and exit; SendInput writes its stdin; SendSignal kills it) and
  `filesystem.Filesystem` (Stat, ListDir, MakeDir, Remove), served by the server halves of
  the SDK's own generated stubs, plus `GET/POST /files` and `/health`.

A "sandbox" is real processes on this host. As root, each sandbox gets a private root
filesystem: an overlay over the host's `/` in a mount namespace of its own, commands
chrooted into it. So a task's `/app` or `/logs` lands in the sandbox, never on the host,
and killing the sandbox throws its files away. Without root, commands run on the host
itself (`FakeE2B.isolated` is False) and only tests whose files stay in unique paths fit.

Every sandbox's lifetime is recorded (`created`, `killed`, `expired`) and faults can be
injected (`Faults`): 429 answers to creation, a process killed when its N-th stdin write
arrives, a non-JSON line on a process's stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as fs_pb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from e2b.envd.process import process_pb as pr_pb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof

ENVD_VERSION = "0.5.7"
API_KEY = "e2b_fake_key"
HOME = "/home/user"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_GARBAGE = b"this line is not a JSON frame\n"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Faults:
    """Failures to inject. The stdin faults are one-shot: they apply to the first process
    that reaches the count, then clear themselves."""

    rate_limited_creations: int = 0
    """Answer this many of the next creation requests with 429 (Retry-After: 0)."""
    kill_at_input: int | None = None
    """Kill the process instead of delivering its N-th stdin write (it dies waiting)."""
    garbage_at_input: int | None = None
    """Before delivering the N-th stdin write, put a non-JSON line on the process's stdout."""


# -- the sandbox's filesystem ----------------------------------------------------------------


def isolation_available() -> bool:
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("unshare", "nsenter", "chroot"))


class SandboxRoot:
    """Where a sandbox's files live and how its commands are started."""

    def __init__(self, isolated: bool) -> None:
        self.isolated = isolated
        self.state = Path(tempfile.mkdtemp(prefix="wmo-e2b-fake-"))
        self._holder: subprocess.Popen[bytes] | None = None
        if isolated:
            self._start_holder()

    def _start_holder(self) -> None:
        # The holder owns a mount namespace whose overlay root the commands chroot into; it
        # exits when its stdin closes, and the namespace's mounts go with the last process.
        for name in ("upper", "work", "root"):
            (self.state / name).mkdir()
        state = str(self.state)
        script = (
            "set -e\n"
            f"mount -t overlay overlay -o lowerdir=/,upperdir={state}/upper,workdir={state}/work "
            f"{state}/root\n"
            f"for d in proc dev sys; do mount --rbind /$d {state}/root/$d; done\n"
            "echo ready\n"
            "read _ || true\n"
        )
        self._holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert self._holder.stdout is not None
        line = self._holder.stdout.readline()
        if line.strip() != b"ready":
            _, err = self._holder.communicate(timeout=5)
            raise RuntimeError(f"cannot build the sandbox root: {err.decode(errors='replace')}")

    def host_path(self, path: str) -> Path:
        """The host path of a sandbox path (relative paths are under the user's home)."""
        if self._holder is None:  # no isolation: sandbox paths are host paths
            return Path(path) if path.startswith("/") else self.state / path
        posix = PurePosixPath(path if path.startswith("/") else f"{HOME}/{path}")
        # /proc/<pid>/root resolves through the holder's mount namespace, overlay included.
        return Path(f"/proc/{self._holder.pid}/root{self.state}/root{posix}")

    def command(self, argv: list[str], cwd: str) -> tuple[list[str], str | None]:
        """The host argv (and host cwd) that runs `argv` in the sandbox at `cwd`."""
        self.host_path(cwd).mkdir(parents=True, exist_ok=True)  # as if the template had it
        if self._holder is None:
            return argv, str(self.host_path(cwd))
        return ["nsenter", "-t", str(self._holder.pid), "-m", "--", "chroot",
                f"{self.state}/root", "/usr/bin/env", "-C", cwd, "--", *argv], None

    def destroy(self) -> None:
        if self._holder is not None and self._holder.poll() is None:
            assert self._holder.stdin is not None
            self._holder.stdin.close()
            try:
                self._holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._holder.kill()
                self._holder.wait()
        shutil.rmtree(self.state, ignore_errors=True)


# -- processes -------------------------------------------------------------------------------


@dataclass
class FakeProcess:
    pid: int
    argv: list[str]
    cwd: str
    stdin: bool
    process: asyncio.subprocess.Process
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    inputs: int = 0
    exit_code: int | None = None

    @property
    def command(self) -> str:
        return " ".join(self.argv)

    async def pump(self) -> None:
        async def forward(stream: asyncio.StreamReader | None, kind: str) -> None:
            assert stream is not None
            while chunk := await stream.read(65536):
                await self.events.put((kind, chunk))

        await asyncio.gather(forward(self.process.stdout, "stdout"),
                             forward(self.process.stderr, "stderr"))
        self.exit_code = await self.process.wait()
        await self.events.put(("end", self.exit_code))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


class FakeSandbox:
    def __init__(self, sandbox_id: str, template: str, timeout: int, envs: dict[str, str],
                 root: SandboxRoot) -> None:
        self.id = sandbox_id
        self.template = template
        self.timeout = timeout
        self.timeouts = [timeout]
        self.envs = envs
        self.root = root
        self.processes: dict[int, FakeProcess] = {}
        self.alive = True
        self.expiry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def spawn(self, config: pr_pb.ProcessConfig | None, stdin: bool) -> FakeProcess:
        if config is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "no process config")
        argv = [config.cmd, *config.args]
        cwd = config.cwd if config.has_field("cwd") and config.cwd else HOME
        host_argv, host_cwd = self.root.command(argv, cwd)
        env = {"PATH": _PATH, "HOME": "/root", "USER": "root", "LANG": "C.UTF-8",
               **self.envs, **dict(config.envs)}
        process = await asyncio.create_subprocess_exec(
            *host_argv, cwd=host_cwd, env=env, start_new_session=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        fake = FakeProcess(pid=process.pid, argv=argv, cwd=cwd, stdin=stdin, process=process)
        self.processes[fake.pid] = fake
        task = asyncio.get_running_loop().create_task(fake.pump())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return fake

    async def kill(self) -> None:
        self.alive = False
        if self.expiry is not None:
            self.expiry.cancel()
        for process in self.processes.values():
            process.kill()
        for process in self.processes.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.process.wait(), 10)
        await asyncio.to_thread(self.root.destroy)


# -- the envd Connect services ---------------------------------------------------------------


def _started(pid: int) -> pr_pb.StartResponse:
    start = pr_pb.ProcessEvent.StartEvent(pid=pid)
    return pr_pb.StartResponse(event=pr_pb.ProcessEvent(event=Oneof("start", start)))


def _output(kind: str, chunk: bytes) -> pr_pb.StartResponse:
    data = pr_pb.ProcessEvent.DataEvent(
        output=Oneof("stdout", chunk) if kind == "stdout" else Oneof("stderr", chunk))
    return pr_pb.StartResponse(event=pr_pb.ProcessEvent(event=Oneof("data", data)))


def _ended(exit_code: int) -> pr_pb.StartResponse:
    end = pr_pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=True,
                                      status=f"exit status {exit_code}")
    return pr_pb.StartResponse(event=pr_pb.ProcessEvent(event=Oneof("end", end)))


class ProcessService(Process):
    """The methods the SDK uses; the generated base answers UNIMPLEMENTED for the rest."""

    def __init__(self, fake: FakeE2B) -> None:
        self._fake = fake

    async def start(self, request: pr_pb.StartRequest,
                    ctx: RequestContext[Any, Any]) -> AsyncIterator[pr_pb.StartResponse]:
        sandbox = self._fake.sandbox_of(ctx)
        stdin = request.stdin if request.has_field("stdin") else True
        process = await sandbox.spawn(request.process, stdin)
        yield _started(process.pid)
        while True:
            kind, value = await process.events.get()
            if kind == "end":
                yield _ended(value)
                return
            yield _output(kind, value)

    def _process(self, ctx: RequestContext[Any, Any],
                 selector: pr_pb.ProcessSelector | None) -> FakeProcess:
        sandbox = self._fake.sandbox_of(ctx)
        pid = selector.selector.value if selector is not None and selector.selector else None
        process = sandbox.processes.get(pid) if isinstance(pid, int) else None
        if process is None or process.exit_code is not None:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        return process

    async def send_input(self, request: pr_pb.SendInputRequest,
                         ctx: RequestContext[Any, Any]) -> pr_pb.SendInputResponse:
        process = self._process(ctx, request.process)
        data = request.input.input.value if request.input and request.input.input else b""
        process.inputs += 1
        faults = self._fake.faults
        if faults.kill_at_input == process.inputs:
            faults.kill_at_input = None
            process.kill()
            return pr_pb.SendInputResponse()
        if faults.garbage_at_input == process.inputs:
            faults.garbage_at_input = None
            await process.events.put(("stdout", _GARBAGE))
        stream = process.process.stdin
        if stream is None:
            raise ConnectError(Code.FAILED_PRECONDITION, "the process was started without stdin")
        try:
            stream.write(data)
            await stream.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise ConnectError(Code.NOT_FOUND, "the process is gone") from None
        return pr_pb.SendInputResponse()

    async def close_stdin(self, request: pr_pb.CloseStdinRequest,
                          ctx: RequestContext[Any, Any]) -> pr_pb.CloseStdinResponse:
        stream = self._process(ctx, request.process).process.stdin
        if stream is not None:
            stream.close()
        return pr_pb.CloseStdinResponse()

    async def send_signal(self, request: pr_pb.SendSignalRequest,
                          ctx: RequestContext[Any, Any]) -> pr_pb.SendSignalResponse:
        self._process(ctx, request.process).kill()
        return pr_pb.SendSignalResponse()

    async def list(self, request: pr_pb.ListRequest,
                   ctx: RequestContext[Any, Any]) -> pr_pb.ListResponse:
        sandbox = self._fake.sandbox_of(ctx)
        return pr_pb.ListResponse(processes=[
            pr_pb.ProcessInfo(pid=p.pid, config=pr_pb.ProcessConfig(cmd=p.argv[0], args=p.argv[1:],
                                                                    cwd=p.cwd))
            for p in sandbox.processes.values() if p.exit_code is None
        ])


def _entry(path: str, host: Path) -> fs_pb.EntryInfo:
    info = host.lstat()
    kind = (fs_pb.FileType.DIRECTORY if stat.S_ISDIR(info.st_mode)
            else fs_pb.FileType.SYMLINK if stat.S_ISLNK(info.st_mode) else fs_pb.FileType.FILE)
    return fs_pb.EntryInfo(
        name=PurePosixPath(path).name, type=kind, path=path, size=info.st_size,
        mode=stat.S_IMODE(info.st_mode), permissions=stat.filemode(info.st_mode),
        owner="root", group="root", is_symlink=stat.S_ISLNK(info.st_mode),
    )


def _absolute(path: str) -> str:
    return path if path.startswith("/") else f"{HOME}/{path}"


class FilesystemService(Filesystem):
    def __init__(self, fake: FakeE2B) -> None:
        self._fake = fake

    def _host(self, ctx: RequestContext[Any, Any], path: str) -> Path:
        return self._fake.sandbox_of(ctx).root.host_path(path)

    async def stat(self, request: fs_pb.StatRequest,
                   ctx: RequestContext[Any, Any]) -> fs_pb.StatResponse:
        host = self._host(ctx, request.path)
        if not host.exists():
            raise ConnectError(Code.NOT_FOUND, f"path not found: {request.path}")
        return fs_pb.StatResponse(entry=_entry(_absolute(request.path), host))

    async def list_dir(self, request: fs_pb.ListDirRequest,
                       ctx: RequestContext[Any, Any]) -> fs_pb.ListDirResponse:
        base = _absolute(request.path).rstrip("/") or "/"
        host = self._host(ctx, base)
        if not host.is_dir():
            raise ConnectError(Code.NOT_FOUND, f"directory not found: {request.path}")
        entries = []

        def walk(directory: Path, path: str, depth: int) -> None:
            for child in sorted(directory.iterdir()):
                child_path = f"{path.rstrip('/')}/{child.name}"
                entries.append(_entry(child_path, child))
                if depth > 1 and child.is_dir() and not child.is_symlink():
                    walk(child, child_path, depth - 1)

        walk(host, base, max(1, request.depth))
        return fs_pb.ListDirResponse(entries=entries)

    async def make_dir(self, request: fs_pb.MakeDirRequest,
                       ctx: RequestContext[Any, Any]) -> fs_pb.MakeDirResponse:
        host = self._host(ctx, request.path)
        if host.exists():
            raise ConnectError(Code.ALREADY_EXISTS, f"path already exists: {request.path}")
        host.mkdir(parents=True)
        return fs_pb.MakeDirResponse(entry=_entry(_absolute(request.path), host))

    async def remove(self, request: fs_pb.RemoveRequest,
                     ctx: RequestContext[Any, Any]) -> fs_pb.RemoveResponse:
        host = self._host(ctx, request.path)
        if host.is_dir() and not host.is_symlink():
            shutil.rmtree(host)
        else:
            host.unlink(missing_ok=True)
        return fs_pb.RemoveResponse()


# -- the server ------------------------------------------------------------------------------


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


async def _respond(send: Send, status: int, body: bytes | Any = b"",
                   headers: dict[str, str] | None = None) -> None:
    content_type = "application/octet-stream"
    if not isinstance(body, bytes):
        body, content_type = json.dumps(body).encode(), "application/json"
    raw_headers = [(b"content-type", content_type.encode()),
                   (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class FakeE2B:
    """The fake service, served on 127.0.0.1 from a background thread while in use::

        with FakeE2B() as fake:
            monkeypatch.setenv(...fake.environment())
    """

    def __init__(self, *, isolated: bool | None = None) -> None:
        self.isolated = isolation_available() if isolated is None else isolated
        self.faults = Faults()
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.created: list[str] = []
        self.killed: list[str] = []
        self.expired: list[str] = []
        self.creation_requests = 0
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()
        self._process_app = ProcessASGIApplication(ProcessService(self))
        self._fs_app = FilesystemASGIApplication(FilesystemService(self))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> FakeE2B:
        sock = socket.socket()
        # Accepted connections inherit it: without it small replies wait for delayed ACKs.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self._asgi, interface="asgi3", log_level="warning", lifespan="off",
                                access_log=False,
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        server = self._server

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        self._thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True,
                                        name="e2b-fake")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake E2B server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._loop is not None and self._server is not None and self._thread is not None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._kill_all(), self._loop).result(30)
        self._server.should_exit = True
        self._thread.join(15)

    async def _kill_all(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            if sandbox.alive:
                await sandbox.kill()

    def environment(self) -> dict[str, str]:
        """The variables that point the e2b SDK (and harbor's E2BEnvironment) here."""
        return {"E2B_API_KEY": API_KEY, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    # -- what tests read -----------------------------------------------------------------------

    def alive(self) -> list[str]:
        return [sid for sid, sandbox in self.sandboxes.items() if sandbox.alive]

    def processes(self, sandbox_id: str) -> list[FakeProcess]:
        return list(self.sandboxes[sandbox_id].processes.values())

    def running_processes(self) -> int:
        return sum(1 for sandbox in self.sandboxes.values()
                   for process in sandbox.processes.values() if process.exit_code is None)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("the fake E2B never reached the expected state")
            time.sleep(0.01)

    # -- routing -----------------------------------------------------------------------------

    def sandbox_of(self, ctx: RequestContext[Any, Any]) -> FakeSandbox:
        sandbox_id = ctx.request_headers.get("e2b-sandbox-id", "")
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or not sandbox.alive:
            raise ConnectError(Code.NOT_FOUND, f"sandbox {sandbox_id!r} not found")
        return sandbox

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if path.startswith(("/process.Process/", "/filesystem.Filesystem/", "/files", "/health")):
            sandbox = self.sandboxes.get(headers.get("e2b-sandbox-id", ""))
            if sandbox is None or not sandbox.alive:
                # What E2B's proxy answers for a sandbox that no longer runs.
                await _read_body(receive)
                await _respond(send, 502, {"message": "The sandbox was not found", "code": 502})
                return
            if path.startswith("/process.Process/"):
                await self._process_app(scope, receive, send)
            elif path.startswith("/filesystem.Filesystem/"):
                await self._fs_app(scope, receive, send)
            elif path == "/health":
                await _read_body(receive)
                await _respond(send, 204)
            else:
                await self._files(sandbox, scope, headers, await _read_body(receive), send)
            return
        body = await _read_body(receive)
        await self._api(scope["method"], path, body, send)

    async def _api(self, method: str, path: str, body: bytes, send: Send) -> None:
        parts = path.strip("/").split("/")
        if method == "POST" and parts == ["v2", "sandboxes"]:
            await self._create(json.loads(body or b"{}"), send)
        elif method == "DELETE" and len(parts) == 2 and parts[0] == "sandboxes":
            sandbox = self.sandboxes.get(parts[1])
            if sandbox is None or not sandbox.alive:
                await _respond(send, 404, {"code": 404, "message": f"sandbox {parts[1]} not found"})
                return
            self.killed.append(sandbox.id)
            await sandbox.kill()
            await _respond(send, 204)
        elif method == "POST" and len(parts) == 3 and parts[0] == "sandboxes" and parts[2] == "timeout":
            sandbox = self.sandboxes.get(parts[1])
            if sandbox is None or not sandbox.alive:
                await _respond(send, 404, {"code": 404, "message": f"sandbox {parts[1]} not found"})
                return
            self._set_timeout(sandbox, int(json.loads(body)["timeout"]))
            await _respond(send, 204)
        elif method == "GET" and parts[:2] == ["templates", "aliases"]:
            await _respond(send, 200, {"templateID": parts[-1], "public": False})
        else:
            await _respond(send, 404, {"code": 404, "message": f"{method} {path} is not faked"})

    async def _create(self, request: dict[str, Any], send: Send) -> None:
        self.creation_requests += 1
        if self.faults.rate_limited_creations > 0:
            self.faults.rate_limited_creations -= 1
            await _respond(send, 429, {"code": 429, "message": "rate limit exceeded"},
                           {"Retry-After": "0"})
            return
        sandbox_id = f"fake{next(self._ids)}{uuid.uuid4().hex[:6]}"
        try:
            root = await asyncio.to_thread(SandboxRoot, self.isolated)
        except RuntimeError as error:
            await _respond(send, 500, {"code": 500, "message": str(error)})
            return
        sandbox = FakeSandbox(sandbox_id, request.get("templateID", "base"),
                              int(request.get("timeout", 300)), dict(request.get("envVars") or {}),
                              root)
        self.sandboxes[sandbox_id] = sandbox
        self.created.append(sandbox_id)
        self._set_timeout(sandbox, sandbox.timeout)
        await _respond(send, 201, {
            "sandboxID": sandbox_id, "templateID": sandbox.template, "clientID": "fake",
            "envdVersion": ENVD_VERSION, "envdAccessToken": None, "domain": None,
        })

    def _set_timeout(self, sandbox: FakeSandbox, timeout: int) -> None:
        # Like E2B, a sandbox whose timeout passes is killed whoever still uses it.
        if sandbox.expiry is not None:
            sandbox.expiry.cancel()
        if sandbox.timeouts[-1] != timeout:
            sandbox.timeouts.append(timeout)
        sandbox.timeout = timeout
        loop = asyncio.get_running_loop()

        def expire() -> None:
            if sandbox.alive:
                self.expired.append(sandbox.id)
                task = loop.create_task(sandbox.kill())
                self._background.add(task)
                task.add_done_callback(self._background.discard)

        sandbox.expiry = loop.call_later(timeout, expire)

    async def _files(self, sandbox: FakeSandbox, scope: Scope, headers: dict[str, str],
                     body: bytes, send: Send) -> None:
        query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        if scope["method"] == "GET":
            host = sandbox.root.host_path(query.get("path", ""))
            if not host.is_file():
                await _respond(send, 404, {"code": 404, "message": f"file not found: {query.get('path')}"})
                return
            await _respond(send, 200, host.read_bytes())
            return
        content_type = headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            message = BytesParser(policy=HTTP).parsebytes(
                b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
            files = []
            for part in message.iter_parts():
                payload = part.get_payload(decode=True)
                files.append((part.get_filename() or query.get("path", ""),
                              payload if isinstance(payload, bytes) else b""))
        else:
            files = [(query.get("path", ""), body)]
        written = []
        for path, data in files:
            host = sandbox.root.host_path(path)
            host.parent.mkdir(parents=True, exist_ok=True)
            host.write_bytes(data)
            written.append({"name": PurePosixPath(path).name, "type": "file", "path": _absolute(path)})
        await _respond(send, 200, written)
