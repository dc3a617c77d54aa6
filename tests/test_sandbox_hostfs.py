"""The host's rule for paths a trial or a build wrote (``wmo_trio.sandbox._hostfs``), and
the copy engine built on it (``_transfer`` out, ``_upload`` in) run against a plain directory standing in
for a trial's root: links never followed, reads bounded, FIFOs never opened."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from wmo_trio.sandbox import _transfer, _upload
from wmo_trio.sandbox._errors import TransferIncomplete
from wmo_trio.sandbox._hostfs import (
    FileTooLarge,
    kernel_filesystem,
    link_stays_inside,
    make_dir_beneath,
    open_beneath,
    open_in_root,
    read_beneath,
    read_tail,
    remove_beneath,
    remove_tree,
    replace_beneath,
    safe_mode,
    tree_size,
)
from wmo_trio.sandbox._transfer import TransferLimits

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="openat2 is Linux's")


@pytest.mark.parametrize(("link", "target", "inside"), [
    ("a", "b", True),
    ("a", ".", True),
    ("d/a", "../b", True),
    ("d/e/a", "../../b/c", True),
    ("d/a", "../../b", False),  # above the tree
    ("a", "..", False),
    ("a", "/", False),
    ("a", "/etc/shadow", False),
    ("d/a", "x/../../b", False),  # `..` after a name: x may be a link to anywhere
    ("d/a", "x/../y", False),
    ("a", "", False),
])
def test_a_link_is_kept_only_when_it_cannot_leave_the_tree(link: str, target: str,
                                                           inside: bool) -> None:
    assert link_stays_inside(link, target) is inside


def test_lexically_inside_is_not_enough(tmp_path: Path) -> None:
    """`d -> .` and `x -> d/../secret` look inside (`d/..` cancels), yet x reaches the
    tree's parent: the rule refuses x."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tmp_path / "secret").write_text("host")
    (tree / "d").symlink_to(".")
    (tree / "x").symlink_to("d/../secret")
    assert (tree / "x").read_text() == "host"  # what harbor would read
    assert link_stays_inside("d", ".")
    assert not link_stays_inside("x", "d/../secret")


def _dir_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_open_beneath_refuses_links_parents_and_absolute_paths(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "link").symlink_to("real")
    (tmp_path / "real" / "up").symlink_to("/etc")
    fd = _dir_fd(tmp_path)
    try:
        os.close(open_beneath(fd, "real/file", os.O_RDONLY))
        for path, code in (("link/file", errno.ELOOP), ("real/up/passwd", errno.ELOOP),
                           ("../x", errno.EXDEV), ("/etc/passwd", errno.EXDEV),
                           ("link", errno.ELOOP)):
            with pytest.raises(OSError) as raised:
                open_beneath(fd, path, os.O_RDONLY)
            assert raised.value.errno == code, path
    finally:
        os.close(fd)


def test_open_in_root_follows_links_inside_the_root_only(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("trial's\n")
    (root / "abs").symlink_to("/etc/passwd")
    (root / "climb").symlink_to("../../../../etc/passwd")
    fd = _dir_fd(root)
    try:
        for path in ("/abs", "climb", "/../../etc/passwd"):
            opened = open_in_root(fd, path, os.O_RDONLY)
            with os.fdopen(opened) as handle:
                assert handle.read() == "trial's\n", path
    finally:
        os.close(fd)


def test_read_beneath_reads_a_regular_file_within_its_bound(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text("nameserver 10.0.2.3\n")
    assert read_beneath(tmp_path, "etc/resolv.conf", 100) == b"nameserver 10.0.2.3\n"
    with pytest.raises(FileTooLarge):
        read_beneath(tmp_path, "etc/resolv.conf", 5)
    assert read_beneath(tmp_path, "etc/missing", 100) is None


def test_read_beneath_never_follows_a_link_or_opens_a_fifo(tmp_path: Path) -> None:
    """A link to a host file (or to /proc/kmsg, whose read blocks), a link on the way,
    a FIFO nobody writes to (opening it would block): all read as nothing, at once."""
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "resolv.conf").symlink_to(secret)
    (upper / "etc" / "kmsg").symlink_to("/proc/kmsg")
    (upper / "linked").symlink_to(upper / "etc")
    os.mkfifo(upper / "etc" / "fifo")
    for relative in ("etc/resolv.conf", "etc/kmsg", "linked/fifo", "etc/fifo", "etc"):
        assert read_beneath(upper, relative, 1 << 20) is None, relative


def test_read_tail_keeps_the_end_and_refuses_a_link(tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    log.write_bytes(b"x" * 100_000 + b"\nbwrap: the real error\n")
    assert read_tail(log, 64).endswith(b"bwrap: the real error\n")
    assert len(read_tail(log, 64)) == 64
    (tmp_path / "link.log").symlink_to(log)
    assert read_tail(tmp_path / "link.log", 64) == b""
    os.mkfifo(tmp_path / "fifo.log")
    assert read_tail(tmp_path / "fifo.log", 64) == b""


def test_replace_beneath_replaces_a_link_rather_than_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "target"
    target.mkdir()
    (target / "reward.txt").symlink_to(victim)
    fd = _dir_fd(target)
    try:
        replace_beneath(fd, "reward.txt", lambda out: _write(out, b"1\n"), 0o644)
    finally:
        os.close(fd)
    assert victim.read_text() == "untouched"
    assert not (target / "reward.txt").is_symlink()
    assert (target / "reward.txt").read_text() == "1\n"


def _write(fd: int, data: bytes) -> None:
    os.write(fd, data)


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    def fail(_: int) -> None:
        raise OSError(errno.EIO, "disk gone")

    fd = _dir_fd(tmp_path)
    try:
        with pytest.raises(OSError):
            replace_beneath(fd, "file", fail, 0o644)
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []


def test_make_dir_beneath_replaces_a_link_by_a_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "sub").symlink_to(elsewhere)
    fd = _dir_fd(tmp_path / "tree")
    try:
        os.close(make_dir_beneath(fd, "sub", 0o755))
    finally:
        os.close(fd)
    assert (tmp_path / "tree" / "sub").is_dir() and not (tmp_path / "tree" / "sub").is_symlink()
    assert elsewhere.is_dir()


def test_remove_beneath_removes_the_link_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (tmp_path / "upper" / "etc").mkdir(parents=True)
    (tmp_path / "upper" / "etc" / "resolv.conf").symlink_to(victim)
    remove_beneath(tmp_path / "upper", "etc/resolv.conf")
    assert victim.read_text() == "kept"
    assert not os.path.lexists(tmp_path / "upper" / "etc" / "resolv.conf")


@pytest.fixture
def memory_path(tmp_path: Path) -> Iterator[Path]:
    """A scratch directory in memory where there is one (/dev/shm): a tree of thousands
    of directories costs seconds of a busy machine's disk, milliseconds there."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="wmo-trio-test-") as scratch:
        yield Path(scratch)


def test_remove_tree_goes_any_depth_and_never_through_a_link(memory_path: Path) -> None:
    """3,000 levels (Python's own rmtree and walk recurse once per level: RecursionError),
    with links out of the tree, a FIFO and directories mode 000 (as overlayfs leaves its
    work directory) on the way: the tree goes, what its links name stays."""
    outside = memory_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host")
    tree = memory_path / "tree"
    tree.mkdir()
    directory = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(3000):
            if level % 100 == 0:
                os.symlink(str(outside), "out", dir_fd=directory)
                os.symlink(str(outside / "keep"), "file", dir_fd=directory)
                with open(os.open("data", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=directory),
                          "wb") as data:
                    data.write(b"x" * 10)
            os.mkdir("d", dir_fd=directory)
            if level == 1500:
                os.mkfifo("fifo", dir_fd=directory)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=directory)
            if level % 500 == 0:
                os.chmod(f"/proc/self/fd/{directory}", 0)
            os.close(directory)
            directory = child
    finally:
        os.close(directory)

    assert tree_size(tree) >= 30 * 10
    remove_tree(tree)

    assert not tree.exists()
    assert sorted(path.name for path in outside.iterdir()) == ["keep"]
    assert (outside / "keep").read_text() == "host"


def test_remove_tree_removes_a_link_and_leaves_its_target(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    remove_tree(tmp_path / "link")
    remove_tree(tmp_path / "missing")  # nothing there: nothing to do
    assert not os.path.lexists(tmp_path / "link")
    assert (tmp_path / "target" / "keep").read_text() == "x"


def test_the_kernels_own_filesystems_are_named(tmp_path: Path) -> None:
    for path, name in (("/proc", "proc"), ("/proc/self", "proc"), (tmp_path, None)):
        fd = os.open(path, os.O_PATH)
        try:
            assert kernel_filesystem(fd) == name, path
        finally:
            os.close(fd)


def test_safe_mode_drops_setuid_setgid_sticky_and_foreign_write() -> None:
    assert safe_mode(0o4777) == 0o755
    assert safe_mode(0o2755) == 0o755
    assert safe_mode(0o000) == 0o600
    assert safe_mode(0o1777, directory=True) == 0o755


# ---------------------------------------------------------------------- the copy engine


def _root_of(path: Path) -> Callable[[], int]:
    return lambda: os.open(path, os.O_PATH | os.O_DIRECTORY)


def _download(root: Path, source: str, target: Path,
              limits: TransferLimits | None = None) -> _transfer.Outcome:
    return asyncio.run(_transfer.download_dir(_root_of(root), source, target,
                                              limits or TransferLimits()))


def test_links_out_of_the_tree_are_dropped_and_named_and_nothing_else_is_lost(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    agent = root / "logs" / "agent"
    (agent / "sub").mkdir(parents=True)
    (agent / "a-first.txt").write_text("first")
    (agent / "x").symlink_to("/")
    (agent / "reward.txt").symlink_to("/etc/shadow")
    (agent / "sub" / "up").symlink_to("../../../..")
    (agent / "sub" / "sibling").symlink_to("../a-first.txt")
    (agent / "z-last.txt").write_text("last")
    (agent / "sub" / "deep.txt").write_text("deep")
    target = tmp_path / "out"

    outcome = _download(root, "/logs/agent", target)

    outcome.check()  # nothing left out
    assert (target / "a-first.txt").read_text() == "first"
    assert (target / "z-last.txt").read_text() == "last"
    assert (target / "sub" / "deep.txt").read_text() == "deep"
    assert os.readlink(target / "sub" / "sibling") == "../a-first.txt"
    for dropped in ("x", "reward.txt", "sub/up"):
        assert not os.path.lexists(target / dropped), dropped
    assert sorted(path for path, _ in outcome.dropped_links) == ["reward.txt", "sub/up", "x"]
    warning = outcome.warning()
    assert warning is not None and "reward.txt -> /etc/shadow" in warning


def test_the_source_path_is_resolved_inside_the_trials_root(tmp_path: Path) -> None:
    """/logs/agent itself a link to / : the trial's root is copied, never the host's."""
    root = tmp_path / "root"
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "agent").symlink_to("/")
    (root / "only-in-the-trial").write_text("trial")
    target = tmp_path / "out"

    _download(root, "/logs/agent", target).check()

    assert sorted(path.name for path in target.iterdir()) == ["logs", "only-in-the-trial"]


def test_a_link_already_on_the_host_is_replaced_not_written_through(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "logs" / "verifier").mkdir(parents=True)
    (root / "logs" / "verifier" / "reward.txt").write_text("1\n")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "out"
    target.mkdir()
    (target / "reward.txt").symlink_to(victim)

    _download(root, "/logs/verifier", target).check()

    assert victim.read_text() == "untouched"
    assert (target / "reward.txt").read_text() == "1\n"


def test_fifos_sockets_and_setuid_bits_do_not_come_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "logs").mkdir(parents=True)
    os.mkfifo(root / "logs" / "pipe")  # nobody writes: opening it would block
    tool = root / "logs" / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o4755)
    target = tmp_path / "out"

    _download(root, "/logs", target).check()

    assert sorted(path.name for path in target.iterdir()) == ["tool"]
    assert stat.S_IMODE((target / "tool").stat().st_mode) == 0o755


def test_long_nested_names_stay_beneath_the_target(tmp_path: Path) -> None:
    """The shape of the tarfile PATH_MAX bypass: long names nested deep behind short
    links, then a link through them. Nothing is written outside the target, paths past
    the bound are left out by name, the rest arrives."""
    root = tmp_path / "root"
    logs = root / "logs"
    logs.mkdir(parents=True)
    (logs / "ok.txt").write_text("ok")
    name = "d" * 247
    directory_fd = os.open(logs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for step in range(16):  # about 4 KB of path, built through descriptors
            os.mkdir(name, dir_fd=directory_fd)
            os.symlink(name, f"s{step}", dir_fd=directory_fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=directory_fd)
            os.close(directory_fd)
            directory_fd = child
        os.symlink("../" * 17 + "escaped", "escape", dir_fd=directory_fd)
    finally:
        os.close(directory_fd)
    target = tmp_path / "jail" / "out"

    outcome = _download(root, "/logs", target)

    assert (target / "ok.txt").read_text() == "ok"
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "jail" / "escaped").exists()
    assert any("longer than" in why for _, why in outcome.left_out)
    with pytest.raises(TransferIncomplete, match="longer than 2048 bytes"):
        outcome.check()


def test_a_tree_deeper_than_harbor_can_walk_is_cut_at_256_levels_by_name(
        memory_path: Path) -> None:
    """Harbor's own tools walk a trial's directory recursively (`harbor jobs resume`
    removes it with shutil.rmtree): what lies more than 256 directories down stays in the
    trial, named, and the rest arrives."""
    logs = memory_path / "root" / "logs"
    logs.mkdir(parents=True)
    directory_fd = os.open(logs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(300):
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=directory_fd))
            os.mkdir("d", dir_fd=directory_fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=directory_fd)
            os.close(directory_fd)
            directory_fd = child
    finally:
        os.close(directory_fd)
    target = memory_path / "out"

    outcome = _download(memory_path / "root", "/logs", target)

    assert outcome.files == 257  # the file of each level down to the 256th directory
    assert [path for path, _ in outcome.left_out] == [("d/" * 257)[:80] + "..."]
    deepest = target.joinpath(*["d"] * 256)
    assert (deepest / "f").is_file() and not (deepest / "d").exists()
    with pytest.raises(TransferIncomplete, match="more than 256 directories deep"):
        outcome.check()


def test_a_sparse_file_over_the_cap_is_left_out_by_name_and_the_rest_arrives(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    (root / "logs").mkdir(parents=True)
    with (root / "logs" / "huge.bin").open("wb") as handle:
        handle.truncate(2 << 30)  # a 2 GiB hole: nothing on disk
    (root / "logs" / "small.txt").write_text("small")
    target = tmp_path / "out"

    outcome = _download(root, "/logs", target, TransferLimits(max_bytes=1 << 20))

    assert (target / "small.txt").read_text() == "small"
    assert not (target / "huge.bin").exists()
    assert list(target.glob(".*.part")) == []
    with pytest.raises(TransferIncomplete) as raised:
        outcome.check()
    message = str(raised.value)
    assert "huge.bin" in message and "2,147,483,648 bytes" in message
    assert "--ek download_limit_mb=N" in message and "1 MB" in message


def test_what_fits_the_cap_is_copied_and_the_rest_is_named(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "logs").mkdir(parents=True)
    for index in range(8):
        (root / "logs" / f"f{index}").write_bytes(b"x" * 4096)
    target = tmp_path / "out"

    outcome = _download(root, "/logs", target, TransferLimits(max_bytes=5 * 4096))

    assert len(list(target.iterdir())) == 5
    assert outcome.stopped == "cap"
    with pytest.raises(TransferIncomplete, match="download cap was full"):
        outcome.check()


def test_a_download_past_its_time_limit_ends_with_the_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "file").write_text("x")
    target = tmp_path / "out"

    outcome = _download(root, "/logs", target, TransferLimits(timeout_sec=1e-9))

    with pytest.raises(TransferIncomplete, match=r"time limit of 1e-09 s.*download_timeout_sec"):
        outcome.check()
    with pytest.raises(TransferIncomplete, match="time limit"):
        asyncio.run(_transfer.download_file(_root_of(root), "/logs/file", target / "copy",
                                            TransferLimits(timeout_sec=1e-9)))
    assert not (target / "copy").exists()


def test_nothing_is_read_from_the_kernels_filesystems(tmp_path: Path) -> None:
    """Read with the host's credentials, /proc says more than a trial may know: a
    directory or a file there is named as left out, never read."""
    outcome = _download(Path("/"), "/proc/self", tmp_path / "out")
    assert outcome.files == 0 and list((tmp_path / "out").iterdir()) == []
    with pytest.raises(TransferIncomplete, match="kernel's proc filesystem"):
        outcome.check()
    with pytest.raises(PermissionError, match="kernel's proc filesystem"):
        asyncio.run(_transfer.download_file(_root_of(Path("/")), "/proc/self/status",
                                            tmp_path / "status", TransferLimits()))
    assert not (tmp_path / "status").exists()


def test_download_file_keeps_harbors_contract(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "trajectory.json").write_text("{}")
    (root / "logs" / "link.json").symlink_to("/logs/trajectory.json")
    os.mkfifo(root / "logs" / "pipe")
    target = tmp_path / "out" / "new" / "dirs"

    async def scenario() -> None:
        opener = _root_of(root)
        limits = TransferLimits()
        await _transfer.download_file(opener, "/logs/link.json", target / "t.json", limits)
        for missing in ("/logs/none", "/logs/pipe", "/logs"):
            with pytest.raises(FileNotFoundError):
                await _transfer.download_file(opener, missing, target / "x", limits)

    asyncio.run(scenario())
    assert (target / "t.json").read_text() == "{}"
    assert not (target / "x").exists()


def test_upload_writes_beneath_the_trials_root_through_its_own_links(tmp_path: Path) -> None:
    """The trial's /tests is a link to / : the upload lands in the trial's root, never
    the host's; a link already at a file's place is replaced."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "tests").symlink_to("/")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (root / "test.sh").symlink_to(victim)
    source = tmp_path / "source"
    source.mkdir()
    (source / "test.sh").write_text("#!/bin/sh\n")
    (source / "test.sh").chmod(0o755)

    asyncio.run(_upload.upload_dir(_root_of(root), source, "/tests"))

    assert victim.read_text() == "untouched"
    assert (root / "test.sh").read_text() == "#!/bin/sh\n"
    assert stat.S_IMODE((root / "test.sh").stat().st_mode) == 0o755
