"""The host's end of a sandbox's control socket, on its own (no sandbox needed)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from wmo_trio.sandbox._namespace import helper_program
from wmo_trio.sandbox._processes import Channel
from wmo_trio.sandbox._profile import DEFAULT_PATH

# Bounds a hang only: the wake-up takes microseconds.
WAKE_BOUND_SEC = 30.0


def reuse(number: int) -> tuple[int, int]:
    """A new pipe whose read end has the descriptor number ``number``."""
    read_end, write_end = os.pipe()  # the lowest free numbers: often ``number`` itself
    if read_end != number:
        os.dup2(read_end, number)
        os.close(read_end)
    return number, write_end


class ReusedOnClose(socket.socket):
    """A socket whose descriptor number, the moment it is closed, becomes a pipe's
    read end that the loop is asked to watch: what happens when another coroutine
    opens a file meanwhile (asyncio watching a new child's pidfd, in the harbor job
    where the defect was found: a trial's stop then waited forever for a zombie)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reused: tuple[int, int] | None = None
        self.woke = asyncio.Event()

    def close(self) -> None:
        number = self.fileno()
        super().close()
        if number < 0 or self.reused is not None:
            return
        self.reused = reuse(number)
        asyncio.get_running_loop().add_reader(number, self.woke.set)


def test_a_closed_channel_leaves_its_descriptor_number_to_whoever_gets_it_next() -> None:
    async def scenario() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        watched = ReusedOnClose(fileno=ours.detach())
        channel = Channel(watched)
        await asyncio.sleep(0)  # the reader task is in sock_recv
        await channel.close()
        theirs.close()
        assert watched.reused is not None
        number, write_end = watched.reused
        try:
            os.write(write_end, b"x")
            # The new file is watched: before the fix, the reader's late clean-up
            # unregistered the number, and this wake never came.
            await asyncio.wait_for(watched.woke.wait(), WAKE_BOUND_SEC)
        finally:
            asyncio.get_running_loop().remove_reader(number)
            os.close(number)
            os.close(write_end)

    asyncio.run(scenario())


def test_a_cancelled_close_still_closes_the_socket_and_unwatches_it() -> None:
    async def scenario() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel = Channel(ours)
        await asyncio.sleep(0)
        number = ours.fileno()
        closing = asyncio.ensure_future(channel.close())
        await asyncio.sleep(0)  # close() has cancelled the reader and waits for it
        closing.cancel()
        try:
            await closing
        except asyncio.CancelledError:
            pass
        assert ours.fileno() == -1
        # Nothing of the loop still watches the old number: a new file there is free
        # to be watched, and is.
        _, write_end = reuse(number)
        woke = asyncio.Event()
        asyncio.get_running_loop().add_reader(number, woke.set)
        try:
            os.write(write_end, b"x")
            await asyncio.wait_for(woke.wait(), WAKE_BOUND_SEC)
        finally:
            asyncio.get_running_loop().remove_reader(number)
            os.close(number)
            os.close(write_end)
            theirs.close()

    asyncio.run(scenario())


def test_the_helpers_replies_are_json_the_host_reads_back_whatever_their_text() -> None:
    # The helper writes its replies without json (an import its start cannot afford);
    # an error names a trial's program and the system's message, whatever they hold.
    from wmo_trio.sandbox._helper import to_json

    for text in ["", "plain", 'a "quote" and a \\ backslash', "controls \x00\x1b\n\t\x7f",
                 "non-ASCII é ✓ 🙂", "lone surrogates \ud800 \udfff"]:
        message = {"id": 7, "error": f"cannot run {text}", "code": 126}
        assert json.loads(to_json(message)) == message
    assert json.loads(to_json({"op": "ready"})) == {"op": "ready"}


def test_the_helpers_program_starts_whether_its_python_compiled_it_or_not(tmp_path: Path) -> None:
    # The host's python3 compiles the helper ahead of its start; another version (here
    # this one, when it differs) compiles the source the program carries instead.
    program = helper_program()
    host_python = shutil.which("python3", path=DEFAULT_PATH)
    assert host_python is not None
    assert b"a2b_base64('')" not in program  # compiled by the host's python3
    (tmp_path / "helper").write_bytes(program)
    for python in sorted({host_python, sys.executable}):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours:
            process = subprocess.Popen([python, "-I", "-S", str(tmp_path / "helper")],
                                       stdin=theirs)
            theirs.close()
            ours.settimeout(WAKE_BOUND_SEC)
            assert json.loads(ours.recv(1 << 16)) == {"op": "ready"}, python
        assert process.wait(timeout=WAKE_BOUND_SEC) == 0
