"""The environment tools, answered by harbor's task environment.

A worker thread cannot await harbor's `environment.exec`; every call goes to harbor's loop
through the episode's `CallControl.run_host`, where `HarborShell` runs it. So a harbor
timeout or the episode budget cancels the command in flight, and the failure comes back
as an error observation, never as an exception that kills the episode.
"""

from __future__ import annotations

from typing import Any

from wmo_trio.control import CallControl
from wmo_trio.episode._environment import CommandResult, HarborShell, ShellEnvironment
from wmo_trio.settings import DEFAULT_COMMAND_TIMEOUT_SEC


class HarborEnvironmentAdapter(ShellEnvironment):
    """`bash`, `read_file` and `write_file` against a harbor `BaseEnvironment`, from the
    episode's worker thread."""

    def __init__(self, environment: Any, control: CallControl, *,
                 command_timeout_sec: int = DEFAULT_COMMAND_TIMEOUT_SEC) -> None:
        self._shell = HarborShell(environment, command_timeout_sec=command_timeout_sec)
        self._control = control
        self.command_timeout_sec = self._shell.command_timeout_sec

    def run_command(self, command: str) -> CommandResult:
        return self._control.run_host(self._shell.exec, command)

    def write_file_bytes(self, path: str, data: bytes) -> None:
        self._control.run_host(self._shell.write_file, path, data)
