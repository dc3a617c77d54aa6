"""wmo_trio: run serialized agent-harness candidates as harbor agents on Trio.

The trio-native research API is available from here (imported on first use):

- `open_episode_pool(limit=...)`, `EpisodePool`, `EpisodeSpec`: run episodes from trio
  (`workers=` / `ray_address=`: on Ray worker processes, `wmo_trio.cluster`);
- `DirectoryEnvironment`, `HarborEnvironment`, `TrioEnvironment`: where they run;
- `run_harbor_job(config)`: a harbor `Job` from inside a trio program (its trials on Ray
  workers with `workers=` / `ray_address=`);
- `HarnessDoc`, `load_harness`, `RunResult`, `StopReason`: the data.

The harbor agent is `wmo_trio.harbor:WmoTrioHarborAgent`.
"""

from __future__ import annotations

from wmo_trio._lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "open_episode_pool": "wmo_trio.research",
    "EpisodePool": "wmo_trio.research",
    "EpisodeSpec": "wmo_trio.research",
    "DirectoryEnvironment": "wmo_trio.research",
    "HarborEnvironment": "wmo_trio.research",
    "TrioEnvironment": "wmo_trio.research",
    "run_harbor_job": "wmo_trio.research",
    "HarnessDoc": "wmo_trio.harness",
    "load_harness": "wmo_trio.harness",
    "parse_harness": "wmo_trio.harness",
    "RunResult": "wmo_trio.models",
    "StopReason": "wmo_trio.models",
    "TokenUsage": "wmo_trio.models",
}

__all__ = ["__version__", *_LAZY]


# LocalProcessEnvironment: DirectoryEnvironment's old name, deprecated (not in __all__).
__getattr__ = lazy_exports(__name__, {**_LAZY, "LocalProcessEnvironment": "wmo_trio.research"})
