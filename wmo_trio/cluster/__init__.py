"""Beyond one process: harbor trials and research episodes on worker processes of this
machine or of a Ray cluster (`pip install 'wmo_trio[ray]'`).

- `ClusterOptions`: where work runs (`workers`, `ray_address`); `ClusterError`: why it
  cannot, in one line.
- `open_cluster`: Ray for one piece of work (an embedded local cluster, or a running one).
- `open_trial_fleet` / `TrialFleet.run_trial`: harbor `TrialConfig`s run by harbor's own
  trial machinery on the workers, each trial's directory written back on this machine;
  `FleetEvent`: a trial event and the worker it happened on.
- `pack` / `unpack` / `PackedTree`: a directory as bounded data, and back.

Importing this package does not import Ray; opening a cluster does.
"""

from wmo_trio.cluster._fleet import FleetCallback, FleetEvent, TrialFleet, open_trial_fleet
from wmo_trio.cluster._ray_wait import ray_value
from wmo_trio.cluster._session import (
    RAY_INSTALL,
    Cluster,
    ClusterError,
    ClusterOptions,
    import_ray,
    open_cluster,
    parse_workers,
)
from wmo_trio.cluster._tree import PackedTree, pack, remove_tree, unpack
from wmo_trio.cluster._trial_worker import WorkerInfo

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
    "import_ray",
    "open_cluster",
    "open_trial_fleet",
    "pack",
    "parse_workers",
    "ray_value",
    "remove_tree",
    "unpack",
]
