"""The parts of `wmo_trio.cluster` that need no cluster: a directory as bounded data (a
trial's directory is hostile: no link followed, no path out of the target, sizes bounded,
no recursion on deep trees), the options and their one-line refusals, and what an agent's
arguments become on their way to another machine."""

from __future__ import annotations

import inspect
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import trio
from pydantic import ValidationError

from wmo_trio.cluster import ClusterError, ClusterOptions, open_cluster
from wmo_trio.cluster._tree import PackedEntry, PackedTree, TreeTooLarge, pack, unpack
from wmo_trio.sandbox._hostfs import remove_tree

ROOT = Path(__file__).resolve().parent.parent


def make_trial(top: Path) -> None:
    (top / "agent").mkdir(parents=True)
    (top / "agent" / "wmo-run.json").write_text('{"steps": []}')
    (top / "verifier").mkdir()
    (top / "verifier" / "reward.txt").write_text("1\n")
    (top / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(top / "run.sh", 0o4755)  # setuid: never kept
    os.symlink("../verifier/reward.txt", top / "agent" / "reward-link")  # stays inside
    os.symlink("/etc/passwd", top / "agent" / "escape")  # points out: never recreated
    os.mkfifo(top / "fifo")  # no content: left out


def test_a_packed_directory_unpacks_the_same_without_what_points_out(tmp_path: Path) -> None:
    make_trial(tmp_path / "trial")
    tree = pack(tmp_path / "trial")
    assert any("fifo" in why for why in tree.left_out)
    skipped = unpack(tree, tmp_path / "copy")
    assert skipped == ["agent/escape (a link pointing outside the tree)"]
    copy = tmp_path / "copy"
    assert (copy / "agent" / "wmo-run.json").read_text() == '{"steps": []}'
    assert os.readlink(copy / "agent" / "reward-link") == "../verifier/reward.txt"
    assert not (copy / "agent" / "escape").exists() and not (copy / "agent" / "escape").is_symlink()
    assert stat.S_IMODE(os.stat(copy / "run.sh").st_mode) == 0o755


@pytest.mark.parametrize("path", ["../out", "/etc/x", "a/../../out", "a//b", "./a", "", "a\0b"])
def test_an_entry_path_out_of_the_tree_is_refused(path: str) -> None:
    with pytest.raises(ValidationError):
        PackedEntry(path=path, kind="file", data=b"x")


def test_unpacking_never_writes_through_a_link_already_in_the_target(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(outside, target / "agent")  # planted before the unpack
    os.symlink(outside / "result.json", target / "result.json")
    tree = PackedTree(entries=[PackedEntry(path="agent/wmo-run.json", kind="file", data=b"trace"),
                               PackedEntry(path="result.json", kind="file", data=b"{}")])
    unpack(tree, target)
    assert list(outside.iterdir()) == []
    assert (target / "agent").is_dir() and not (target / "agent").is_symlink()
    assert (target / "result.json").read_bytes() == b"{}" and not (target / "result.json").is_symlink()


def test_sizes_are_bounded_on_both_sides(tmp_path: Path) -> None:
    (tmp_path / "trial").mkdir()
    (tmp_path / "trial" / "small").write_bytes(b"x" * 10)
    (tmp_path / "trial" / "large").write_bytes(b"x" * 100_000)
    tree = pack(tmp_path / "trial", limit=64 * 1024)
    assert [entry.path for entry in tree.entries] == ["small"]
    assert any(why.startswith("large (100,000 bytes") for why in tree.left_out)
    big = PackedTree(entries=[PackedEntry(path="big", kind="file", data=b"x" * 100_000)])
    with pytest.raises(TreeTooLarge):
        unpack(big, tmp_path / "copy", limit=64 * 1024)
    assert not (tmp_path / "copy").exists()  # refused before anything was written


@pytest.mark.slow  # thousands of directories made and removed: seconds on a busy disk
def test_a_tree_thousands_of_levels_deep_costs_no_recursion(tmp_path: Path) -> None:
    top = tmp_path / "deep"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(2100):  # deeper than PATH_MAX: reachable only as a chain of descriptors
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    limit = sys.getrecursionlimit()
    # Any recursion per level would fail at once: room for what runs now, not for 3,000 more.
    sys.setrecursionlimit(len(inspect.stack()) + 150)
    try:
        tree = pack(top)
        unpack(tree, tmp_path / "copy")
        remove_tree(top)
        remove_tree(tmp_path / "copy")
    finally:
        sys.setrecursionlimit(limit)
    assert any("longer than 2048 bytes" in why for why in tree.left_out)
    assert not top.exists() and not (tmp_path / "copy").exists()


@pytest.mark.parametrize(("workers", "address", "message"), [
    ("0", None, "workers must be a positive number or 'auto'"),
    ("two", None, "workers must be a positive number or 'auto'"),
    (None, " ", "ray_address is empty"),
])
def test_bad_options_are_one_line(workers: str | None, address: str | None, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        ClusterOptions.of(workers, address)


def test_without_ray_the_options_say_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from wmo_trio.cli._run import BadInput, cluster_options

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(BadInput, match=r"pip install 'wmo_trio\[ray\]'") as refused:
        cluster_options("2", None)
    assert "\n" not in str(refused.value)
    assert cluster_options(None, None) is None  # a job without the options needs no Ray


async def test_an_address_where_nothing_answers_is_one_line_at_once() -> None:
    with trio.fail_after(60), pytest.raises(ClusterError, match="cannot be reached") as refused:
        async with open_cluster(ClusterOptions(ray_address="127.0.0.1:1")):
            pass
    assert "\n" not in str(refused.value)


def test_an_agents_arguments_travel_as_data(tmp_path: Path) -> None:
    from wmo_trio._agent_arguments import portable_arguments
    from wmo_trio.harness import load_harness

    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"tool_calls": [{"name": "submit", "arguments": {"answer": "x"}}]}]))
    harness = ROOT / "examples" / "harness.json"
    sent = portable_arguments({"harness": str(harness), "episode_timeout_sec": 5,
                               "provider_config": {"kind": "scripted", "model": "s", "script": str(script)}})
    assert isinstance(sent["harness"], dict)
    assert json.loads(json.dumps(sent))["harness"] == sent["harness"]  # JSON all the way
    from wmo_trio.harness import harness_from

    assert harness_from(sent["harness"]).doc_hash == load_harness(harness).doc_hash
    assert sent["provider_config"]["script"] == json.loads(script.read_text())
    assert sent["episode_timeout_sec"] == 5
    with pytest.raises(ValueError, match="record names a file of this machine"):
        portable_arguments({"provider_config": {"kind": "scripted", "model": "s",
                                                "record": str(tmp_path / "calls.jsonl")}})


def test_a_hostile_trial_directory_comes_back_as_harbors_own_records(tmp_path: Path) -> None:
    """What a worker sends back is the trial's: its `config.json` a directory, its
    `result.json` a link out of the tree. The driver writes harbor's records over them, a
    result saying the trial ended without one of harbor's, and nothing outside."""
    from harbor.models.trial.config import TaskConfig, TrialConfig
    from harbor.models.trial.result import TrialResult

    from wmo_trio.cluster._fleet import _write_trial
    from wmo_trio.cluster._trial_worker import TrialReturn
    from wmo_trio.cluster._workers import WorkerInfo

    outside = tmp_path / "outside"
    outside.mkdir()
    config = TrialConfig(task=TaskConfig(path=ROOT / "examples" / "tasks" / "hello-file"),
                         trials_dir=tmp_path / "job")
    tree = PackedTree(entries=[
        PackedEntry(path="config.json", kind="dir"),
        PackedEntry(path="config.json/x", kind="file", data=b"x"),
        PackedEntry(path="result.json", kind="link", target=str(outside / "result.json")),
        PackedEntry(path="agent", kind="dir"),
        PackedEntry(path="agent/notes.txt", kind="file", data=b"kept")])
    returned = TrialReturn(files=tree, worker=WorkerInfo(index=0, node_id="n", host="h", pid=1))
    result, lock = _write_trial(tmp_path / "job" / config.trial_name, config, returned, None,
                                False, 1 << 20)
    trial = tmp_path / "job" / config.trial_name
    assert TrialConfig.model_validate_json((trial / "config.json").read_text()) == config
    written = TrialResult.model_validate_json((trial / "result.json").read_text())
    assert written.exception_info is not None and written.exception_info.exception_type == "TrialError"
    assert written == result and lock is None and (trial / "exception.txt").is_file()
    assert (trial / "agent" / "notes.txt").read_text() == "kept"
    assert list(outside.iterdir()) == []
