"""wmo_trio's harbor integration.

- `WmoTrioHarborAgent`: the import-path agent (`-a wmo_trio.harbor:WmoTrioHarborAgent`).
- `LocalEnvironment`: a docker-free import-path environment
  (`-e wmo_trio.harbor:LocalEnvironment`).
- `run_job`: run a harbor `Job` from a trio program, trio owning the loop (its trials on
  Ray worker processes with `workers=` / `ray_address=`: `_cluster_job`).

`LocalEnvironment` and `run_job` are imported on first use: a process that only loads the
agent (harbor with another environment) does not import the sandbox. (`wmo-trio run`
checks the agent's arguments without this package: `wmo_trio._agent_arguments`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wmo_trio._lazy import lazy_exports
from wmo_trio.harbor._agent import AGENT_NAME, HarborEpisode, WmoTrioHarborAgent

if TYPE_CHECKING:
    from wmo_trio.harbor._job import run_job
    from wmo_trio.sandbox import LocalEnvironment

_LAZY = {
    "LocalEnvironment": "wmo_trio.sandbox",
    "run_job": "wmo_trio.harbor._job",
}

__all__ = ["AGENT_NAME", "HarborEpisode", "LocalEnvironment", "WmoTrioHarborAgent", "run_job"]


__getattr__ = lazy_exports(__name__, _LAZY)
