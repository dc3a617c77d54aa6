"""A file wmo_trio did not write is read as a regular file, within a bound, and through a
link only when the caller says so (`wmo_trio._files.read_bounded`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from wmo_trio._files import read_bounded


def test_a_file_within_the_bound_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read_bounded(tmp_path / "f", 10) == b"x" * 10


def test_a_file_past_the_bound_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match="it is 11 bytes, over the limit of 10"):
        read_bounded(tmp_path / "f", 10)


def test_a_link_is_followed_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"secret")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    with pytest.raises(OSError) as error:
        read_bounded(tmp_path / "link", 100)
    assert error.value.errno == errno.ELOOP
    assert read_bounded(tmp_path / "link", 100, follow=True) == b"secret"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"it is a FIFO \(named pipe\), not a regular file"):
        read_bounded(tmp_path / "fifo", 100)


def test_a_device_is_refused_unopened() -> None:
    with pytest.raises(ValueError, match="it is a character device, not a regular file"):
        read_bounded("/dev/zero", 100, follow=True)
