"""The host's part of a sandbox's root: which host directories stand in for the base
image, and the small layers that hide the rest.

A sandbox's root is one overlay per *system directory* (``/usr``, ``/etc``, ``/var``,
``/opt`` and any of ``/bin``, ``/sbin``, ``/lib*`` that are real directories) under a
root overlay whose lowest layer is a *skeleton*: empty mount points, the host's
``/bin -> usr/bin`` style links, and empty ``/tmp``, ``/root``, ``/home``. Nothing else
of the host is a layer. A *mask* layer, just above each host directory, whites out what
must stay unseen inside it (the project, job and cache directories when they live
there, ``/var/tmp``, ``/var/log``) and the ``EXTERNALLY-MANAGED`` marker of the host's
Python, since the Python of an image is the image's to install into; it also holds the
host's account files without the accounts of people, as an image has system ones only.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostLayers", "host_layers"]

# Top-level host directories that may be part of the image, when they exist.
SYSTEM_DIRECTORIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "var", "opt")
# Empty directories every root has; the sandbox mounts /proc and /dev on theirs.
EMPTY_DIRECTORIES = {"proc": 0o555, "sys": 0o555, "dev": 0o755, "tmp": 0o1777, "root": 0o700,
                     "home": 0o755, "mnt": 0o755, "media": 0o755, "srv": 0o755, "run": 0o755,
                     "boot": 0o755}
# Inside system directories: shown empty (host scratch space and logs stay private).
EMPTIED = {"var/tmp": 0o1777, "var/log": 0o755, "var/mail": 0o2775, "var/spool/mail": 0o2775}
LAYOUT_VERSION = 3
# The account files of /etc, and the field of each that says whose entry it is.
ACCOUNT_FILES = {"passwd": "uid", "shadow": "passwd", "group": "gid", "gshadow": "group"}


@dataclass(frozen=True)
class HostLayers:
    """Where the host's layers of every sandbox root are."""

    skeleton: Path
    mask: Path
    system: tuple[str, ...]  # the system directories overlaid, e.g. ("etc", "opt", "usr", "var")

    def lower_dirs(self, name: str) -> list[str]:
        """The host layers of one system directory, top first."""
        return [str(self.mask / name), f"/{name}"]


def _whiteout(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o600 | 0o020000, os.makedev(0, 0))  # S_IFCHR 0/0: overlay's whiteout


def _opaque_dir(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.setxattr(path, "trusted.overlay.opaque", b"y")


def _hidden_entries(hidden: Iterable[Path], system: tuple[str, ...]) -> list[str]:
    """Hidden host paths that lie inside a system directory, relative to ``/``."""
    entries = []
    for path in hidden:
        parts = path.resolve().parts[1:]
        if len(parts) >= 2 and parts[0] in system:
            entries.append("/".join(parts))
    return sorted(set(entries))


def _build(target: Path, system: tuple[str, ...], hidden: list[str]) -> None:
    skeleton, mask = target / "skeleton", target / "mask"
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
    for relative, mode in EMPTIED.items():
        if relative.split("/")[0] in system and Path("/", relative).is_dir():
            _opaque_dir(mask / relative, mode)
    if "var" in system:
        _opaque_dir(mask / "var/log/apt", 0o755)  # apt writes its logs there
    for marker in glob.glob("/usr/lib/python3*/EXTERNALLY-MANAGED"):
        _whiteout(mask / marker.lstrip("/"))
    # Python images have `python`; Debian has it only with python-is-python3.
    python3 = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    if "usr" in system and python3 and not shutil.which("python", path="/usr/local/bin:/usr/bin"):
        (mask / "usr/local/bin").mkdir(parents=True, exist_ok=True)
        (mask / "usr/local/bin/python").symlink_to(python3)
    if "etc" in system:
        _system_accounts(mask)
    for relative in hidden:
        if not (mask / relative).exists():
            _whiteout(mask / relative)


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
    """The skeleton and mask for these hidden paths, made once and kept in ``cache_dir``."""
    system = tuple(name for name in SYSTEM_DIRECTORIES
                   if (Path("/") / name).is_dir() and not (Path("/") / name).is_symlink())
    entries = _hidden_entries(hidden, system)
    links = {name: os.readlink(f"/{name}") for name in SYSTEM_DIRECTORIES
             if os.path.islink(f"/{name}")}
    accounts = [hashlib.sha256(path.read_bytes()).hexdigest()
                for path in (Path("/etc") / name for name in ACCOUNT_FILES) if path.is_file()]
    key = hashlib.sha256(json.dumps([LAYOUT_VERSION, system, entries, links, accounts,
                                     sorted(glob.glob("/usr/lib/python3*/EXTERNALLY-MANAGED"))])
                         .encode()).hexdigest()[:16]
    target = cache_dir / "host" / key
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".new-", dir=target.parent))
        try:
            _build(scratch, system, entries)
            try:
                scratch.rename(target)
            except OSError:
                if not target.is_dir():  # not another process having made it meanwhile
                    raise
        finally:
            if scratch.exists():
                shutil.rmtree(scratch)
    return HostLayers(skeleton=target / "skeleton", mask=target / "mask", system=system)
