"""One episode: its program, the rules it runs under, its tools and its environments.

- `portable`: the programs (the built-in loop, a document's `code:runtime`) and their kit;
  standard library only, so the same file runs in a sandbox (it keeps a public file name:
  the `e2b` and `sandbox` backends ship it by that name);
- `_services`: the host side, where every rule of an episode is decided;
- `_channel`: the host's end of a program's channel, where what a program may send is
  decided for every backend;
- `_execution`: `ExecutionBase`, what every backend's execution of an episode shares, and
  `LocalExecution`, which runs an episode in this process;
- `_environment`, `_tools`: the environment tools and how their output becomes observations.
"""

from wmo_trio.episode._environment import (
    CommandResult,
    DirectoryShell,
    Environment,
    Interruptible,
    ShellEnvironment,
)
from wmo_trio.episode._execution import (
    DEFAULT_EPISODE_TIMEOUT_SEC,
    BackendEpisode,
    Execution,
    ExecutionBase,
    LocalExecution,
)
from wmo_trio.episode._log import EpisodeLog

__all__ = [
    "DEFAULT_EPISODE_TIMEOUT_SEC",
    "BackendEpisode",
    "CommandResult",
    "DirectoryShell",
    "Environment",
    "EpisodeLog",
    "Execution",
    "ExecutionBase",
    "Interruptible",
    "LocalExecution",
    "ShellEnvironment",
]
