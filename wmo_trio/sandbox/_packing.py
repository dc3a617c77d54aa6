"""What a ``COPY`` or ``ADD`` places in a build's layer, packed as one tar that the build's
sandbox unpacks: build-context files, here-documents, and paths of an earlier stage.

An earlier stage's paths are the task's: they reach the host only as the stage's own
``tar`` writes them, through a pipe, bounded (:data:`STAGE_COPY_LIMIT`), and pass into
the new tar as headers and bytes, never written to the host's filesystem.
"""

from __future__ import annotations

import asyncio
import io
import os
import posixpath
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

from wmo_trio.sandbox._dockerfile import Instruction
from wmo_trio.sandbox._errors import BuildError, SpawnFailed
from wmo_trio.sandbox._processes import Channel, Completed, wait_readable
from wmo_trio.sandbox._profile import DEFAULT_PATH

__all__ = ["STAGE_COPY_LIMIT", "Picked", "Placement", "Stage", "pack"]

# What one COPY --from may bring out of an earlier stage. The stage's own tar writes
# that stream, and the stage is the task's: it passes through the host only this far.
STAGE_COPY_LIMIT = 2 << 30


class Picked(NamedTuple):
    """A path of an earlier stage that a ``COPY --from`` matched."""

    path: str  # from the stage's root
    is_dir: bool


@dataclass(frozen=True)
class Stage:
    """An earlier stage of the build, still running, as a ``COPY --from`` reads it."""

    index: int
    channel: Channel
    instruction: Instruction  # the COPY that reads it, for its errors

    async def matches(self, patterns: Sequence[str]) -> list[Picked]:
        """What ``patterns`` match in the stage's filesystem (paths from its root, as
        BuildKit reads them)."""
        script = ('cd / || exit 1; IFS="\n"; for p; do found=; for m in ${p#/}; do '
                  'if [ -e "$m" ] || [ -L "$m" ]; then found=1; '
                  'if [ -d "$m" ] && [ ! -L "$m" ]; then echo "d $m"; else echo "f $m"; fi; fi; '
                  'done; [ -n "$found" ] || { echo "$p: no such file or directory" >&2; exit 2; }; '
                  'done')
        completed = await self._run(["sh", "-c", script, "sh", *patterns])
        found = []
        for line in completed.stdout.decode(errors="surrogateescape").splitlines():
            kind, _, path = line.partition(" ")
            found.append(Picked("/" + path.lstrip("/"), kind == "d"))
        return found

    async def archive(self, picked: Picked, into: IO[bytes]) -> None:
        """A tar of a path of the stage, into ``into``: a directory's contents, or the
        file."""
        parent, name = posixpath.split(picked.path)
        argv = (["tar", "-c", "-f", "-", "-C", picked.path, "."] if picked.is_dir
                else ["tar", "-c", "-f", "-", "-C", parent or "/", "--", name])
        too_much = (f"Dockerfile {self.instruction.describe()} failed: {picked.path} in stage "
                    f"{self.index} holds more than {STAGE_COPY_LIMIT >> 20} MiB")
        read_end, write_end = os.pipe()
        with os.fdopen(read_end, "rb", buffering=0) as reader, \
                os.fdopen(write_end, "wb", buffering=0) as writer:
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(_bounded_copy(reader.fileno(), into, too_much))
                    try:
                        await self._run(argv, stdout=writer)
                    finally:  # the copy ends at the end of the stream
                        writer.close()
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
        into.seek(0)

    async def _run(self, argv: list[str], stdout: IO[bytes] | None = None) -> Completed:
        try:
            completed = await self.channel.run(argv, env={"PATH": DEFAULT_PATH}, cwd="/",
                                               stdout=stdout)
        except SpawnFailed as error:
            raise BuildError(f"Dockerfile {self.instruction.describe()} failed: {error}") from None
        if completed.return_code != 0:
            detail = completed.stderr.decode(errors="replace").strip()[-2000:]
            raise BuildError(f"Dockerfile {self.instruction.describe()} failed: stage "
                             f"{self.index}: {detail or f'exit code {completed.return_code}'}")
        return completed


async def _bounded_copy(fd: int, into: IO[bytes], too_much: str) -> None:
    """Copy a pipe into a file until its end, refusing (``BuildError``) past
    :data:`STAGE_COPY_LIMIT` bytes."""
    os.set_blocking(fd, False)
    copied = 0
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            await wait_readable(fd)
            continue
        if not chunk:
            return
        copied += len(chunk)
        if copied > STAGE_COPY_LIMIT:
            raise BuildError(too_much)
        await asyncio.to_thread(into.write, chunk)


@dataclass(frozen=True)
class Placement:
    """Whose and of what mode the entries a COPY places are (``--chown``, ``--chmod``)."""

    owner: tuple[int, int] | None = None
    chmod: int | None = None

    def placed(self, info: tarfile.TarInfo) -> tarfile.TarInfo:
        """A build-context file or a here-document: the owner's, else root's."""
        info.uid, info.gid = self.owner or (0, 0)
        return self._moded(info)

    def restaged(self, info: tarfile.TarInfo) -> tarfile.TarInfo:
        """An earlier stage's entry: it keeps its owner unless ``--chown`` says."""
        if self.owner is not None:
            info.uid, info.gid = self.owner
        return self._moded(info)

    def _moded(self, info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uname = info.gname = ""
        if self.chmod is not None and not info.issym():
            info.mode = self.chmod
        return info


def pack(bundle: IO[bytes], sources: Sequence[Path], destination: str, as_directory: bool,
         placement: Placement, documents: Sequence[tuple[str, bytes]] = (),
         parts: Sequence[tuple[Picked, IO[bytes]]] = ()) -> None:
    """A tar of what a COPY places, as it places it: build-context files, here-documents
    and tars of an earlier stage's paths (``parts``)."""
    with tarfile.open(fileobj=bundle, mode="w", format=tarfile.PAX_FORMAT) as tar:
        base = destination.lstrip("/")
        if as_directory and base:
            info = tarfile.TarInfo(base)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(placement.placed(info) if placement.owner else info)
        for source in sources:
            _add_source(tar, source, base, as_directory, placement)
        for document, content in documents:
            info = tarfile.TarInfo(posixpath.join(base, document) if as_directory else base)
            info.size, info.mode, info.mtime = len(content), 0o644, int(time.time())
            tar.addfile(placement.placed(info), io.BytesIO(content))
        for picked, part in parts:
            _restage(tar, part, base, picked, as_directory, placement.restaged)


def _add_source(tar: tarfile.TarFile, source: Path, base: str, as_directory: bool,
                placement: Placement) -> None:
    """A build-context file, or a directory's contents (its links kept as links)."""
    if source.is_dir() and not source.is_symlink():
        for path in sorted(source.rglob("*")):
            name = posixpath.join(base, path.relative_to(source).as_posix())
            tar.add(path, arcname=name, recursive=False, filter=placement.placed)
    else:
        name = posixpath.join(base, source.name) if as_directory else base
        tar.add(source, arcname=name, recursive=False, filter=placement.placed)


def _restage(tar: tarfile.TarFile, part: IO[bytes], base: str, picked: Picked,
             as_directory: bool, placed: Callable[[tarfile.TarInfo], Any]) -> None:
    """Copy the members of a stage's tar into ``tar`` under their new names. Only
    headers and bytes pass through the host; nothing is written to its filesystem."""
    is_dir = picked.is_dir
    if is_dir:
        top = base
    else:
        top = posixpath.join(base, posixpath.basename(picked.path)) if as_directory else base

    def renamed(member: str) -> str:
        relative = posixpath.normpath(member)
        if is_dir:
            return top if relative == "." else posixpath.join(top, relative)
        return top

    with tarfile.open(fileobj=part, mode="r:") as archive:
        for member in archive:
            if is_dir and posixpath.normpath(member.name) == ".":
                continue  # the destination directory itself is made by the COPY
            if member.name.startswith("/") or ".." in member.name.split("/"):
                continue
            member.name = renamed(member.name)
            if member.islnk():
                member.linkname = renamed(member.linkname)
            placed(member)
            if member.isreg():
                tar.addfile(member, archive.extractfile(member))
            else:
                tar.addfile(member)
