"""What copying a trial's agent logs out and back in costs: ``LocalEnvironment``'s
host-side copies against the design they replaced (``tar`` run inside the trial,
its stream unpacked on the host with tarfile's ``data`` filter; a tarfile packed on
the host, unpacked by the trial's ``tar``).

One sandbox of the hello-file task holds N small files (a few hundred bytes each,
in a few directories, as an agent's logs are) in ``/logs/agent``; each way is timed R
times, median and p90. Run ``python benchmarks/transfer.py [--files N] [--rounds R]``;
it prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tarfile
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "examples" / "tasks" / "hello-file"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def _summary(samples_sec: list[float]) -> dict[str, float]:
    ordered = sorted(samples_sec)
    return {"median_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
                            * 1000, 2)}


async def _tar_download(environment: Any, source: str, target: Path) -> None:
    """The replaced design: the trial's tar packs, tarfile unpacks on the host."""
    from harbor.environments.base import transfer_tar_filter

    await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as bundle:
        completed = await environment._sandbox.channel.run(
            ["tar", "-cf", "-", "-C", source, "."], env=ENV, cwd="/", stdout=bundle)
        assert completed.return_code == 0

        def unpack() -> None:
            bundle.seek(0)
            with tarfile.open(fileobj=bundle, mode="r:") as archive:
                archive.extractall(target, filter=transfer_tar_filter)

        await asyncio.to_thread(unpack)


async def _tar_upload(environment: Any, source: Path, target: str) -> None:
    """The replaced design: tarfile packs on the host, the trial's tar unpacks."""
    with tempfile.TemporaryFile() as bundle:
        def pack() -> None:
            with tarfile.open(fileobj=bundle, mode="w", format=tarfile.PAX_FORMAT) as archive:
                for entry in sorted(source.iterdir()):
                    archive.add(entry, arcname=entry.name)

        await asyncio.to_thread(pack)
        bundle.seek(0)
        completed = await environment._sandbox.channel.run(
            ["sh", "-c", 'mkdir -p -- "$1" && exec tar -xf - -C "$1"', "sh", target],
            env=ENV, cwd="/", stdin=bundle)
        assert completed.return_code == 0


async def _time(rounds: int, scratch: Path,
                copy: Callable[[Path], Awaitable[None]]) -> list[float]:
    samples = []
    for _ in range(rounds):
        target = scratch / f"out-{uuid.uuid4().hex[:8]}"
        began = time.perf_counter()
        await copy(target)
        samples.append(time.perf_counter() - began)
        shutil.rmtree(target, ignore_errors=True)
    return samples


async def _measure(n_files: int, rounds: int, scratch: Path) -> dict[str, Any]:
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    from wmo_trio.harbor import LocalEnvironment

    trial_paths = TrialPaths(scratch / "trial")
    trial_paths.mkdir()
    environment = LocalEnvironment(
        environment_dir=TASK / "environment", environment_name=TASK.name,
        session_id="bench-transfer__env", trial_paths=trial_paths,
        task_env_config=EnvironmentConfig(), state_dir=scratch / "state",
        cache_dir=scratch / "cache")
    await environment.start(force_build=False)
    try:
        made = await environment.exec(
            f"mkdir -p /logs/agent/d0 /logs/agent/d1 /logs/agent/d2 /logs/agent/d3; "
            f"for i in $(seq 1 {n_files}); do head -c 400 /dev/urandom | base64 "
            f"> /logs/agent/d$((i % 4))/file-$i.txt; done")
        assert made.return_code == 0, made.stderr
        logs = scratch / "logs"
        await environment.download_dir("/logs/agent", logs)
        results: dict[str, Any] = {"files": n_files, "rounds": rounds}
        for name, copy in {
            "download_host_side": lambda t: environment.download_dir("/logs/agent", t),
            "download_tar_in_trial": lambda t: _tar_download(environment, "/logs/agent", t),
            "upload_host_side": lambda t: environment.upload_dir(logs, f"/tmp/{t.name}"),
            "upload_tar_in_trial": lambda t: _tar_upload(environment, logs, f"/tmp/{t.name}"),
        }.items():
            await _time(1, scratch, copy)  # warm: caches, imports
            results[name] = _summary(await _time(rounds, scratch, copy))
        return results
    finally:
        await environment.stop(delete=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wmo-trio-transfer-") as scratch:
        print(json.dumps(asyncio.run(_measure(args.files, args.rounds, Path(scratch))),
                         indent=2))


if __name__ == "__main__":
    main()
