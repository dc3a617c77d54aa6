"""Environment tools (CONTRACT section 4): observations, the 10,000-character cap, and the
local-directory environment."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import running

from wmo_trio.episode import DirectoryShell
from wmo_trio.episode._tools import (
    MAX_OBSERVATION_CHARS,
    bounded_text,
    command_observation,
    failure_observation,
)
from wmo_trio.models import Action, ActionKind, Observation

CUT = re.compile(r"\n\[\.\.\. (\d+) characters cut from the middle of this output: narrow the "
                 r"command \(grep, head, tail\) or page through the output \(sed -n 'START,ENDp'\) "
                 r"\.\.\.\]\n")


def cycled(alphabet: str, length: int) -> str:
    """`alphabet` repeated to `length` characters (a character at a time in Python cost
    most of these tests' time)."""
    return (alphabet * (length // len(alphabet) + 1))[:length]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60_000), st.integers(0, 2000))
def test_the_cap_holds_every_marker_and_keeps_head_and_tail(length: int, code: int) -> None:
    text = cycled(string.ascii_lowercase, length)
    suffix = f"\n[exit {code}]" if code else ""
    result = bounded_text(text, suffix=suffix)
    assert len(result) <= MAX_OBSERVATION_CHARS
    assert result.endswith(suffix)
    if len(text) + len(suffix) <= MAX_OBSERVATION_CHARS:
        assert result == text + suffix
        return
    match = CUT.search(result)
    assert match is not None
    head, tail = result[: match.start()], result[match.end(): len(result) - len(suffix)]
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) + int(match.group(1)) + len(tail) == len(text)
    assert len(result) >= MAX_OBSERVATION_CHARS - 2  # the cap is used, not wasted


def test_a_failed_command_is_an_error_with_its_exit_code() -> None:
    observation = command_observation("out\n", "err\n", 3)
    assert observation.content == "out\nerr\n\n[exit 3]"
    assert observation.is_error and observation.metadata == {"return_code": 3}


def test_a_successful_command_has_no_exit_marker() -> None:
    observation = command_observation("a", "b", 0)
    assert observation == Observation(content="ab", metadata={"return_code": 0})


def test_an_over_long_failed_command_keeps_its_exit_marker_inside_the_cap() -> None:
    observation = command_observation("x" * 50_000, "", 1)
    assert len(observation.content) <= MAX_OBSERVATION_CHARS
    assert observation.content.endswith("\n[exit 1]")


def test_environment_failures_name_their_type() -> None:
    observation = failure_observation(TimeoutError("took too long"))
    assert observation.content == "environment command failed: TimeoutError: took too long"
    assert observation.is_error


def call(name: str, **arguments: Any) -> Action:
    return Action(kind=ActionKind.TOOL_CALL, name=name, arguments=arguments)


@pytest.fixture
def env(tmp_path: Path) -> DirectoryShell:
    return DirectoryShell(tmp_path, command_timeout_sec=5)


ODD_PATHS = ["with space.txt", "quote'and\"double.txt", "$(touch pwned).txt", "-leading-dash.txt",
             "new\nline.txt", "nested/dir/file.txt"]


@pytest.mark.parametrize("path", ODD_PATHS)
def test_write_then_read_round_trips_any_path(env: DirectoryShell, tmp_path: Path,
                                              path: str) -> None:
    content = "line one\n$(echo no) `echo no` 'q' \"dq\"\x00nul\n"
    written = env.execute(call("write_file", path=path, content=content))
    assert written.content == f"wrote {path}" and not written.is_error
    assert (tmp_path / path).read_bytes() == content.encode()
    read = env.execute(call("read_file", path=path))
    assert read.content == content and not read.is_error
    assert not (tmp_path / "pwned").exists()


def test_write_file_keeps_large_content_exact(env: DirectoryShell, tmp_path: Path) -> None:
    content = cycled("".join(map(chr, range(32, 127))), 5 * 1024 * 1024)
    env.execute(call("write_file", path="big.txt", content=content))
    assert (tmp_path / "big.txt").read_text() == content


def test_reading_a_missing_file_is_an_error_observation(env: DirectoryShell) -> None:
    observation = env.execute(call("read_file", path="nope"))
    assert observation.is_error and "[exit 1]" in observation.content


def test_binary_output_is_decoded_with_replacement(env: DirectoryShell) -> None:
    observation = env.execute(call("bash", command="printf 'ok\\377\\376end'"))
    assert observation.content == "ok\ufffd\ufffdend"


def test_stdout_comes_before_stderr(env: DirectoryShell) -> None:
    observation = env.execute(call("bash", command="echo err >&2; echo out"))
    assert observation.content == "out\nerr\n"


def test_a_command_timeout_kills_its_children(tmp_path: Path) -> None:
    env = DirectoryShell(tmp_path, command_timeout_sec=1)
    observation = env.execute(call("bash", command="(sleep 7.771; touch late) & sleep 7.772"))
    assert observation.is_error
    assert observation.content.startswith("environment command failed: TimeoutError")
    assert not running("sleep 7.771") and not running("sleep 7.772")


def test_unknown_and_non_environment_tools_are_not_available(env: DirectoryShell) -> None:
    assert env.execute(call("submit", answer="x")).content == "tool 'submit' not available"
    message = Action(kind=ActionKind.MESSAGE, content="hi")
    assert env.execute(message).content == "tool None not available"


def test_empty_paths_are_invalid(env: DirectoryShell) -> None:
    assert env.execute(call("read_file", path="")).content == (
        "invalid read_file arguments: 'path' must be a non-empty string"
    )


def test_command_timeouts_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"command_timeout_sec must be an integer in \[1, 240\]"):
        DirectoryShell(".", command_timeout_sec=241)
    with pytest.raises(ValueError, match="command_timeout_sec"):
        DirectoryShell(".", command_timeout_sec=True)
