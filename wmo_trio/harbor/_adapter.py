"""The environment tools, answered by harbor's task environment.

A worker thread cannot await harbor's `environment.exec`; every call goes through the
engine's `HostCaller`, which runs it on harbor's loop inside the episode's trio task. So a
harbor timeout or the episode budget cancels the command in flight, and the failure comes
back as an error observation, never as an exception that kills the episode.
"""

from __future__ import annotations

import base64
import os
import posixpath
import shlex
import tempfile
from typing import Any

from wmo_trio.engine import HostCaller
from wmo_trio.episode.environment import (
    MAX_COMMAND_TIMEOUT_SEC,
    CommandResult,
    ShellEnvironment,
    check_command_timeout,
)

# Content up to this size travels inside the command as base64 (one round trip); larger
# content goes through harbor's upload_file, whatever its size. Well under the kernel's
# 128 KiB limit on a single argument.
INLINE_WRITE_LIMIT = 48 * 1024


class HarborEnvironmentAdapter(ShellEnvironment):
    """`bash`, `read_file` and `write_file` against a harbor `BaseEnvironment`."""

    def __init__(self, environment: Any, caller: HostCaller, *,
                 command_timeout_sec: int = MAX_COMMAND_TIMEOUT_SEC) -> None:
        self._environment = environment
        self._caller = caller
        self.command_timeout_sec = check_command_timeout(command_timeout_sec)

    def run_command(self, command: str) -> CommandResult:
        result = self._caller.call(self._exec, command)
        return CommandResult(result.stdout or "", result.stderr or "", result.return_code)

    async def _exec(self, command: str) -> Any:
        return await self._environment.exec(command, timeout_sec=self.command_timeout_sec)

    def write_file_bytes(self, path: str, data: bytes) -> None:
        quoted = shlex.quote(path)
        # The parent is computed here: "$(dirname ...)" would strip a trailing newline.
        parent = shlex.quote(posixpath.dirname(path) or ".")
        if len(data) <= INLINE_WRITE_LIMIT:
            encoded = base64.b64encode(data).decode("ascii")
            self._checked(f"mkdir -p -- {parent} && printf %s {encoded} | base64 -d > {quoted}")
            return
        # Resolve the path where commands run (relative paths are the task's working
        # directory), then upload the bytes to that absolute path.
        absolute = self._checked(
            f"mkdir -p -- {parent} && realpath -m -- {quoted}"
        ).stdout.removesuffix("\n")
        fd, temporary = tempfile.mkstemp(prefix="wmo-trio-write-")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            self._caller.call(self._environment.upload_file, temporary, absolute)
        finally:
            os.unlink(temporary)

    def _checked(self, command: str) -> CommandResult:
        result = self.run_command(command)
        if result.return_code != 0:
            raise OSError(
                f"exit {result.return_code}: {(result.stderr or result.stdout).strip()[:500]}"
            )
        return result

    def interrupt(self) -> None:
        self._caller.interrupt()
