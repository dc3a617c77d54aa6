"""A sandbox's state directory on the host: where its overlays write, its mount table and
its launch log lie, and how long it lives.

A state directory is made by its sandbox's owner and held through a lock file beside
it (``<name>.lock``): the owner locks it, and so does every process of the sandbox (the
lock's descriptor is passed to the launch), so the directory is in use while any of
them lives. It ends one of three ways, each once:

- removed at once (:meth:`StateDir.close`, the end of a ``with`` or ``async with``
  block): a build's directories, and a trial's that failed to start;
- removed in a thread of its own once nothing runs in the sandbox any more
  (:meth:`StateDir.remove_later`): a trial's stop need not wait for its files to go;
- kept for inspection (:meth:`StateDir.keep`), out of the sweep's reach.

A directory whose owners all died (a SIGKILLed harbor) is left to the next start's
sweep (:func:`remove_stale_states`), which takes only directories whose lock it can
take. Whatever will not go is set aside (``_hostfs.remove_or_set_aside``), never left
in a later start's way.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Self

from wmo_trio.sandbox._hostfs import remove_or_set_aside, remove_tree

__all__ = ["StateDir", "default_state_root", "remove_stale_states", "same_file",
           "wait_for_removals"]

log = logging.getLogger(__name__)


def default_state_root() -> Path:
    return Path(tempfile.gettempdir()) / "wmo-trio-sandbox"


def same_file(fd: int, path: Path) -> bool:
    """Whether the lock file ``fd`` holds is still the one at ``path``: a cleaner may
    have removed it between its opening and its locking, and a lock on a removed file
    guards nothing."""
    try:
        held, named = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


class StateDir:
    """A sandbox's private directory on the host, kept while its lock file is locked
    (see the module docstring for how it ends). Blocking calls; the ``async with``
    block removes it in a thread."""

    def __init__(self, path: Path, lock_path: Path, lock_fd: int) -> None:
        self.path = path
        self.lock_path = lock_path
        self.lock_fd = lock_fd
        self.handed_on = False  # to remove_later, or kept: close leaves it alone

    @classmethod
    def create(cls, root: Path, name: str) -> StateDir:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        prefix = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:60]
        while True:
            path = root / f"{prefix}.{uuid.uuid4().hex[:10]}"
            lock_path = path.with_name(path.name + ".lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if same_file(fd, lock_path):
                break
            os.close(fd)
        path.mkdir(mode=0o700)
        return cls(path, lock_path, fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Remove the directory now, unless it was handed on (:meth:`remove_later`,
        :meth:`keep`)."""
        if not self.handed_on:
            self.handed_on = True
            self._remove()

    def _remove(self) -> None:
        """Remove the directory (what will not go is set aside) and its lock file; then
        release the lock."""
        try:
            remove_or_set_aside(self.path, log)
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()
        finally:
            os.close(self.lock_fd)

    def remove_later(self, first: Callable[[], None] | None = None) -> None:
        """Remove the directory in a thread of its own, once nothing runs in the sandbox
        any more. The lock is held till it is gone, so no other start takes it for a
        stale one; the interpreter waits for the thread at its exit (as does
        :func:`wait_for_removals`), and a process killed meanwhile leaves the rest to a
        later start. ``first`` runs in the thread before the removal."""
        self.handed_on = True

        def remove() -> None:
            try:
                if first is not None:
                    first()
                self._remove()
            except OSError as error:
                log.warning("could not remove the sandbox directory %s: %s", self.path, error)
            finally:
                with _REMOVING_LOCK:
                    _REMOVING.discard(thread)

        thread = threading.Thread(target=remove, name=f"remove {self.path.name}", daemon=False)
        with _REMOVING_LOCK:
            _REMOVING.add(thread)
        thread.start()

    def keep(self, drop: tuple[str, ...]) -> Path:
        """Keep the directory, less its entries ``drop``, as ``kept-<name>`` beside the
        others, out of reach of the sweep; release its lock. Where it now is."""
        self.handed_on = True
        try:
            kept = self.path.with_name("kept-" + self.path.name)
            for scratch in drop:
                remove_tree(self.path / scratch)
            os.rename(self.path, kept)
            self.path = kept
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()
        finally:
            os.close(self.lock_fd)
        return kept


# The threads of StateDir.remove_later still running.
_REMOVING: set[threading.Thread] = set()
_REMOVING_LOCK = threading.Lock()


def wait_for_removals() -> None:
    """Wait until every state directory this process is removing in the background is
    gone (or failed to go, with a warning)."""
    while True:
        with _REMOVING_LOCK:
            pending = next(iter(_REMOVING), None)
        if pending is None:
            return
        pending.join()
        with _REMOVING_LOCK:
            _REMOVING.discard(pending)


def remove_stale_states(root: Path) -> list[Path]:
    """Remove state directories whose owners all died (e.g. a SIGKILLed harbor); safe
    while other jobs run, since live sandboxes hold their locks. What will not go is
    set aside (``remove_or_set_aside``): no leftover fails a later start."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for lock_path in root.glob("*.lock"):
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if not same_file(fd, lock_path):
                continue
            directory = lock_path.with_suffix("")
            try:
                remove_or_set_aside(directory, log)
                lock_path.unlink()
            except OSError as error:  # tried again by the next start
                log.warning("could not remove the stale sandbox directory %s: %s",
                            directory, error)
                continue
            removed.append(directory)
        finally:
            os.close(fd)
    return removed
