"""One episode: the synchronous loop, its tools and its environments."""

from wmo_trio.episode.environment import (
    CommandResult,
    Environment,
    EnvironmentInterrupted,
    Interruptible,
    LocalDirEnvironment,
    ShellEnvironment,
)
from wmo_trio.episode.runtime import DEFAULT_EPISODE_TIMEOUT_S, EpisodeLog, EpisodeRuntime

__all__ = [
    "DEFAULT_EPISODE_TIMEOUT_S",
    "CommandResult",
    "Environment",
    "EnvironmentInterrupted",
    "EpisodeLog",
    "EpisodeRuntime",
    "Interruptible",
    "LocalDirEnvironment",
    "ShellEnvironment",
]
