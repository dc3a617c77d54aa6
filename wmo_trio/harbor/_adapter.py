"""The environment tools, answered by harbor's task environment.

A worker thread cannot await harbor's `environment.exec`; every call goes to harbor's loop
through the episode's `CallControl.run_host`. So a harbor timeout or the episode budget
cancels the command in flight, and the failure comes back as an error observation, never
as an exception that kills the episode.
"""

from __future__ import annotations

from typing import Any

from wmo_trio.control import CallControl
from wmo_trio.episode.environment import (
    Command,
    CommandResult,
    ShellEnvironment,
    check_command_timeout,
    staged,
    write_file_plan,
)
from wmo_trio.settings import MAX_COMMAND_TIMEOUT_SEC


class HarborEnvironmentAdapter(ShellEnvironment):
    """`bash`, `read_file` and `write_file` against a harbor `BaseEnvironment`, from the
    episode's worker thread."""

    def __init__(self, environment: Any, control: CallControl, *,
                 command_timeout_sec: int = MAX_COMMAND_TIMEOUT_SEC) -> None:
        self._environment = environment
        self._control = control
        self.command_timeout_sec = check_command_timeout(command_timeout_sec)

    def run_command(self, command: str) -> CommandResult:
        result = self._control.run_host(self._exec, command)
        return CommandResult(result.stdout or "", result.stderr or "", result.return_code)

    async def _exec(self, command: str) -> Any:
        return await self._environment.exec(command, timeout_sec=self.command_timeout_sec)

    def write_file_bytes(self, path: str, data: bytes) -> None:
        plan = write_file_plan(path, data)
        reply: CommandResult | None = None
        while True:
            try:
                step = plan.send(reply)
            except StopIteration:
                return
            if isinstance(step, Command):
                reply = self.run_command(step.command)
            else:
                with staged(step.data) as source:
                    self._control.run_host(self._environment.upload_file, source, step.target)
                reply = None
