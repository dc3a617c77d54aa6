"""Beyond one process: harbor trials and research episodes on worker processes of this
machine or of a Ray cluster (`pip install 'wmo_trio[ray]'`).

- `ClusterOptions`: where work runs (`workers`, `ray_address`); `ClusterError`: why it
  cannot, in one line.
- `open_cluster`: Ray for one piece of work (an embedded local cluster, or a running one).
- `open_trial_fleet` / `TrialFleet.run_trial`: harbor `TrialConfig`s run by harbor's own
  trial machinery on the workers, each trial's directory written back on this machine;
  `FleetEvent`: a trial event and the worker it happened on.
- `pack` / `unpack` / `PackedTree`: a directory as bounded data, and back.

Importing this package imports neither Ray nor harbor: the options and their errors are
here at once, the rest on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wmo_trio._lazy import lazy_exports
from wmo_trio.cluster._session import (
    RAY_INSTALL,
    Cluster,
    ClusterError,
    ClusterOptions,
    WorkerLostError,
    import_ray,
    open_cluster,
    parse_workers,
)

if TYPE_CHECKING:
    from wmo_trio.cluster._fleet import FleetCallback, FleetEvent, TrialFleet, open_trial_fleet
    from wmo_trio.cluster._ray_wait import ray_value
    from wmo_trio.cluster._tree import PackedTree, pack, unpack
    from wmo_trio.cluster._workers import WorkerInfo

_LAZY = {
    "FleetCallback": "wmo_trio.cluster._fleet",
    "FleetEvent": "wmo_trio.cluster._fleet",
    "TrialFleet": "wmo_trio.cluster._fleet",
    "open_trial_fleet": "wmo_trio.cluster._fleet",
    "ray_value": "wmo_trio.cluster._ray_wait",
    "PackedTree": "wmo_trio.cluster._tree",
    "pack": "wmo_trio.cluster._tree",
    "unpack": "wmo_trio.cluster._tree",
    "WorkerInfo": "wmo_trio.cluster._workers",
}

__all__ = [
    "RAY_INSTALL",
    "Cluster",
    "ClusterError",
    "ClusterOptions",
    "FleetCallback",
    "FleetEvent",
    "PackedTree",
    "TrialFleet",
    "WorkerInfo",
    "WorkerLostError",
    "import_ray",
    "open_cluster",
    "open_trial_fleet",
    "pack",
    "parse_workers",
    "ray_value",
    "unpack",
]

__getattr__ = lazy_exports(__name__, _LAZY)
