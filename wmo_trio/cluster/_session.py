"""Ray for the length of one piece of work: an embedded local cluster that is started and
stopped here, or a running cluster that is joined and left.

`open_cluster` refuses, in one line and before anything starts, an installation without
Ray, an address that does not answer, or a cluster without room for the workers asked
for. Ray's driver calls (`ray.init`, `ray.shutdown`) run in one thread of their own that
lives as long as the connection: the processes `ray.init` starts die with the thread that
started them (Linux's parent-death signal is a thread's), and `ray.init` blocks for seconds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import trio

RAY_INSTALL = "pip install 'wmo_trio[ray]'"
CONNECT_TIMEOUT_S = 10.0
# Embedded clusters keep their sessions here, never in Ray's shared /tmp/ray: what one
# command starts, it alone stops and removes. A short prefix: Ray's socket paths must fit
# in 107 bytes.
_TEMP_PREFIX = "wmo-ray-"

Workers = int | Literal["auto"]


class ClusterError(Exception):
    """The cluster cannot take the work: the message is one line saying why and what to do."""


class WorkerLostError(RuntimeError):
    """The worker process running a piece of work was lost (killed, its node gone) more
    often than Ray restarts it for that work: the work ended without a result of its own."""


def import_ray() -> ModuleType:
    """Ray, or a `ClusterError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ClusterError(f"running on several worker processes needs Ray, which is not "
                           f"installed here: {RAY_INSTALL}") from None
    return ray


def parse_workers(value: object) -> Workers:
    """`--workers`/`workers=`: a positive number of worker processes, or `auto` (one per
    core of the machine, or of the cluster)."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"workers must be a positive number or 'auto', got {value!r}")
    return value


@dataclass(frozen=True)
class ClusterOptions:
    """Where work runs: `workers` worker processes on an embedded local Ray (started and
    stopped for the work), or on the running cluster at `ray_address` (`auto`: Ray's own
    rule, `RAY_ADDRESS` or the cluster `ray start` began on this machine), one worker per
    node unless `workers` says otherwise."""

    workers: Workers | None = None
    ray_address: str | None = None

    @classmethod
    def of(cls, workers: object = None, ray_address: str | None = None) -> ClusterOptions | None:
        """The options, checked; None when neither is given (one process, no Ray)."""
        if workers is None and ray_address is None:
            return None
        if ray_address is not None and not ray_address.strip():
            raise ClusterError("ray_address is empty; give host:port, ray://host:port or auto")
        return cls(None if workers is None else parse_workers(workers), ray_address)


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    cpus: float


@dataclass
class Cluster:
    """A connected cluster: its nodes, and where each of the `workers` goes (Ray actor
    options: one per node when the cluster's nodes are the workers' hosts)."""

    embedded: bool
    address: str
    nodes: list[Node]
    placements: list[dict[str, Any]] = field(default_factory=list)

    @property
    def workers(self) -> int:
        return len(self.placements)


@contextlib.asynccontextmanager
async def open_cluster(options: ClusterOptions) -> AsyncIterator[Cluster]:
    """Connected to Ray for this block, as `options` say; an embedded cluster is stopped,
    and its session directory removed, when the block ends. Cancellation waits for Ray to
    have started (or failed) and then stops it."""
    ray = import_ray()
    if options.ray_address is None:
        wanted = (os.cpu_count() or 1) if options.workers in (None, "auto") else int(options.workers)
        scratch = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir="/tmp"))
        owner = _RayOwner(ray, {}, head=(scratch, wanted))
    else:
        address = await trio.to_thread.run_sync(_reachable_address, ray, options.ray_address)
        scratch, owner = None, _RayOwner(ray, {"address": address})
    try:
        await trio.to_thread.run_sync(owner.start)
        nodes = [Node(node["NodeID"], node.get("NodeManagerAddress", "?"),
                      float(node.get("Resources", {}).get("CPU", 0)))
                 for node in ray.nodes() if node.get("Alive")]
        cluster = Cluster(embedded=scratch is not None, address=owner.address, nodes=nodes,
                          placements=_placements(ray, nodes, options))
        yield cluster
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(owner.stop)
            if scratch is not None:
                from wmo_trio.sandbox._hostfs import remove_tree

                await trio.to_thread.run_sync(remove_tree, scratch)


def _placements(ray: ModuleType, nodes: list[Node], options: ClusterOptions) -> list[dict[str, Any]]:
    """Where each worker goes: one a core (`auto`), `workers` spread over the nodes, or
    (a running cluster, no count given) one on each node that has a core."""
    usable = [node for node in nodes if node.cpus >= 1]
    cores = int(sum(math.floor(node.cpus) for node in usable))
    placements: list[dict[str, Any]]
    if options.ray_address is not None and options.workers is None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # soft: a worker whose node is lost is restarted on another.
        placements = [{"scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=True)}
                      for node in usable]
    else:
        count = cores if options.workers in (None, "auto") else int(options.workers)
        placements = [{"scheduling_strategy": "SPREAD"} for _ in range(count)]
    if not placements or len(placements) > cores:
        raise ClusterError(f"the Ray cluster has {cores} free core(s) on {len(nodes)} node(s), "
                           f"not enough for {max(len(placements), 1)} worker(s) of one core "
                           "each; ask for fewer --workers or add nodes")
    return placements


def _reachable_address(ray: ModuleType, address: str) -> str:
    """`address` as Ray names it (`auto` resolved), once something answers there: Ray
    itself waits for minutes on an address that does not answer."""
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            found = canonicalize_bootstrap_address("auto")
        except ConnectionError as error:
            raise ClusterError(f"ray_address auto: no running Ray cluster found ({error}); "
                               "start one with `ray start --head`, or give its address") from None
        if found is None:
            raise ClusterError("ray_address auto: no running Ray cluster found; start one with "
                               "`ray start --head`, or give its address")
        address = found
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"ray_address {address!r} is not host:port (or ray://host:port, or auto)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as error:
        raise ClusterError(f"the Ray cluster at {address} cannot be reached "
                           f"({error.strerror or error}); is it running (`ray status`)?") from None
    return address


class _RayOwner:
    """The thread that connects this process to Ray, stays while it is connected, and
    disconnects it (stopping what it started)."""

    def __init__(self, ray: ModuleType, init: dict[str, Any], *,
                 head: tuple[Path, int] | None = None) -> None:
        self._ray, self._init, self._head = ray, init, head
        self._node: Any = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="wmo-trio-ray", daemon=True)
        self.address = ""

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ClusterError(f"Ray did not start: {type(self._error).__name__}: "
                               f"{str(self._error).splitlines()[0] if str(self._error) else ''}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _main(self) -> None:
        try:
            with _quiet_ray():
                if self._head is not None:
                    self._node, self._init = _embedded_head(*self._head)
                context = self._ray.init(configure_logging=False, log_to_driver=False,
                                         namespace="wmo-trio", **self._init)
            self.address = str(context.address_info.get("gcs_address", ""))
        except BaseException as error:  # reported by start(), in the caller's thread
            self._error = error
            self._stopped()
            self._ready.set()
            return
        self._ready.set()
        self._stop.wait()
        with _quiet_ray():
            self._ray.shutdown()
            self._stopped()

    def _stopped(self) -> None:
        """The embedded head's processes ended, when this thread started it."""
        if self._node is not None:
            self._node.kill_all_processes(check_alive=False, allow_graceful=True)
            self._node = None


# Ray runs its worker processes at niceness 15 so that its own daemons stay responsive
# beside them. An embedded cluster's workers are the command's work, which in one process
# runs at the command's own priority: niced, they got what a shared machine's other
# processes left (and less than this driver and the loopback server beside them).
_EMBEDDED_CONFIG: dict[str, Any] = {"worker_niceness": 0}


def _embedded_head(scratch: Path, cpus: int) -> tuple[Any, dict[str, Any]]:
    """A local Ray head of `cpus` cores, its session under `scratch`, that starts only what
    a job needs: the GCS, the raylet (with the agents it starts) and the API server Ray
    always starts, but no log monitor (the workers' output is not forwarded here) and no
    autoscaler monitor (nothing to scale): fewer processes to start, about a third less
    CPU and time before the first worker. Its workers are not niced (`_EMBEDDED_CONFIG`).
    Built with Ray's own node class, as Ray's test cluster utility builds its nodes; a Ray
    release that has moved it gets `ray.init`'s default set. The node, or None, and
    `ray.init`'s arguments to join it."""
    try:
        from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
        from ray._private.node import Node
        from ray._private.parameter import RayParams
    except ImportError:
        return None, {"address": "local", "num_cpus": cpus, "_temp_dir": str(scratch),
                      "include_dashboard": False, "_system_config": _EMBEDDED_CONFIG}
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)  # as ray.init does
    params = RayParams(num_cpus=cpus, temp_dir=str(scratch), include_dashboard=False,
                       include_log_monitor=False,  # type: ignore[arg-type]  # Ray types its flag str
                       no_monitor=True, _system_config=dict(_EMBEDDED_CONFIG))
    node = Node(params, head=True, shutdown_at_exit=False, spawn_reaper=True)
    return node, {"address": node.address}


@contextlib.contextmanager
def _quiet_ray() -> Iterator[None]:
    """Ray's notices while it starts and stops (the token file it made, the signal handler
    it could not set in this thread) are not the user's business; its errors are."""
    logger = logging.getLogger("ray")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
