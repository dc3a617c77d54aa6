"""The docker-free environment's own options (harbor's ``--ek``), each checked once when
the environment is made, and a trial's ceilings as this machine can hold them.

Harbor passes ``--ek`` values as text or JSON; a bad one is one ``ValueError`` naming
it, before any trial starts. The ceilings a task asks for (``cpus``, ``memory_mb``,
``storage_mb``, as harbor resolves them) and ``pids_limit`` are held where this machine
can (cgroups: ``_cgroup``; a filesystem of the trial's own: ``_storage``); those it
cannot are dropped, and said (:class:`Ceilings`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from wmo_trio.sandbox import _storage
from wmo_trio.sandbox._cgroup import Limits, host_cgroups
from wmo_trio.sandbox._image import default_cache_dir
from wmo_trio.sandbox._state import default_state_root
from wmo_trio.sandbox._transfer import (
    DEFAULT_DOWNLOAD_LIMIT_MB,
    DEFAULT_DOWNLOAD_TIMEOUT_SEC,
    TransferLimits,
)

__all__ = ["DEFAULT_PIDS_LIMIT", "DEFAULT_SHM_SIZE_MB", "Ceilings", "EnvironmentOptions"]

# A trial's processes (threads count) when the job does not say: far above what builds
# and test suites use, and a fork bomb in each of several concurrent trials still leaves
# the host's PIDs (32,768 by default) to the host.
DEFAULT_PIDS_LIMIT = 1024
DEFAULT_SHM_SIZE_MB = 64  # Docker's


@dataclass(frozen=True)
class EnvironmentOptions:
    """The environment's options, checked: where the trials' state directories and the
    image cache lie, the build arguments, the bounds of a copy out, the processes a
    trial may hold, the size of its ``/dev/shm``."""

    state_root: Path
    cache_dir: Path
    build_args: Mapping[str, str]
    transfer_limits: TransferLimits
    pids_limit: int  # 0: no cap
    shm_size_mb: int

    @classmethod
    def parse(cls, *, state_dir: str | Path | None, cache_dir: str | Path | None,
              build_args: Mapping[str, str] | str | None,
              download_limit_mb: float | str | None, download_timeout_sec: float | str | None,
              pids_limit: object, shm_size_mb: object) -> EnvironmentOptions:
        transfer_limits = TransferLimits(
            max_bytes=int(_positive("download_limit_mb", download_limit_mb,
                                    DEFAULT_DOWNLOAD_LIMIT_MB) * (1 << 20)),
            timeout_sec=_positive("download_timeout_sec", download_timeout_sec,
                                  DEFAULT_DOWNLOAD_TIMEOUT_SEC),
        )
        return cls(
            state_root=Path(state_dir) if state_dir else default_state_root(),
            cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(),
            build_args=_build_args(build_args),
            transfer_limits=transfer_limits,
            pids_limit=_count("pids_limit", pids_limit, minimum=0, zero="no cap"),
            shm_size_mb=_count("shm_size_mb", shm_size_mb, minimum=1),
        )

    def shm_bytes(self, limits: Limits) -> int:
        """``/dev/shm``'s size: what it holds counts against memory_mb, and a trial
        that fills it past that leaves nothing for its processes."""
        size = self.shm_size_mb << 20
        if limits.memory_mb is not None:
            size = min(size, limits.memory_mb << 19)
        return size


@dataclass(frozen=True)
class Ceilings:
    """A trial's ceilings as this machine holds them: its cgroup's limits, the bytes its
    writes may take (None: no bound), and what it asked for that is not held, with
    why."""

    limits: Limits
    storage_bytes: int | None
    unenforced: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    @classmethod
    def held(cls, *, cpus: float | None, memory_mb: int | None, pids: int | None,
             storage_mb: int | None) -> Ceilings:
        """What of these this machine can hold; the others dropped. A ``storage_mb``
        that is not a positive number is a ``ValueError``."""
        cgroups = host_cgroups()
        unenforced = []
        if cpus is not None and not cgroups.offers("cpu"):
            unenforced.append(f"cpus={cpus}")
            cpus = None
        if memory_mb is not None and not cgroups.offers("memory"):
            unenforced.append(f"memory_mb={memory_mb}")
            memory_mb = None
        if pids is not None and not cgroups.offers("pids"):
            unenforced.append(f"pids_limit={pids}")
            pids = None
        reasons = [str(cgroups.reason)] if unenforced else []
        if storage_mb is not None and not storage_mb > 0:
            raise ValueError(f"storage_mb must be a positive number of MiB, not {storage_mb!r}")
        problem = None if storage_mb is None else _storage.problem()
        if problem is not None:
            unenforced.append(f"storage_mb={storage_mb}")
            reasons.append(f"{problem}, so a trial's writes go to the state directory's "
                           "filesystem without a bound")
            storage_mb = None
        return cls(Limits(cpus=None if cpus is None else float(cpus), memory_mb=memory_mb,
                          pids=pids), None if storage_mb is None else storage_mb << 20,
                   tuple(unenforced), tuple(reasons))


def _positive(name: str, value: float | str | None, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{name} must be a positive number, not {value!r}")
    return number


def _count(name: str, value: object, *, minimum: int, zero: str = "") -> int:
    """A whole number (harbor's ``--ek`` passes text or JSON)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        meaning = f" ({minimum}: {zero})" if zero else ""
        raise ValueError(f"{name} must be a whole number >= {minimum}{meaning}, "
                         f"not {value!r}")
    return value


def _build_args(value: Mapping[str, str] | str | None) -> dict[str, str]:
    """The build arguments: a mapping, or its JSON text, of strings to strings."""
    if isinstance(value, str):
        value = json.loads(value)
    if value is not None and not (
        isinstance(value, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise ValueError("build_args must be a JSON object of strings, e.g. '{\"V\": \"1\"}'")
    return dict(value or {})
