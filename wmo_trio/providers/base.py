"""The names `wmo_trio.backends.sandbox` imports from this module's old path, until that
module (branch craftsbx) imports them from `wmo_trio.providers._base`; then delete this file."""

from wmo_trio.providers._base import Provider

__all__ = ["Provider"]
