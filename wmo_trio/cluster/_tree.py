"""A directory as bounded data: how a trial's directory (or a task's) crosses from one
machine to another without a shared filesystem.

`pack` reads a directory into a `PackedTree`; `unpack` writes one beneath a target
directory. Both sides treat the tree as hostile (a trial's directory holds what the
trial's environment produced): no link is followed on either side, a link is recreated
only when it stays inside the tree (`link_stays_inside`), nothing is written outside the
target (every write goes through `wmo_trio.sandbox._hostfs`'s beneath-only calls), the
sizes are bounded as the docker-free environment bounds a download (each file rounded up
to whole 4 KiB blocks, each directory and link one block), paths are bounded, and the walk
is breadth first with no recursion, so a tree thousands of levels deep costs no stack.
Removing one is `wmo_trio.sandbox._hostfs.remove_tree`'s, the sandbox's own rule.
"""

from __future__ import annotations

import collections
import errno
import functools
import os
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from wmo_trio.sandbox._hostfs import (
    FileTooLarge,
    link_stays_inside,
    make_dir_beneath,
    open_beneath,
    read_beneath,
    replace_beneath,
    replace_link_beneath,
    safe_mode,
)
from wmo_trio.sandbox._transfer import BLOCK, DEFAULT_DOWNLOAD_LIMIT_MB, MAX_RELATIVE_PATH

DEFAULT_TREE_LIMIT_BYTES = DEFAULT_DOWNLOAD_LIMIT_MB << 20
# A million empty files would fill the target's inodes long before its bytes.
MAX_ENTRIES = 200_000
LISTED_LEFT_OUT = 10
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)


def _checked_path(path: str) -> str:
    """A relative POSIX path below the tree's top: no empty, `.` or `..` part, no NUL, no
    leading `/`, at most `MAX_RELATIVE_PATH` bytes."""
    if not path or path.startswith("/") or "\0" in path:
        raise ValueError(f"not a relative path inside the tree: {path[:80]!r}")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_RELATIVE_PATH:
        raise ValueError(f"a path longer than {MAX_RELATIVE_PATH} bytes: {path[:80]!r}...")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"a path with an empty, '.' or '..' part: {path[:80]!r}")
    return path


class PackedEntry(BaseModel):
    """One entry of a tree: a directory, a regular file with its bytes, or a link."""

    model_config = ConfigDict(frozen=True)

    path: str
    kind: Literal["dir", "file", "link"]
    mode: int = Field(default=0o644, ge=0, le=0o7777)
    data: bytes = b""
    target: str = ""

    @field_validator("path")
    @classmethod
    def _path_is_inside(cls, value: str) -> str:
        return _checked_path(value)

    @property
    def cost(self) -> int:
        """What the entry counts against the bound: whole blocks, at least one."""
        return max(BLOCK, -(-len(self.data) // BLOCK) * BLOCK)


class PackedTree(BaseModel):
    """A directory's entries, parents before their children, and what `pack` left out
    (and why) to stay within its bounds."""

    model_config = ConfigDict(frozen=True)

    entries: list[PackedEntry] = Field(default_factory=list, max_length=MAX_ENTRIES)
    left_out: list[str] = Field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(entry.cost for entry in self.entries)


class TreeTooLarge(ValueError):
    """A packed tree is over the bound its receiver allows."""


def pack(top: Path, *, limit: int = DEFAULT_TREE_LIMIT_BYTES,
         skip: frozenset[str] = frozenset()) -> PackedTree:
    """The directory `top` as a `PackedTree` of at most `limit` bytes (counted as
    `PackedEntry.cost`) and `MAX_ENTRIES` entries; what does not fit is listed in
    `left_out`. Links are kept as links (never followed, and later recreated only when
    they stay inside); FIFOs, sockets and devices carry no content and are left out.
    `skip` names top-level entries not to pack. Blocks: call it in a worker thread."""
    entries: list[PackedEntry] = []
    left_out: list[str] = []
    used = 0
    top_fd = os.open(top, _DIR_FLAGS | os.O_NOFOLLOW | os.O_CLOEXEC)
    pending: collections.deque[str] = collections.deque([""])
    try:
        while pending:
            relative = pending.popleft()
            try:
                directory = open_beneath(top_fd, relative or ".", _DIR_FLAGS)
            except OSError as error:
                if error.errno not in _GONE:
                    raise
                left_out.append(f"{relative} (it changed while it was packed)")
                continue
            try:
                with os.scandir(directory) as listing:
                    names = sorted(entry.name for entry in listing)
                for name in names:
                    path = f"{relative}/{name}" if relative else name
                    if not relative and name in skip:
                        continue
                    if len(entries) >= MAX_ENTRIES:
                        left_out.append(f"{path} and what follows (more than {MAX_ENTRIES:,} "
                                        "entries)")
                        return PackedTree(entries=entries, left_out=left_out)
                    if len(path.encode("utf-8", "surrogateescape")) > MAX_RELATIVE_PATH:
                        left_out.append(f"{path[:80]}... (a path longer than "
                                        f"{MAX_RELATIVE_PATH} bytes)")
                        continue
                    entry = _entry(top, directory, name, path, limit - used)
                    if isinstance(entry, str):
                        left_out.append(f"{path} ({entry})")
                        continue
                    used += entry.cost
                    entries.append(entry)
                    if entry.kind == "dir":
                        pending.append(path)
            finally:
                os.close(directory)
    finally:
        os.close(top_fd)
    return PackedTree(entries=entries, left_out=left_out)


def _entry(top: Path, directory: int, name: str, path: str, room: int) -> PackedEntry | str:
    """The entry `name` of `directory`, or why it is left out."""
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return "it changed while it was packed"
    if room < BLOCK:
        return "over the size bound"
    if stat.S_ISDIR(info.st_mode):
        return PackedEntry(path=path, kind="dir", mode=stat.S_IMODE(info.st_mode))
    if stat.S_ISLNK(info.st_mode):
        return PackedEntry(path=path, kind="link", target=os.readlink(name, dir_fd=directory))
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file, directory or link"
    if max(BLOCK, -(-info.st_size // BLOCK) * BLOCK) > room:
        return f"{info.st_size:,} bytes, over what the size bound had left"
    try:
        data = read_beneath(top, path, info.st_size)
    except FileTooLarge:
        data = None  # it grew meanwhile
    if data is None:
        return "it changed while it was packed"
    return PackedEntry(path=path, kind="file", mode=stat.S_IMODE(info.st_mode), data=data)


def unpack(tree: PackedTree, target: Path, *, limit: int = DEFAULT_TREE_LIMIT_BYTES) -> list[str]:
    """Write `tree` beneath `target` (made if missing); what was not written, and why.

    Raises `TreeTooLarge` before writing anything when the tree is over `limit`. Nothing is
    written outside `target` and no link there is followed: a link on the way to an entry
    (in the tree or planted meanwhile) is replaced by a directory, a link in the tree is
    recreated only when it stays inside, modes lose setuid, setgid and sticky bits and
    write access for others. Blocks: call it in a worker thread."""
    if tree.size > limit:
        raise TreeTooLarge(f"{tree.size:,} bytes in {len(tree.entries):,} entries, over the "
                           f"bound of {limit:,}")
    skipped: list[str] = []
    target.mkdir(parents=True, exist_ok=True)
    with _Directories(target) as directories:
        for entry in tree.entries:
            parent_path, _, name = entry.path.rpartition("/")
            parent = directories.open(parent_path)
            try:
                if entry.kind == "dir":
                    os.close(make_dir_beneath(parent, name, safe_mode(entry.mode, directory=True)))
                elif entry.kind == "link":
                    if link_stays_inside(entry.path, entry.target):
                        replace_link_beneath(parent, name, entry.target)
                    else:
                        skipped.append(f"{entry.path} (a link pointing outside the tree)")
                else:
                    replace_beneath(parent, name, functools.partial(_write_all, data=entry.data),
                                    safe_mode(entry.mode))
            except IsADirectoryError:
                skipped.append(f"{entry.path} (a directory of that name is there)")
    return skipped


class _Directories:
    """Directories below a target, each opened (and made) beneath it once while it is
    among the last `_KEPT` used: a tree's entries come parents first, so an entry's
    parent is nearly always one of them, and a deep chain costs one step an entry, not
    one per level."""

    _KEPT = 64

    def __init__(self, target: Path) -> None:
        self._target = target
        self._open: collections.OrderedDict[str, int] = collections.OrderedDict()

    def __enter__(self) -> _Directories:
        self._open[""] = os.open(self._target, _DIR_FLAGS | os.O_NOFOLLOW | os.O_CLOEXEC)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def open(self, relative: str) -> int:
        """The directory `relative` (made as needed, a link on the way replaced by a
        directory); the descriptor stays this object's."""
        known, rest = relative, ""
        while known not in self._open:
            known, _, last = known.rpartition("/")
            rest = f"{last}/{rest}" if rest else last
        fd = self._open[known]
        self._open.move_to_end(known)
        for part in rest.split("/") if rest else ():
            fd = make_dir_beneath(fd, part, 0o755)
            known = f"{known}/{part}" if known else part
            self._open[known] = fd
            if len(self._open) > self._KEPT:
                evicted = next(key for key in self._open if key != "")
                os.close(self._open.pop(evicted))
        return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
