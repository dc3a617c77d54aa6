"""The image cache: each task's Dockerfile built once (``_build``) into a layer, kept
under ``<cache>/images/<key>/`` (``layer/`` and ``image.json``) and reused by every later
trial of the task, in any job or process on the machine.

An image's key hashes the Dockerfile and its build context, the build arguments, the
host's layers and packages, and the builder's own source. The first trial that needs
an image builds it while the others wait on its lock file; every trial holds that lock
shared while it runs the image, so ``prune`` (which takes it exclusively) never removes
an image in use. A build killed with its process leaves its directory and a lock file
behind, which the next start removes (:meth:`ImageCache.remove_leftovers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from wmo_trio.sandbox._build import BuiltLayer, ImageConfig, building
from wmo_trio.sandbox._dockerfile import Stage, build_plan, read
from wmo_trio.sandbox._hostfs import remove_or_set_aside, remove_tree, tree_size
from wmo_trio.sandbox._rootfs import HostLayers, prune_host_layers
from wmo_trio.sandbox._stand_in import stand_in_notice
from wmo_trio.sandbox._state import remove_stale_states, same_file

__all__ = ["CachedImage", "Image", "ImageCache", "Pruned", "default_cache_dir"]

FORMAT_VERSION = 1
LOCK_POLL_SEC = 0.05
# The modules whose source is part of an image's key: how an image is built.
BUILDER_SOURCES = ("_image.py", "_build.py", "_packing.py", "_dockerfile.py")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wmo-trio" / "sandbox"


@dataclass(frozen=True)
class Image:
    key: str
    layer: Path
    config: ImageConfig
    lock_fd: int  # held shared while a trial uses the image, so prune leaves it alone
    has_sudo: bool = False

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


@dataclass(frozen=True)
class CachedImage:
    key: str
    path: Path
    task: str
    size_bytes: int
    built_at: float
    in_use: bool
    # Who built it, for a cache every user of the machine shares: the system user, and
    # the task directory and job directory of the trial that built it ("" before these
    # were recorded).
    user: str = ""
    task_dir: str = ""
    job: str = ""


def _user() -> str:
    """This process's user's name (its uid where the system knows no name)."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


@dataclass(frozen=True)
class Pruned:
    """What a prune removed, and what it kept because a trial or a build (of any job,
    in any process) holds it."""

    removed: list[CachedImage] = field(default_factory=list)
    images_in_use: list[CachedImage] = field(default_factory=list)
    layers_removed: list[Path] = field(default_factory=list)
    layers_in_use: list[Path] = field(default_factory=list)


def _context_digest(context: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(context.rglob("*")):
        info = path.lstat()
        digest.update(f"{path.relative_to(context)}\0{info.st_mode:o}\0".encode())
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
        elif path.is_symlink():
            digest.update(os.readlink(path).encode())
    return digest.hexdigest()


def image_key(context: Path, build_args: Mapping[str, str], host: HostLayers) -> str:
    status = Path("/var/lib/dpkg/status")
    host_state = status.stat().st_mtime_ns if status.exists() else 0
    # The builder's own source is part of the key: a change to how images are built
    # must not reuse images built the old way.
    builder = b"".join(Path(__file__).with_name(name).read_bytes()
                       for name in BUILDER_SOURCES)
    # The host's layout, never what this job hides: that names the job's own directory.
    material = json.dumps([FORMAT_VERSION, hashlib.sha256(builder).hexdigest(),
                           sorted(build_args.items()), host.identity,
                           host_state, _context_digest(context)])
    return hashlib.sha256(material.encode()).hexdigest()[:24]


async def _lock(fd: int, mode: int) -> None:
    """flock without blocking the loop; cancellable while it waits."""
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            await asyncio.sleep(LOCK_POLL_SEC)


class ImageCache:
    """Built images under ``root/images/<key>/`` (``layer/`` and ``image.json``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.images = root / "images"

    async def ensure(
        self,
        context: Path,
        host: HostLayers,
        *,
        task_name: str,
        build_args: Mapping[str, str],
        build_timeout_sec: float | None,
        log: IO[str] | None = None,
        notice: Callable[[str], None] | None = None,
        built_for: Mapping[str, str] | None = None,
    ) -> Image:
        """The task's image, built now if no trial built it before (its record says for
        whom: `built_for`, the trial's task and job directories). Holds the image's
        lock shared until :meth:`Image.release`. Raises :class:`DockerfileError` for a
        Dockerfile that cannot be built here, :class:`BuildError` for a failed step."""
        plan = build_plan(read(context / "Dockerfile"), build_args)
        key = await asyncio.to_thread(image_key, context, build_args, host)
        target = self.images / key
        lock_path = self.images / f"{key}.lock"
        self.images.mkdir(parents=True, exist_ok=True)
        while True:
            with contextlib.ExitStack() as on_fail:  # the lock, until the image holds it
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
                on_fail.callback(os.close, fd)
                await _lock(fd, fcntl.LOCK_SH)
                if not (target / "image.json").is_file():
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    await _lock(fd, fcntl.LOCK_EX)
                # A cleaner removes the lock file of an image nobody built or uses; a
                # lock taken on the file it removed guards nothing.
                if not same_file(fd, lock_path):
                    continue
                if not (target / "image.json").is_file():
                    for stage in plan:
                        text = await asyncio.to_thread(stand_in_notice, stage.base)
                        if text is not None and notice is not None:
                            notice(text)
                    async with asyncio.timeout(build_timeout_sec):
                        await self._build(plan, context, host, target, build_args, log,
                                          {"task": task_name, "built_by": {
                                              "user": _user(), **(built_for or {})}})
                fcntl.flock(fd, fcntl.LOCK_SH)
                meta = json.loads((target / "image.json").read_text())
                os.utime(target / "image.json")  # last use, for prune --older-than
                on_fail.pop_all()
                return Image(key=key, layer=target / "layer", config=ImageConfig(**meta["config"]),
                             lock_fd=fd, has_sudo=bool(meta.get("has_sudo")))

    async def _build(self, plan: list[Stage], context: Path, host: HostLayers, target: Path,
                     build_args: Mapping[str, str], log: IO[str] | None,
                     record: dict[str, Any]) -> None:
        """Build the image (see ``_build``) and move it into place with its record."""
        started = time.time()
        async with building(plan, context, host, self.root / "builds", target.name,
                            build_args, log) as built:
            record = {**record, "built_at": started, "seconds": time.time() - started,
                      "config": asdict(built.config), "has_sudo": built.has_sudo}
            await asyncio.to_thread(_commit, built, target, record)

    def remove_leftovers(self) -> None:
        """Remove what builds whose process died left: their directories (a staged
        image included) and the lock files of images they never built. Safe while
        other processes build or use images: those hold their locks."""
        remove_stale_states(self.root / "builds")
        for lock_path in self.images.glob("*.lock"):
            image = lock_path.with_suffix("")
            if (image / "image.json").is_file():
                continue
            try:
                fd = os.open(lock_path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if same_file(fd, lock_path) and not (image / "image.json").is_file():
                    lock_path.unlink()
            except BlockingIOError:
                pass
            finally:
                os.close(fd)

    def entries(self) -> list[CachedImage]:
        found = []
        for path in sorted(self.images.glob("*/image.json")):
            image = path.parent
            try:
                meta = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            try:
                size = tree_size(image)  # a build may have left any tree there
            except OSError:
                size = 0
            by = meta.get("built_by") if isinstance(meta.get("built_by"), dict) else {}
            found.append(CachedImage(key=image.name, path=image, task=str(meta.get("task", "")),
                                     size_bytes=size, built_at=path.stat().st_mtime,
                                     in_use=self._in_use(image.name),
                                     user=str(by.get("user", "")),
                                     task_dir=str(by.get("task", "")), job=str(by.get("job", ""))))
        return found

    def _in_use(self, key: str) -> bool:
        try:
            fd = os.open(self.images / f"{key}.lock", os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def prune(self, older_than_sec: float | None = None) -> Pruned:
        """Remove images no trial uses (last used before ``older_than_sec`` ago, when
        given), the host's layers no trial or build holds, and leftovers of interrupted
        builds; what was removed and what was kept in use."""
        pruned = Pruned()
        self.remove_leftovers()
        for leftover in self.images.glob(".new-*"):  # staged by earlier versions
            remove_tree(leftover)
        for image in self.entries():
            if older_than_sec is not None and time.time() - image.built_at < older_than_sec:
                continue
            fd = os.open(self.images / f"{image.key}.lock", os.O_RDWR)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pruned.images_in_use.append(image)
                    continue
                remove_or_set_aside(image.path, logging.getLogger(__name__))
                (self.images / f"{image.key}.lock").unlink(missing_ok=True)
                pruned.removed.append(image)
            finally:
                os.close(fd)
        layers_removed, layers_in_use = prune_host_layers(self.root)
        pruned.layers_removed.extend(layers_removed)
        pruned.layers_in_use.extend(layers_in_use)
        return pruned


def _commit(built: BuiltLayer, target: Path, record: dict[str, Any]) -> None:
    """Move a finished build's layer and its record into place at once. They are put
    together in the build's own directory, so a build killed meanwhile leaves them
    where its other leftovers are removed."""
    staging = built.staging
    staging.mkdir()
    built.layer.rename(staging / "layer")
    (staging / "image.json").write_text(json.dumps(record, indent=2))
    if target.exists():
        remove_or_set_aside(target, logging.getLogger(__name__))
    staging.rename(target)
