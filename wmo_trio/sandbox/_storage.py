"""A trial's own size-limited filesystem for what it writes: ``storage_mb`` held as
Docker's ``--storage-opt size`` holds it (the container's writable layer has that size).

Where a task sets ``storage_mb`` (harbor sets none by default), the trial's overlay upper
and work directories lie in an ext4 filesystem of that size: a sparse file in the
trial's state directory, made when the trial starts by ``mkfs.ext4 -d`` from what the
host prepared for its overlays (a few milliseconds: ``benchmarks/local_environment.py``
measures a trial's start and stop with it), and mounted through a loop device in the
launch's private mount namespace only, before the overlays. A write past the size fails
with ENOSPC inside the trial, which goes on.

The host never sees that mount, so nothing is ever unmounted by hand: the kernel drops
it with the sandbox's last mount namespace (``Sandbox.finish``, or the death of every
process of the sandbox when harbor is killed), and the loop device detaches itself with
its last mount (mount(8) makes it autoclear). What is left is the file, which goes with
the state directory, by the stop or by a later start's sweep of dead trials.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["IMAGE", "TOP", "image_bytes", "make", "problem"]

IMAGE = "storage.img"  # in the state directory
TOP = "disk"  # in the state directory: what the image is made from, and where it is mounted
# No journal (nothing of a trial outlives a crash of the host), no blocks reserved for
# root or kept to grow the filesystem, inode tables left uninitialised (holes of the
# sparse file, so a terabyte costs its metadata only); one inode per 4 KiB block, so
# files never run out before space (Docker's XFS makes inodes as they are needed).
MKFS_OPTIONS = ("-q", "-F", "-b", "4096", "-O", "^has_journal,^resize_inode", "-m", "0",
                "-E", "lazy_itable_init=1,nodiscard", "-i", "4096")
# noinit_itable: the kernel does not zero those tables in the background either.
MOUNT_OPTIONS = "loop,nodev,noinit_itable"
# The filesystem's own bookkeeping is added to the size asked for, so the trial may write
# that much: 256 bytes of inode table for each 4 KiB block, bitmaps and descriptors (well
# under 1/4096), what ext4 keeps back from every writer for its own metadata (2 % of
# the filesystem, at most 16 MiB), and a little for the root directory and lost+found.
INODE_TABLE_SHARE = (16, 15)
BITMAPS_SHARE = 4096
KEPT_BACK_SHARE, KEPT_BACK_MAX = 48, 16 << 20
SMALL_FILES = 4 << 20
# The path mkfs.ext4 is looked up on when harbor's own PATH lacks the sbin directories.
SYSTEM_PATH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"
MKFS_TIMEOUT_SEC = 120.0  # a hang, not a slow machine: mkfs takes milliseconds


def image_bytes(storage_bytes: int) -> int:
    """The size of the image whose filesystem has ``storage_bytes`` free (a little more:
    its bookkeeping is estimated from above)."""
    numerator, denominator = INODE_TABLE_SHARE
    kept_back = min(storage_bytes // KEPT_BACK_SHARE, KEPT_BACK_MAX)
    extra = storage_bytes // BITMAPS_SHARE + kept_back + SMALL_FILES
    return (storage_bytes + extra) * numerator // denominator


def _mkfs() -> str | None:
    return shutil.which("mkfs.ext4", path=os.pathsep.join(
        [os.environ.get("PATH", ""), SYSTEM_PATH]))


def make(state: Path, storage_bytes: int) -> str:
    """Make ``state``'s image, a filesystem with ``storage_bytes`` free holding a copy of
    ``state / TOP``; the line of mount(8)'s table that mounts it over ``state / TOP``.
    Raises ``RuntimeError`` saying why when it cannot be made."""
    mkfs = _mkfs()
    if mkfs is None:
        raise RuntimeError("cannot make the trial's storage_mb filesystem: no mkfs.ext4")
    image = state / IMAGE
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, image_bytes(storage_bytes))
    finally:
        os.close(fd)
    completed = subprocess.run([mkfs, *MKFS_OPTIONS, "-d", str(state / TOP), str(image)],
                               capture_output=True, timeout=MKFS_TIMEOUT_SEC,
                               env={"PATH": SYSTEM_PATH}, check=False)
    if completed.returncode != 0:
        detail = completed.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError("cannot make the trial's storage_mb filesystem: "
                           + (detail[-1] if detail else f"mkfs.ext4 exited {completed.returncode}"))
    return f"{image} {state / TOP} ext4 {MOUNT_OPTIONS} 0 0\n"


@functools.cache
def problem() -> str | None:
    """Why this machine cannot give a trial a filesystem of its own size, or None:
    found once per process by making one and mounting it as a trial's launch does."""
    if _mkfs() is None:
        return "mkfs.ext4 (e2fsprogs) is not installed"
    if not os.path.exists("/dev/loop-control"):
        return "this machine offers no loop devices (/dev/loop-control is missing)"
    unshare = shutil.which("unshare", path=SYSTEM_PATH)
    if unshare is None:
        return "util-linux's unshare is not installed"
    with tempfile.TemporaryDirectory(prefix="wmo-trio-storage-probe-") as scratch:
        state = Path(scratch)
        (state / TOP).mkdir()
        try:
            make(state, 1 << 20)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            return str(error)
        try:
            # In a mount namespace of its own, which ends (the mount with it) at its exit.
            completed = subprocess.run(
                [unshare, "--mount", "--propagation", "private", "mount", "-t", "ext4", "-o",
                 MOUNT_OPTIONS, str(state / IMAGE), str(state / TOP)],
                capture_output=True, timeout=MKFS_TIMEOUT_SEC, env={"PATH": SYSTEM_PATH},
                check=False)
        except (OSError, subprocess.SubprocessError) as error:
            return f"a loop-mounted ext4 filesystem cannot be mounted here: {error}"
        if completed.returncode != 0:
            detail = completed.stderr.decode(errors="replace").strip().splitlines()
            return ("a loop-mounted ext4 filesystem cannot be mounted here: "
                    + (detail[-1] if detail else f"mount exited {completed.returncode}"))
    return None
