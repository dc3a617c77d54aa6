"""The synchronous environment side of an episode.

An environment answers the three environment tools (`bash`, `read_file`, `write_file`).
`ShellEnvironment` implements their semantics once, over two primitives a concrete
environment provides: run a shell command, and write a file's bytes. Its subclasses are
`DirectoryShell` (a directory on this host) and the harbor adapter (harbor's task
environment, reached through the trio engine). `HarborShell` is how a harbor task
environment runs commands and writes files, for that adapter and for trio code alike.
"""

from __future__ import annotations

import asyncio
import base64
import os
import posixpath
import shlex
import signal
import subprocess
import tempfile
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from wmo_trio._text import has_lone_surrogate
from wmo_trio.control import CallInterrupted
from wmo_trio.episode._tools import (
    argument_problem,
    command_observation,
    decode_output,
    failure_observation,
    invalid_arguments,
    is_environment_tool,
    unavailable,
)
from wmo_trio.models import Action, ActionKind, Observation
from wmo_trio.settings import DEFAULT_COMMAND_TIMEOUT_SEC, CommandTimeout, checked


def check_command_timeout(value: object, *, name: str = "command_timeout_sec") -> int:
    timeout: int = checked(CommandTimeout, value, name)
    return timeout


@runtime_checkable
class Environment(Protocol):
    """What an episode needs from its environment. `execute` must not raise for failures
    of the command itself; those are observations the agent can react to."""

    def execute(self, action: Action) -> Observation: ...


@runtime_checkable
class Interruptible(Protocol):
    def interrupt(self) -> None:
        """Make the call in flight return as soon as it can; later calls fail at once.
        Called from any thread, the engine's trio thread included: quick (a signal, a
        flag), never waiting on I/O."""


class CommandResult(NamedTuple):
    stdout: str
    stderr: str
    return_code: int


# Content up to this size travels inside a command as base64 (one round trip); larger
# content is uploaded. Well under the kernel's 128 KiB limit on a single argument.
INLINE_WRITE_LIMIT = 48 * 1024


class HarborShell:
    """A harbor task environment's commands and file writes, as coroutines on the
    environment's own asyncio loop: the one implementation behind the harbor agent's
    adapter (from an episode's worker thread) and the research API's `HarborEnvironment`
    (from trio code). It needs only `BaseEnvironment`'s `exec(command, timeout_sec=...)`
    and `upload_file(source, target)`, so nothing here imports harbor.
    """

    def __init__(self, environment: Any, *, command_timeout_sec: int = DEFAULT_COMMAND_TIMEOUT_SEC) -> None:
        self.environment = environment
        self.command_timeout_sec = check_command_timeout(command_timeout_sec)

    async def exec(self, command: str) -> CommandResult:
        """Run `command` within the command timeout; harbor may leave out empty streams."""
        result = await self.environment.exec(command, timeout_sec=self.command_timeout_sec)
        return CommandResult(result.stdout or "", result.stderr or "", result.return_code)

    async def write_file(self, path: str, data: bytes) -> None:
        """Write `data` to `path` exactly, creating parent directories: small content inside
        one command, larger content uploaded to the path as the task's shell resolves it
        (a relative path is in the task's working directory).

        The parent directory is computed here, not by the shell: `"$(dirname ...)"` would
        strip a trailing newline from it.
        """
        quoted = shlex.quote(path)
        parent = shlex.quote(posixpath.dirname(path) or ".")
        if len(data) <= INLINE_WRITE_LIMIT:
            encoded = base64.b64encode(data).decode("ascii")
            _check(await self.exec(f"mkdir -p -- {parent} && printf %s {encoded} | base64 -d > {quoted}"))
            return
        resolved = _check(await self.exec(f"mkdir -p -- {parent} && realpath -m -- {quoted}"))
        fd, source = tempfile.mkstemp(prefix="wmo-trio-write-")
        try:
            # Staged in a thread, off the loop. Shielded: the thread always runs, and
            # closes the file itself, even when this write is cancelled meanwhile.
            await asyncio.shield(asyncio.to_thread(_write_and_close, fd, data))
            await self.environment.upload_file(source, resolved.stdout.removesuffix("\n"))
        finally:
            os.unlink(source)


def _check(result: CommandResult) -> CommandResult:
    if result.return_code != 0:
        raise OSError(f"exit {result.return_code}: {(result.stderr or result.stdout).strip()[:500]}")
    return result


def _write_and_close(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def kill_process_group(pid: int) -> None:
    """Kill a command started in a session of its own, and every process it started."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def command_timed_out(limit_s: float) -> TimeoutError:
    """What a command that ran out of its timeout (and was killed) raises."""
    return TimeoutError(f"command timed out after {limit_s:g} s and was killed")


class ShellEnvironment(ABC):
    """The environment tools over `run_command` and `write_file_bytes`."""

    def execute(self, action: Action) -> Observation:
        try:
            return self._execute(action)
        except Exception as error:  # any failure of the call is feedback, not a crash
            return failure_observation(error)

    def _execute(self, action: Action) -> Observation:
        if action.kind is not ActionKind.TOOL_CALL or not is_environment_tool(action.name):
            return unavailable(action.name)
        tool = action.name
        assert tool is not None
        arguments = action.arguments if action.arguments is not None else {}
        problem = argument_problem(tool, arguments)
        if problem is not None:
            return invalid_arguments(tool, problem)
        if tool == "bash":
            return command_observation(*self.run_command(arguments["command"]))
        if tool == "read_file":
            return command_observation(*self.run_command(f"cat -- {shlex.quote(arguments['path'])}"))
        path, content = arguments["path"], arguments["content"]
        if has_lone_surrogate(content):
            return invalid_arguments(
                "write_file", "content holds an unpaired surrogate and is not valid text"
            )
        data = content.encode("utf-8")
        self.write_file_bytes(path, data)
        return Observation(content=f"wrote {path}", metadata={"bytes": len(data)})

    @abstractmethod
    def run_command(self, command: str) -> CommandResult:
        """Run a shell command to completion within the command timeout."""

    @abstractmethod
    def write_file_bytes(self, path: str, data: bytes) -> None:
        """Write `data` to `path` exactly, creating parent directories."""

    def interrupt(self) -> None:
        """Stop the command in flight; the default environment has nothing to stop."""

    def close(self) -> None:
        """Release resources. Idempotent."""


class DirectoryShell(ShellEnvironment):
    """Commands run by `bash -c` in a working directory of this host.

    No isolation at all: commands see the whole host. Meant for tests, trusted local runs
    and the research API. Each command runs in its own process group, which is killed on
    timeout and on `interrupt()`, children included.
    """

    def __init__(self, workdir: str | Path, *, command_timeout_sec: int = DEFAULT_COMMAND_TIMEOUT_SEC,
                 shell: str = "/bin/bash") -> None:
        self.workdir = Path(workdir)
        self.command_timeout_sec = check_command_timeout(command_timeout_sec)
        self._shell = shell
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()
        self._interrupted = False

    def run_command(self, command: str) -> CommandResult:
        with self._lock:
            if self._interrupted:
                raise CallInterrupted("the episode is stopping; command not started")
            process = subprocess.Popen(
                [self._shell, "-c", command],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self._running.add(process)
        try:
            try:
                stdout, stderr = process.communicate(timeout=self.command_timeout_sec)
            except subprocess.TimeoutExpired:
                kill_process_group(process.pid)
                process.communicate()
                raise command_timed_out(self.command_timeout_sec) from None
        finally:
            with self._lock:
                self._running.discard(process)
            if process.returncode is None:  # an exception escaped communicate()
                kill_process_group(process.pid)
                process.wait()
        if self._interrupted:
            raise CallInterrupted("command killed: the episode is stopping")
        return CommandResult(decode_output(stdout), decode_output(stderr), process.returncode)

    def write_file_bytes(self, path: str, data: bytes) -> None:
        target = self.workdir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            running = list(self._running)
        for process in running:
            kill_process_group(process.pid)
