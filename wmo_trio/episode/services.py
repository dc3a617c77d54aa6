"""The names `wmo_trio.backends.sandbox` imports from this module's old path, until that
module (branch craftsbx) imports them from `wmo_trio.episode._services`; then delete this file."""

from wmo_trio.episode._services import EpisodeEnded, EpisodeServices, episode_spec

__all__ = ["EpisodeEnded", "EpisodeServices", "episode_spec"]
