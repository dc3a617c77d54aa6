"""The names `wmo_trio.backends.sandbox` imports from this module's old path, until that
module (branch craftsbx) imports them from `wmo_trio.episode._channel`; then delete this file."""

from wmo_trio.episode._channel import ProtocolViolation, refuse

__all__ = ["ProtocolViolation", "refuse"]
