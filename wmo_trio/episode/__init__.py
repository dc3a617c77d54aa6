"""One episode: its program, the rules it runs under, its tools and its environments.

- `portable`: the programs (the built-in loop, a document's `code:runtime`) and their kit;
  standard library only, so the same file runs in a sandbox;
- `services`: the host side, where every rule of an episode is decided;
- `channel`: the host's end of a program's channel, where what a program may send is
  decided for every backend;
- `runtime`: `EpisodeRuntime`, which runs an episode in this process;
- `environment`, `tools`: the environment tools and how their output becomes observations.
"""

from wmo_trio.episode.environment import (
    CommandResult,
    Environment,
    Interruptible,
    LocalDirEnvironment,
    ShellEnvironment,
)
from wmo_trio.episode.log import EpisodeLog
from wmo_trio.episode.runtime import DEFAULT_EPISODE_TIMEOUT_SEC, EpisodeRuntime

__all__ = [
    "DEFAULT_EPISODE_TIMEOUT_SEC",
    "CommandResult",
    "Environment",
    "EpisodeLog",
    "EpisodeRuntime",
    "Interruptible",
    "LocalDirEnvironment",
    "ShellEnvironment",
]
