"""Worker processes as every fleet starts, checks and ends them: one Ray actor each, a core
each, restarted by Ray when its process dies (its unfinished calls then run again on the
new process, once), checked before any work is sent, ended with the work."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any

import trio
from pydantic import BaseModel, ConfigDict

from wmo_trio.cluster._ray_wait import ray_value
from wmo_trio.cluster._session import Cluster, ClusterError

MAX_RESTARTS = 3  # a worker process's restarts by Ray, over the fleet's life
CALL_RETRIES = 1  # a call (a trial, an episode) runs again once when its worker dies under it
START_TIMEOUT_S = 300.0  # workers import harbor or the SDKs: tens of seconds on a loaded machine
STOP_GRACE_S = 120.0  # harbor says a trial's cancellation "may take up to a minute"


class WorkerInfo(BaseModel):
    """Which worker: its index in the fleet, its machine and its process."""

    model_config = ConfigDict(frozen=True)

    index: int
    node_id: str
    host: str
    pid: int
    problem: str | None = None  # why it cannot do the work, when it cannot

    @property
    def label(self) -> str:
        return f"worker {self.index + 1} ({self.host}, pid {self.pid})"


def this_worker(index: int, problem: BaseException | None = None) -> WorkerInfo:
    """The `WorkerInfo` of the calling worker process (in an actor)."""
    import ray

    return WorkerInfo(index=index, node_id=ray.get_runtime_context().get_node_id(),
                      host=socket.gethostname(), pid=os.getpid(),
                      problem=None if problem is None else _one_line(problem))


def start_workers(actor_class: type, cluster: Cluster, slots: int, *args: Any) -> list[Any]:
    """One actor of `actor_class` for each of the cluster's placements, constructed with
    `(index, *args)`, taking `slots` calls at once (and a few more for its control calls)."""
    import ray

    actor: Any = ray.remote(actor_class)
    return [actor.options(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=CALL_RETRIES,
                          max_concurrency=slots + 8, **placement).remote(index, *args)
            for index, placement in enumerate(cluster.placements)]


async def started(handles: Sequence[Any], cluster: Cluster, *args: Any) -> list[WorkerInfo]:
    """Each worker's `ready(*args)` answer once it has loaded what the work needs; a
    `ClusterError` in one line naming the first that could not, or that did not start in
    time."""
    infos: list[WorkerInfo] = []
    with trio.move_on_after(START_TIMEOUT_S) as waited:
        for handle in handles:
            try:
                info: WorkerInfo = await ray_value(handle.ready.options(max_task_retries=0).remote(*args))
            except Exception as error:
                raise ClusterError(f"a Ray worker process could not start or load the work (does "
                                   f"every node have wmo_trio installed, `pip install "
                                   f"'wmo_trio[ray]'`, and what the work imports?): "
                                   f"{_one_line(error, last=True)}") from None
            if info.problem is not None:
                raise ClusterError(f"{info.label} cannot load what the work needs: {info.problem}")
            infos.append(info)
    if waited.cancelled_caught:
        raise ClusterError(f"{len(handles) - len(infos)} of {len(handles)} Ray worker(s) did not start "
                           f"within {START_TIMEOUT_S:g} s on {cluster.address}")
    return infos


async def cancelled_call(handle: Any, ref: Any, keys: list[Any]) -> Any:
    """After the caller's wait for `ref` (a call on the worker `handle`) was cancelled:
    ask the worker to cancel that work (`cancel(keys)`) and wait, at most `STOP_GRACE_S`,
    for what the call returns then; the exception instead when it returns nothing (its
    worker lost, or too slow). Call it shielded."""
    try:
        handle.cancel.options(max_task_retries=0).remote(keys)
        with trio.fail_after(STOP_GRACE_S):
            return await ray_value(ref)
    except Exception as error:
        return error


async def stop_workers(handles: Sequence[Any]) -> None:
    """Ask every worker to stop its work (`close`: what runs is cancelled and waited for),
    for at most `STOP_GRACE_S`, then end their processes. Shielded: it always runs whole."""
    import ray

    with trio.CancelScope(shield=True):
        closing = []
        for handle in handles:
            with contextlib.suppress(Exception):
                closing.append(handle.close.options(max_task_retries=0).remote())
        with trio.move_on_after(STOP_GRACE_S):
            for ref in closing:
                with contextlib.suppress(Exception):
                    await ray_value(ref)
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)


def _one_line(error: BaseException, *, last: bool = False) -> str:
    """An exception as one line: its type and its message's first (or, for Ray's errors,
    which put the cause last, its last) line."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[-1] if last else lines[0]
    return text if last else f"{type(error).__name__}: {text}"
