"""The verifier's reward files, copied out of a trial apart from the rest of its logs and
bounded.

Harbor reads ``/logs/verifier/reward.txt`` and ``reward.json`` whole once it has
downloaded the verifier's directory (harbor 0.25's ``Verifier``: ``read_text``, then
``float`` or ``json.loads``), so their size is harbor's memory: a ``reward.txt`` of
512 MiB (a "1" and spaces) took harbor's process from 233 MiB to 1,110 MiB, and scored
1.0. Each is copied out on its own, :data:`REWARD_FILE_LIMIT` bytes at most; an honest
one is a number, or a flat JSON object of named numbers (a thousand of them take about
50 KB). One past the bound, or that is not a regular file, reaches harbor as a short
text saying why, which harbor cannot parse as a reward: the trial ends as harbor ends
any bad reward file, with its ``VerifierOutputParseError`` (a failed verifier: no
reward, no retry), and nothing more than that text is read or written on the host. A
link is followed while it stays in the verifier's directory (harbor would read through
its copy); one leading out is left out, as every such link of a copied directory is.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wmo_trio.sandbox._hostfs import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    kernel_filesystem,
    open_in_root,
    open_regular,
    openat2,
    replace_beneath,
)
from wmo_trio.sandbox._transfer import TransferLimits, download_dir

__all__ = ["REWARD_FILES", "REWARD_FILE_LIMIT", "download_reward_files", "download_with_rewards",
           "excluding_rewards"]

REWARD_FILES = ("reward.txt", "reward.json")
REWARD_FILE_LIMIT = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
# A link is followed only while it stays below the verifier's directory: what a copy of
# the directory with its inside links would give harbor to read.
_BENEATH_FOLLOWING_LINKS = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS


def excluding_rewards(exclude: Callable[[str], bool] | None) -> Callable[[str], bool]:
    """``exclude`` for the verifier directory's copy, which leaves its reward files to
    :func:`download_reward_files`."""
    return lambda path: path in REWARD_FILES or (exclude is not None and exclude(path))


@dataclass(frozen=True)
class _Refused:
    why: str
    stand_in: bool  # harbor is given a text in its place; else the file is left out


def _read_reward(directory: int, name: str) -> bytes | _Refused | None:
    """The reward file's bytes, why it is not copied, or None if there is none."""
    try:
        path_fd = openat2(directory, name, os.O_PATH, _BENEATH_FOLLOWING_LINKS)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        if error.errno not in (errno.EXDEV, errno.ELOOP):
            raise
        # As any link out of a copied directory: not made on the host, said in a warning.
        try:
            link = os.readlink(name, dir_fd=directory)
        except OSError:
            link = "?"
        return _Refused(f"is a link leading out of its directory ({name} -> {link})",
                        stand_in=False)
    try:
        fd = open_regular(path_fd)
    finally:
        os.close(path_fd)
    if fd is None:
        return _Refused("is not a regular file", stand_in=True)
    with os.fdopen(fd, "rb") as handle:
        kernel = kernel_filesystem(fd)
        if kernel is not None:
            return _Refused(f"is on the kernel's {kernel} filesystem", stand_in=True)
        size = os.fstat(fd).st_size
        data = handle.read(REWARD_FILE_LIMIT + 1) if size <= REWARD_FILE_LIMIT else b""
        if size > REWARD_FILE_LIMIT or len(data) > REWARD_FILE_LIMIT:
            return _Refused(f"holds more than {REWARD_FILE_LIMIT >> 20} MiB "
                            f"({max(size, len(data)):,} bytes)", stand_in=True)
    return data


def _stand_in(source: str, why: str) -> bytes:
    """What harbor reads in place of a reward file that cannot be one: text that is no
    number, and for ``reward.json`` a JSON string, which harbor names in its error."""
    text = (f"wmo-trio sandbox: {source} {why}; harbor reads a reward file whole, so it was "
            f"not copied (a reward file holds at most {REWARD_FILE_LIMIT >> 20} MiB here)")
    return (json.dumps(text) if source.endswith(".json") else text).encode() + b"\n"


async def download_reward_files(open_root: Callable[[], int], source_dir: str,
                                target_dir: Path, *,
                                exclude: Callable[[str], bool] | None = None,
                                select: Callable[[str], bool] | None = None) -> list[str]:
    """Copy ``reward.txt`` and ``reward.json`` of the trial's ``source_dir`` (those
    there, and those the directory's copy would take: see ``_transfer.download_dir``'s
    ``exclude`` and ``select``) into ``target_dir`` within :data:`REWARD_FILE_LIMIT`;
    one replaced by a text saying why when it cannot be a reward. A warning for each
    file not copied as it is."""
    names = [name for name in REWARD_FILES if not (exclude is not None and exclude(name))
             and (select is None or select(name))]

    def run() -> list[str]:
        warnings = []
        root_fd = open_root()
        try:
            directory = open_in_root(root_fd, source_dir, _DIR_FLAGS)
        finally:
            os.close(root_fd)
        try:
            target_dir.mkdir(parents=True, exist_ok=True)
            target = os.open(target_dir, _DIR_FLAGS | os.O_CLOEXEC)
            try:
                for name in names:
                    data = _read_reward(directory, name)
                    source = f"{source_dir.rstrip('/')}/{name}"
                    if isinstance(data, _Refused):
                        warnings.append(f"{source} {data.why}: not copied" + (
                            ", so harbor scores the trial as it scores a bad reward file"
                            if data.stand_in else ""))
                        data = _stand_in(source, data.why) if data.stand_in else None
                    if data is None:
                        continue
                    replace_beneath(target, name, functools.partial(_write_all, data=data),
                                    0o644)
            finally:
                os.close(target)
        finally:
            os.close(directory)
        return warnings

    return await asyncio.to_thread(run)


async def download_with_rewards(open_root: Callable[[], int], source_dir: str, target_dir: Path,
                                limits: TransferLimits, *, rewards: bool,
                                warn: Callable[[str], None],
                                exclude: Callable[[str], bool] | None = None,
                                select: Callable[[str], bool] | None = None) -> None:
    """Copy the trial's directory ``source_dir`` into ``target_dir`` (as
    ``_transfer.download_dir``), its reward files apart when ``rewards`` (the verifier's
    directory); each warning to ``warn``. Raises ``TransferIncomplete`` once whatever
    fitted is copied, if anything was left out."""
    copied_apart = excluding_rewards(exclude) if rewards else exclude
    outcome = await download_dir(open_root, source_dir, target_dir, limits,
                                 exclude=copied_apart, select=select)
    if rewards:
        for said in await download_reward_files(open_root, source_dir, target_dir,
                                                exclude=exclude, select=select):
            warn(said)
    warning = outcome.warning()
    if warning is not None:
        warn(warning)
    outcome.check()


def _write_all(fd: int, *, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
