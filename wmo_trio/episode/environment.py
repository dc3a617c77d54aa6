"""The names `wmo_trio.backends.sandbox` imports from this module's old path, until that
module (branch craftsbx) imports them from `wmo_trio.episode._environment`; then delete this file."""

from wmo_trio.episode._environment import Environment

__all__ = ["Environment"]
