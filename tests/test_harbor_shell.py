"""`HarborShell`: how a harbor task environment runs commands and writes files, on its own
asyncio loop, for the harbor agent's adapter and the research API's `HarborEnvironment`
alike. Against an asyncio environment with harbor's `exec`/`upload_file` signature."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from wmo_trio.episode._environment import INLINE_WRITE_LIMIT, CommandResult, HarborShell


@dataclass
class ExecResult:  # harbor's ExecResult: a stream may be None
    stdout: str | None
    stderr: str | None
    return_code: int


class AsyncioEnvironment:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.timeouts: list[int | None] = []
        self.uploads: list[str] = []
        self.upload_started = asyncio.Event()
        self.hold_uploads = False

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | None = None) -> ExecResult:
        self.timeouts.append(timeout_sec)
        process = await asyncio.create_subprocess_shell(
            command, cwd=self.workdir, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await process.communicate()
        return ExecResult(out.decode() or None, err.decode() or None, process.returncode or 0)

    async def upload_file(self, source_path: str, target_path: str) -> None:
        self.uploads.append(target_path)
        self.upload_started.set()
        if self.hold_uploads:
            await asyncio.Event().wait()
        shutil.copyfile(source_path, target_path)


@pytest.fixture
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "staging"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def test_a_command_gets_the_command_timeout_and_empty_streams_for_missing_ones(tmp_path: Path) -> None:
    environment = AsyncioEnvironment(tmp_path)
    shell = HarborShell(environment, command_timeout_sec=17)
    assert asyncio.run(shell.exec("true")) == CommandResult("", "", 0)
    assert asyncio.run(shell.exec("echo out; echo err >&2; exit 3")) == CommandResult("out\n", "err\n", 3)
    assert environment.timeouts == [17, 17]


def test_small_content_is_written_by_one_command_into_a_parent_named_with_a_newline(
        tmp_path: Path) -> None:
    environment = AsyncioEnvironment(tmp_path)
    asyncio.run(HarborShell(environment).write_file("nldir\n/f.txt", b"one\n"))
    assert (tmp_path / "nldir\n" / "f.txt").read_bytes() == b"one\n"
    assert not (tmp_path / "nldir").exists()
    assert environment.uploads == [] and len(environment.timeouts) == 1


def test_large_content_is_uploaded_to_the_resolved_path_and_its_staged_copy_removed(
        tmp_path: Path, staging: Path) -> None:
    environment = AsyncioEnvironment(tmp_path)
    data = bytes(range(256)) * (INLINE_WRITE_LIMIT // 256 + 1)
    asyncio.run(HarborShell(environment).write_file("big/data.bin", data))
    assert (tmp_path / "big" / "data.bin").read_bytes() == data
    assert environment.uploads == [str(tmp_path / "big" / "data.bin")]
    assert list(staging.iterdir()) == []


def test_a_failed_command_is_an_os_error_with_its_output(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=r"^exit 1: mkdir"):
        asyncio.run(HarborShell(AsyncioEnvironment(tmp_path)).write_file("file/inside.txt", b"x"))


def test_a_write_cancelled_during_its_upload_leaves_no_staged_file(tmp_path: Path, staging: Path) -> None:
    environment = AsyncioEnvironment(tmp_path)
    environment.hold_uploads = True

    async def main() -> None:
        data = b"x" * (INLINE_WRITE_LIMIT + 1)
        write = asyncio.create_task(HarborShell(environment).write_file("big.bin", data))
        await environment.upload_started.wait()
        assert len(list(staging.iterdir())) == 1  # staged, and being uploaded
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write

    asyncio.run(main())
    assert list(staging.iterdir()) == []
