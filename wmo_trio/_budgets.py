"""An episode's time budgets, their defaults and bounds, as plain numbers.

`wmo_trio.settings` checks every argument against them; the command line shows them in its
options' defaults and help, and imports this module alone, without pydantic, so that its
start stays quick.
"""

from __future__ import annotations

MAX_COMMAND_TIMEOUT_SEC = 240
"""Longest timeout of one environment command (`command_timeout_sec`)."""
DEFAULT_COMMAND_TIMEOUT_SEC = MAX_COMMAND_TIMEOUT_SEC
"""`command_timeout_sec` when none is given."""
DEFAULT_EPISODE_TIMEOUT_SEC = 300.0
"""An episode's wall-clock budget (`episode_timeout_sec`) when none is given."""
