"""What a trial's start does first: sweep what dead processes left, and find the host's
layers.

A harbor killed with SIGKILL leaves its trials' state directories, their cgroups, and
its builds' directories and lock files behind. Every start sweeps them (not only a
start that builds: they would outlive every job whose images are all built), safe
beside running jobs, whose locks and owners' PIDs keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from wmo_trio.sandbox import _storage
from wmo_trio.sandbox._cgroup import remove_stale_cgroups
from wmo_trio.sandbox._image import ImageCache
from wmo_trio.sandbox._rootfs import HostLayers, host_layers
from wmo_trio.sandbox._state import remove_stale_states

__all__ = ["sweep_and_find_layers"]


def sweep_and_find_layers(state_root: Path, cache: ImageCache, hidden: Iterable[Path], *,
                          storage: bool) -> HostLayers:
    """Remove what dead processes left (sandboxes' directories and cgroups, builds'
    leftovers); the host's layers, held (leased) until released, hiding ``hidden``.
    With ``storage``, whether this machine can hold ``storage_mb`` is found out too,
    once per process. Blocks: one thread for all, as each hop to a thread costs the
    start a wait for the loop."""
    remove_stale_states(state_root)
    remove_stale_cgroups()
    cache.remove_leftovers()
    if storage:
        _storage.problem()
    return host_layers(cache.root, hidden)
