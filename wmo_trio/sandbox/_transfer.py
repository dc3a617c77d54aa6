"""Copying files and directories in and out of a sandbox.

Every copy runs inside the sandbox (``cat`` or ``tar``) with a host file descriptor as
its stdin or stdout, so paths are resolved against the sandbox's root: a symlink a task
planted cannot make harbor read or write a host file.
"""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import IO

from harbor.environments.base import transfer_tar_filter

from wmo_trio.sandbox._namespace import DEFAULT_PATH
from wmo_trio.sandbox._processes import Channel, Completed

__all__ = ["download_dir", "download_file", "upload_dir", "upload_file"]

_ENV = {"PATH": DEFAULT_PATH}


def _check(completed: Completed, action: str) -> None:
    if completed.return_code != 0:
        detail = completed.stderr.decode(errors="replace").strip() or "no output"
        if completed.return_code == 2 and detail.startswith("no such "):
            raise FileNotFoundError(f"cannot {action}: {detail}")
        raise RuntimeError(f"cannot {action} (exit {completed.return_code}): {detail}")


async def upload_file(channel: Channel, source: Path, target: str) -> None:
    """Copy a host file in, owned by root, mode kept. A target that is a directory (or
    ends with ``/``) receives the file under its own name."""
    script = (
        't=$1; case $t in */) mkdir -p -- "$t"; t=$t$2;; *) '
        'if [ -d "$t" ]; then t=$t/$2; else mkdir -p -- "$(dirname -- "$t")"; fi;; '
        'esac; cat > "$t" && chmod "$3" "$t"'
    )
    with source.open("rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode & 0o7777
        completed = await channel.run(["sh", "-c", script, "sh", target, source.name, f"{mode:o}"],
                                      env=_ENV, cwd="/", stdin=handle)
    _check(completed, f"upload {source} to {target}")


def _root_owned(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.uid = member.gid = 0
    member.uname = member.gname = "root"
    return member


def _pack_dir(source: Path, bundle: IO[bytes]) -> None:
    with tarfile.open(fileobj=bundle, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for entry in sorted(source.iterdir()):
            archive.add(entry, arcname=entry.name, filter=_root_owned)


async def upload_dir(channel: Channel, source: Path, target: str) -> None:
    """Copy a host directory's contents into ``target`` (created if needed), owned by
    root, modes kept."""
    if not await asyncio.to_thread(source.is_dir):
        raise FileNotFoundError(f"{source} is not a directory")
    with tempfile.TemporaryFile() as bundle:
        await asyncio.to_thread(_pack_dir, source, bundle)
        bundle.seek(0)
        completed = await channel.run(
            ["sh", "-c", 'mkdir -p -- "$1" && exec tar -xf - -C "$1"', "sh", target],
            env=_ENV, cwd="/", stdin=bundle,
        )
    _check(completed, f"upload {source} to {target}")


async def download_file(channel: Channel, source: str, target: Path) -> None:
    """Copy a file out; the host copy belongs to harbor's user."""
    await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.part")
    try:
        with partial.open("wb") as handle:
            completed = await channel.run(
                ["sh", "-c", '[ -f "$1" ] || { echo "no such file: $1" >&2; exit 2; }; '
                 'exec cat -- "$1"', "sh", source],
                env=_ENV, cwd="/", stdout=handle,
            )
        _check(completed, f"download {source}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def _unpack(bundle: IO[bytes], target: Path) -> None:
    bundle.seek(0)
    with tarfile.open(fileobj=bundle, mode="r:") as archive:
        archive.extractall(target, filter=transfer_tar_filter)


async def download_dir(channel: Channel, source: str, target: Path) -> None:
    """Copy a directory's contents out into ``target``, overwriting files there; the
    host copies belong to harbor's user."""
    await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as bundle:
        completed = await channel.run(
            ["sh", "-c", '[ -d "$1" ] || { echo "no such directory: $1" >&2; exit 2; }; '
             'exec tar -cf - -C "$1" .', "sh", source],
            env=_ENV, cwd="/", stdout=bundle,
        )
        _check(completed, f"download {source}")
        await asyncio.to_thread(_unpack, bundle, target)
