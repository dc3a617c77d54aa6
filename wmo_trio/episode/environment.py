"""The synchronous environment side of an episode.

An environment answers the three environment tools (`bash`, `read_file`, `write_file`).
`ShellEnvironment` implements their semantics once, over two primitives a concrete
environment provides: run a shell command, and write a file's bytes. Its subclasses are
`LocalDirEnvironment` (a directory on this host) and the harbor adapter (harbor's task
environment, reached through the trio engine).
"""

from __future__ import annotations

import base64
import os
import posixpath
import shlex
import signal
import subprocess
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from wmo_trio.control import CallInterrupted
from wmo_trio.episode.tools import (
    argument_problem,
    command_observation,
    decode_output,
    failure_observation,
    invalid_arguments,
    is_environment_tool,
    unavailable,
)
from wmo_trio.models import Action, ActionKind, Observation
from wmo_trio.settings import MAX_COMMAND_TIMEOUT_SEC, CommandTimeout, checked


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
        """Make the call in flight return as soon as it can; later calls fail at once."""


class CommandResult(NamedTuple):
    stdout: str
    stderr: str
    return_code: int


@dataclass(frozen=True)
class Command:
    """A step of a file write: run this shell command (it must exit 0)."""

    command: str


@dataclass(frozen=True)
class Upload:
    """A step of a file write: put these bytes at this absolute path."""

    target: str
    data: bytes


# Content up to this size travels inside a command as base64 (one round trip); larger
# content is uploaded. Well under the kernel's 128 KiB limit on a single argument.
INLINE_WRITE_LIMIT = 48 * 1024


def write_file_plan(path: str, data: bytes) -> Generator[Command | Upload, CommandResult | None, None]:
    """How to write `data` to `path` in an environment that runs shell commands: the steps,
    each sent back the result of the command it asked for. One algorithm for every such
    environment, sync or async; its driver runs the commands and uploads.

    The parent directory is computed here, not by the shell: `"$(dirname ...)"` would
    strip a trailing newline from it.
    """
    quoted = shlex.quote(path)
    parent = shlex.quote(posixpath.dirname(path) or ".")
    if len(data) <= INLINE_WRITE_LIMIT:
        encoded = base64.b64encode(data).decode("ascii")
        _check((yield Command(f"mkdir -p -- {parent} && printf %s {encoded} | base64 -d > {quoted}")))
        return
    # Resolve the path where commands run (relative paths are the task's working
    # directory), then upload the bytes to that absolute path.
    resolved = _check((yield Command(f"mkdir -p -- {parent} && realpath -m -- {quoted}")))
    yield Upload(resolved.stdout.removesuffix("\n"), data)


def _check(result: CommandResult | None) -> CommandResult:
    assert result is not None, "a Command step is always sent its result"
    if result.return_code != 0:
        raise OSError(f"exit {result.return_code}: {(result.stderr or result.stdout).strip()[:500]}")
    return result


@contextmanager
def staged(data: bytes) -> Iterator[str]:
    """`data` in a temporary file of this host, for an environment's upload."""
    fd, path = tempfile.mkstemp(prefix="wmo-trio-write-")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        yield path
    finally:
        os.unlink(path)


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
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError:
            return invalid_arguments(
                "write_file", "content holds an unpaired surrogate and is not valid text"
            )
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


class LocalDirEnvironment(ShellEnvironment):
    """Commands run by `bash -c` in a working directory of this host.

    No isolation at all: commands see the whole host. Meant for tests, trusted local runs
    and the research API. Each command runs in its own process group, which is killed on
    timeout and on `interrupt()`, children included.
    """

    def __init__(self, workdir: str | Path, *, command_timeout_sec: int = MAX_COMMAND_TIMEOUT_SEC,
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
                _kill_group(process)
                process.communicate()
                raise TimeoutError(
                    f"command timed out after {self.command_timeout_sec} s and was killed"
                ) from None
        finally:
            with self._lock:
                self._running.discard(process)
            if process.returncode is None:  # an exception escaped communicate()
                _kill_group(process)
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
            _kill_group(process)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
