"""The host's part of a sandbox's root: which host directories stand in for the base
image, and the small layers that hide the rest.

A sandbox's root is one overlay per *system directory* (``/usr``, ``/etc``, ``/var``,
``/opt`` and any of ``/bin``, ``/sbin``, ``/lib*`` that are real directories) under a
root overlay whose lowest layer is a *skeleton*: empty mount points, the host's
``/bin -> usr/bin`` style links, and empty ``/tmp``, ``/root``, ``/home``. Nothing else
of the host is a layer. A *mask* layer, just above each host directory, empties what no
image has (``/var/tmp``, ``/var/log``) and whites out the ``EXTERNALLY-MANAGED`` marker
of the host's Python, since the Python of an image is the image's to install into, and
man-db's ``auto-update`` flag, since no image has man-db's index for a package to update; it
also holds the host's account files without the accounts of people, as an image has
system ones only. The skeleton and mask depend on the host alone, so every job shares
them and the images built on them.

What one sandbox must not see inside the system directories (harbor's tasks and jobs,
the project, the caches, when they live there) is whited out by a *hiding* layer of its
own, above the mask, made in the sandbox's state directory at each start.

Every process that uses a host layer (a trial, and the builds it runs) holds a *lease*
on it, a shared lock on its lock file, from before it looks for the layer until its
sandboxes are gone; ``wmo-trio sandbox prune`` removes a layer only once it holds that
lock exclusively, so it never takes one from under a running build or trial, in any
job or process.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import posixpath
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from wmo_trio.sandbox._hostfs import remove_or_set_aside

__all__ = ["HostLayers", "Lease", "host_layers", "make_hiding_layer", "prune_host_layers"]

# Top-level host directories that may be part of the image, when they exist.
SYSTEM_DIRECTORIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "var", "opt")
# Empty directories every root has; the sandbox mounts /proc and /dev on theirs.
EMPTY_DIRECTORIES = {"proc": 0o555, "sys": 0o555, "dev": 0o755, "tmp": 0o1777, "root": 0o700,
                     "home": 0o755, "mnt": 0o755, "media": 0o755, "srv": 0o755, "run": 0o755,
                     "boot": 0o755}
# Inside system directories: shown empty (host scratch space and logs stay private).
EMPTIED = {"var/tmp": 0o1777, "var/log": 0o755, "var/mail": 0o2775, "var/spool/mail": 0o2775}
LAYOUT_VERSION = 5
# While it exists, man-db's package trigger rebuilds the manual pages' index.
MAN_DB_AUTO_UPDATE = "/var/lib/man-db/auto-update"
# The hierarchies inside which each directory holds the host's software as a whole
# (usr/local, usr/share, var/lib, var/cache...): a path to hide that is one of them, or a
# system directory itself, is not whited out whole, or the image would lose its tools.
SHARED_PARENTS = ("", "usr", "usr/local", "var")
# The account files of /etc, and the field of each that says whose entry it is.
ACCOUNT_FILES = {"passwd": "uid", "shadow": "passwd", "group": "gid", "gshadow": "group"}


@dataclass
class Lease:
    """A shared lock held on a layer's lock file while the layer is in use."""

    fd: int = -1

    @classmethod
    def take(cls, lock_path: Path) -> Lease:
        """Hold ``lock_path`` shared (made if missing), waiting while a prune holds it.
        A prune unlinks the file before it lets go: a lock on an unlinked file guards
        nothing, so the lease is taken again on the file now there."""
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if os.fstat(fd).st_nlink > 0:
                    return cls(fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def release(self) -> None:
        """Let go (once; again is nothing)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class HostLayers:
    """Where the host's layers of every sandbox root are, and the lease that keeps them
    there until :meth:`release`."""

    skeleton: Path
    mask: Path
    system: tuple[str, ...]  # the system directories overlaid, e.g. ("etc", "opt", "usr", "var")
    hidden: tuple[str, ...] = ()  # what a sandbox's hiding layer whites out, relative to /
    lease: Lease = field(default_factory=Lease, compare=False, repr=False)

    def release(self) -> None:
        """The sandboxes built on these layers are gone: a prune may remove them."""
        self.lease.release()

    @property
    def identity(self) -> str:
        """What the layers are made of: the host's layout, whatever a job hides."""
        return self.skeleton.parent.name

    def lower_dirs(self, name: str, hiding: Path | None = None) -> list[str]:
        """The host layers of one system directory, top first: the sandbox's hiding
        layer when it hides something there, the mask, the host's directory."""
        layers = [str(self.mask / name), f"/{name}"]
        if hiding is not None and (hiding / name).is_dir():
            layers.insert(0, str(hiding / name))
        return layers


def _whiteout(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o600 | 0o020000, os.makedev(0, 0))  # S_IFCHR 0/0: overlay's whiteout


def _opaque_dir(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.setxattr(path, "trusted.overlay.opaque", b"y")


def _harbors(path: Path) -> bool:
    """Whether a directory is a harbor task, or a job directory harbor wrote."""
    if (path / "task.toml").is_file():
        return True
    return (path / "config.json").is_file() and any(
        (path / name).is_file() for name in ("lock.json", "result.json", "job.log"))


def _hidden_entries(hidden: Iterable[Path], system: tuple[str, ...]) -> list[str]:
    """Hidden host paths that lie inside a system directory, relative to ``/``, none
    inside another (a whiteout hides what lies under it; it cannot also hold it).

    A path that holds the host's software as a whole (``/opt``, ``/usr/local``,
    ``/var/lib``) is not hidden; the harbor tasks and job directories in it are."""
    entries = set()
    for path in hidden:
        resolved = path.resolve()
        parts = resolved.parts[1:]
        if not parts or parts[0] not in system:
            continue
        relative = "/".join(parts)
        if posixpath.dirname(relative) not in SHARED_PARENTS:
            entries.add(relative)
        elif resolved.is_dir():
            with contextlib.suppress(OSError):
                entries.update(f"{relative}/{child.name}" for child in resolved.iterdir()
                               if child.is_dir() and not child.is_symlink() and _harbors(child))
    kept: list[str] = []
    for entry in sorted(entries):
        # What lies in a directory shown empty anyway needs no whiteout.
        if not any(entry == outer or entry.startswith(outer + "/")
                   for outer in [*kept, *EMPTIED]):
            kept.append(entry)
    return kept


def make_hiding_layer(target: Path, entries: Iterable[str]) -> None:
    """A sandbox's hiding layer in ``target``: a whiteout for each entry (relative to
    ``/``), in directories that copy the host's owner, mode and times, since an overlay
    shows those of the top layer that has the directory."""
    made: list[str] = []
    for relative in entries:
        parts = relative.split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            if not (target / directory).is_dir():
                (target / directory).mkdir(parents=True)
                made.append(directory)
        _whiteout(target / relative)
    # Once every entry is in (each changed its directory's times). A system directory's
    # own attributes come from its upper layer; a path to hide that does not exist yet
    # may appear while the sandbox runs. Not extended attributes: an overlay's own
    # (opaque) would hide all of the host's directory.
    for directory in made:
        host = Path("/", directory)
        if "/" in directory and host.is_dir():
            info = host.stat()
            os.chown(target / directory, info.st_uid, info.st_gid)
            os.chmod(target / directory, stat.S_IMODE(info.st_mode))
            os.utime(target / directory, ns=(info.st_atime_ns, info.st_mtime_ns))


def _build(target: Path, system: tuple[str, ...]) -> None:
    skeleton, mask = target / "skeleton", target / "mask"
    _skeleton(skeleton, mask, system)
    _mask(mask, system)


def _skeleton(skeleton: Path, mask: Path, system: tuple[str, ...]) -> None:
    """The root's own directories: the empty ones an image has, each system directory
    (a link where the host's is one) and its place in the mask."""
    skeleton.mkdir(parents=True)
    for name, mode in EMPTY_DIRECTORIES.items():
        (skeleton / name).mkdir()
        os.chmod(skeleton / name, mode)
    for name in SYSTEM_DIRECTORIES:
        host = Path("/") / name
        if host.is_symlink():
            (skeleton / name).symlink_to(os.readlink(host))
        elif name in system:
            (skeleton / name).mkdir(mode=0o755)
            (mask / name).mkdir(parents=True, exist_ok=True)


def _mask(mask: Path, system: tuple[str, ...]) -> None:
    """What the mask layer hides or changes of the host's system directories, so they
    look like an image's."""
    for relative, mode in EMPTIED.items():
        if relative.split("/")[0] in system and Path("/", relative).is_dir():
            _opaque_dir(mask / relative, mode)
    if "var" in system:
        _opaque_dir(mask / "var/log/apt", 0o755)  # apt writes its logs there
    for marker in glob.glob("/usr/lib/python3*/EXTERNALLY-MANAGED"):
        _whiteout(mask / marker.lstrip("/"))
    # The images the host stands in for have no man-db; the host's would rebuild its
    # index after every package a build or a trial installs, seconds of CPU each time.
    if "var" in system and os.path.lexists(MAN_DB_AUTO_UPDATE):
        _whiteout(mask / MAN_DB_AUTO_UPDATE.lstrip("/"))
    if "usr" in system:
        _python_alias(mask)
    if "etc" in system:
        _system_accounts(mask)


def _python_alias(mask: Path) -> None:
    """Python images have `python`; Debian has it only with python-is-python3."""
    python3 = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    if python3 and not shutil.which("python", path="/usr/local/bin:/usr/bin"):
        (mask / "usr/local/bin").mkdir(parents=True, exist_ok=True)
        (mask / "usr/local/bin/python").symlink_to(python3)


def _login_range(prefix: str) -> range:
    """The ids ``useradd`` gives people (``UID_MIN``..``UID_MAX`` of login.defs)."""
    bounds = {f"{prefix}_MIN": 1000, f"{prefix}_MAX": 60000}
    try:
        for line in Path("/etc/login.defs").read_text().splitlines():
            words = line.split()
            if len(words) == 2 and words[0] in bounds and words[1].isdigit():
                bounds[words[0]] = int(words[1])
    except OSError:
        pass
    return range(bounds[f"{prefix}_MIN"], bounds[f"{prefix}_MAX"] + 1)


def _system_accounts(mask: Path) -> None:
    """The host's account files without its people's accounts: an image holds system
    accounts only, and its Dockerfile's ``useradd -u 1000`` must find that id free."""
    people = {"uid": _login_range("UID"), "gid": _login_range("GID")}
    dropped: dict[str, set[str]] = {}
    for name, owner in ACCOUNT_FILES.items():
        source = Path("/etc") / name
        if not source.is_file():
            continue
        kept, gone = [], set()
        for line in source.read_text().splitlines(keepends=True):
            fields = line.split(":")
            if owner in people:
                person = len(fields) > 2 and fields[2].isdigit() and int(fields[2]) in people[owner]
            else:
                person = fields[0] in dropped.get(owner, set())
            if person:
                gone.add(fields[0])
            else:
                kept.append(line)
        dropped[name] = gone
        target = mask / "etc" / name
        target.write_text("".join(kept))
        shutil.copystat(source, target)
        info = source.stat()
        os.chown(target, info.st_uid, info.st_gid)


def host_layers(cache_dir: Path, hidden: Iterable[Path]) -> HostLayers:
    """The skeleton and mask of this host, made once and kept in ``cache_dir``, and what
    of ``hidden`` a sandbox's hiding layer must white out; held (their lease) until
    :meth:`HostLayers.release`."""
    system = tuple(name for name in SYSTEM_DIRECTORIES
                   if (Path("/") / name).is_dir() and not (Path("/") / name).is_symlink())
    links = {name: os.readlink(f"/{name}") for name in SYSTEM_DIRECTORIES
             if os.path.islink(f"/{name}")}
    accounts = [hashlib.sha256(path.read_bytes()).hexdigest()
                for path in (Path("/etc") / name for name in ACCOUNT_FILES) if path.is_file()]
    key = hashlib.sha256(json.dumps([LAYOUT_VERSION, system, links, accounts,
                                     sorted(glob.glob("/usr/lib/python3*/EXTERNALLY-MANAGED")),
                                     os.path.lexists(MAN_DB_AUTO_UPDATE)])
                         .encode()).hexdigest()[:16]
    target = cache_dir / "host" / key
    target.parent.mkdir(parents=True, exist_ok=True)
    lease = Lease.take(target.with_name(f"{key}.lock"))
    try:
        if not target.is_dir():
            # Named after its layers: a prune knows whose lease guards it.
            scratch = Path(tempfile.mkdtemp(prefix=f".new-{key}-", dir=target.parent))
            try:
                _build(scratch, system)
                try:
                    scratch.rename(target)
                except OSError:
                    if not target.is_dir():  # not another process having made it meanwhile
                        raise
            finally:
                if scratch.exists():
                    shutil.rmtree(scratch)
        return HostLayers(skeleton=target / "skeleton", mask=target / "mask", system=system,
                          hidden=tuple(_hidden_entries(hidden, system)), lease=lease)
    except BaseException:
        lease.release()
        raise


def prune_host_layers(cache_dir: Path) -> tuple[list[Path], list[Path]]:
    """Remove the host layers in ``cache_dir`` that no process holds a lease on (they
    are made again in milliseconds when next needed), with what was left of their
    making by a process that died; the layers removed and those kept, in use."""
    removed: list[Path] = []
    in_use: list[Path] = []
    directory = cache_dir / "host"
    if not directory.is_dir():
        return removed, in_use
    keys = {path.name.removesuffix(".lock") for path in directory.iterdir()
            if not path.name.startswith(".")}
    for key in sorted(keys):
        lock_path = directory / f"{key}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                in_use.append(directory / key)
                continue
            if os.fstat(fd).st_nlink == 0:  # another prune's, just now
                continue
            for path in [directory / key, *directory.glob(f".new-{key}-*")]:
                if path.exists():
                    remove_or_set_aside(path, logging.getLogger(__name__))
                    if path.name == key:
                        removed.append(path)
            lock_path.unlink()  # before the lock goes: see Lease.take
        finally:
            os.close(fd)
    return removed, in_use
