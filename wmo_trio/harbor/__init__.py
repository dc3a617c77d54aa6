"""wmo_trio's harbor integration.

- `WmoTrioHarborAgent`: the import-path agent (`-a wmo_trio.harbor:WmoTrioHarborAgent`).
- `LocalEnvironment`: a docker-free import-path environment
  (`-e wmo_trio.harbor:LocalEnvironment`).
- `run_job`: run a harbor `Job` from a trio program, trio owning the loop.
"""

from wmo_trio.harbor._agent import AGENT_NAME, HarborEpisode, WmoTrioHarborAgent
from wmo_trio.harbor._job import run_job
from wmo_trio.sandbox import LocalEnvironment

__all__ = ["AGENT_NAME", "HarborEpisode", "LocalEnvironment", "WmoTrioHarborAgent", "run_job"]
