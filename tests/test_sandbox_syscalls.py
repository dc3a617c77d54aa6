"""The kernel surface Docker's default seccomp profile closes is closed in every sandbox,
trials and image builds alike: the host's keys, user namespaces, the sandbox's PID 1
(the helper holding harbor's socket), io_uring and the rest; ordinary programs still
run. The probes (tests/syscall_probe.py) use x86_64 system call numbers."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor_jobs import run_oracle_job
from support.sandbox import (
    REPO,
    TASKS,
    make_environment,
    reward,
    run,
    run_harbor,
    running,
)
from support.sandbox import SANDBOX_MARKS as sandbox_marks

from wmo_trio.sandbox import LocalEnvironment

pytestmark = [
    *sandbox_marks,
    pytest.mark.skipif(platform.machine() != "x86_64",
                       reason="the probes use x86_64 system call numbers"),
]

PROBE = Path(__file__).with_name("syscall_probe.py")
# What Docker's default profile refuses, and the errno a program sees.
REFUSED = {
    "add_key": "EPERM", "read_host_key": "EPERM", "read_user_keyring": "EPERM",
    "list_proc_keys": "ENOENT",  # shown empty
    "unshare_user": "EPERM", "clone_user": "EPERM",
    "clone3": "ENOSYS",  # so that glibc falls back to clone, whose flags are checked
    "ptrace_pid1": "EPERM", "read_pid1_memory": "EPERM", "take_pid1_fd": "EPERM",
    "read_pid1_environ": "EACCES", "open_pid1_fd": "EACCES", "open_pid1_mem": "EACCES",
    "io_uring": "EPERM", "bpf_map": "EPERM", "perf_event": "EPERM", "kexec": "EPERM",
    "load_module": "EPERM", "mount_tmpfs": "EPERM", "socket_alg": "EPERM",
    "socket_vsock": "EPERM", "personality_exec": "EPERM",
    # Beyond Docker, which allows both ABIs: the first call through one kills its process.
    "i386_socket_vsock": "SIGSYS", "x32_socket_vsock": "SIGSYS",
}
ORDINARY = ("thread", "spawn", "ptrace_own_child", "socket_inet", "personality_query")

KEY_SPEC_USER_KEYRING = -4
KEYCTL_SEARCH, KEYCTL_INVALIDATE = 10, 21
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _keyctl(*args: int | bytes | None) -> int:
    words = [ctypes.c_long(arg) if isinstance(arg, int) else arg for arg in args]
    return int(_libc.syscall(ctypes.c_long(250), *words))


@pytest.fixture
def host_key() -> Iterator[tuple[int, str]]:
    """A key the host root adds to its user keyring: (serial, description)."""
    description = f"wmo-trio-host-{uuid.uuid4().hex}"
    payload = b"host-secret"
    serial = int(_libc.syscall(ctypes.c_long(248), b"user", description.encode(), payload,
                               ctypes.c_long(len(payload)), ctypes.c_long(KEY_SPEC_USER_KEYRING)))
    assert serial > 0, os.strerror(ctypes.get_errno())
    try:
        yield serial, description
    finally:
        _keyctl(KEYCTL_INVALIDATE, serial)


def _in_user_keyring(description: str) -> bool:
    return _keyctl(KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, b"user", description.encode(), 0) > 0


@pytest.fixture
def trial_key() -> Iterator[str]:
    """The description of the key a trial tries to add; removed from the host root's
    user keyring afterwards should it ever get there."""
    description = f"wmo-trio-trial-{uuid.uuid4().hex}"
    try:
        yield description
    finally:
        found = _keyctl(KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, b"user", description.encode(), 0)
        if found > 0:
            _keyctl(KEYCTL_INVALIDATE, found)


async def _probe(environment: LocalEnvironment, *names: str,
                 env: dict[str, str] | None = None) -> dict[str, str]:
    await environment.upload_file(PROBE, "/tmp/syscall_probe.py")
    result = await environment.exec("python3 /tmp/syscall_probe.py " + " ".join(names), env=env)
    assert result.return_code == 0, result.stderr
    assert result.stdout is not None
    probed: dict[str, str] = json.loads(result.stdout)
    return probed


def _expected(*names: str) -> dict[str, str]:
    return {name: REFUSED.get(name, "ok") for name in names}


def test_the_host_roots_keys_are_out_of_reach_and_no_key_can_be_added(
    tmp_path: Path, host_key: tuple[int, str], trial_key: str
) -> None:
    serial, description = host_key
    names = ("read_host_key", "read_user_keyring", "add_key", "list_proc_keys")

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            probed = await _probe(environment, *names,
                                  env={"HOST_KEY": str(serial), "TRIAL_KEY": trial_key})
            assert probed == _expected(*names)
            listed = await environment.exec("cat /proc/keys /proc/key-users")
            assert description not in (listed.stdout or "")

    run(scenario)
    assert not _in_user_keyring(trial_key)
    assert _in_user_keyring(description)  # the host's key itself is untouched


def test_no_user_namespace_can_be_made(tmp_path: Path) -> None:
    names = ("unshare_user", "clone_user", "clone3")

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert await _probe(environment, *names) == _expected(*names)
            unshared = await environment.exec("unshare -U -r id -u")
            assert unshared.return_code != 0
            assert "Operation not permitted" in (unshared.stderr or "")

    run(scenario)


def test_pid_1_cannot_be_traced_read_or_robbed_of_its_descriptors(tmp_path: Path) -> None:
    names = ("ptrace_pid1", "read_pid1_memory", "take_pid1_fd", "read_pid1_environ",
             "open_pid1_fd", "open_pid1_mem")

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert await _probe(environment, *names) == _expected(*names)
            alive = await environment.exec("echo still-serving")
            assert alive.stdout == "still-serving\n"

    run(scenario)


def test_no_signal_a_trial_sends_ends_pid_1(tmp_path: Path) -> None:
    """`kill -INT 1` once ended the helper through Python's own SIGINT handler; every
    signal, SIGKILL included, is now one the kernel does not deliver to it. Commands
    inherit no ignored signal from it (they inherited SIGXFSZ's)."""
    every_signal = "for s in $(seq 1 64); do kill -s $s 1 2>/dev/null; done; echo sent"

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert (await environment.exec(every_signal)).stdout == "sent\n"
            alive = await environment.exec("grep SigIgn /proc/self/status")
            assert (alive.stdout or "").startswith("SigIgn:")
            # Signals 32 and 33 are the C library's own (its sigaction refuses them): they
            # stay as harbor's process had them.
            assert int((alive.stdout or "").split()[1], 16) & ~(0b11 << 31) == 0

    run(scenario)


def _probed_as_expected(tmp_path: Path, *names: str) -> None:
    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert await _probe(environment, *names) == _expected(*names)

    run(scenario)


def test_io_uring_bpf_perf_modules_kexec_and_odd_sockets_are_refused(tmp_path: Path) -> None:
    _probed_as_expected(tmp_path, "io_uring", "bpf_map", "perf_event", "kexec", "load_module",
                        "mount_tmpfs", "socket_alg", "socket_vsock", "personality_exec")


def test_no_system_call_gets_through_the_32_bit_or_x32_abi(tmp_path: Path) -> None:
    """i386's `int 0x80` reached socketcall(SOCKET, AF_VSOCK) and got a socket: the
    socketcall multiplexer hides the family from the filter. Now such a call kills its
    caller; the probe makes it in a child."""
    _probed_as_expected(tmp_path, "i386_socket_vsock", "x32_socket_vsock", "socket_vsock",
                        "socket_inet")


def test_ordinary_programs_still_run(tmp_path: Path) -> None:
    """Threads and subprocesses (glibc falls back from clone3), a tracer of its own
    child, sockets, bash, a virtualenv's pip, apt and, where the host has it, gcc."""
    compile_and_run = ("printf 'int main(void){return 42;}' > /tmp/a.c && gcc -o /tmp/a /tmp/a.c"
                       " && /tmp/a; test $? = 42")
    commands = ["bash -c 'echo $((6 * 7))' | grep -qx 42",
                "python3 -m venv --without-pip /tmp/venv && /tmp/venv/bin/python -c 'import ssl'",
                "python3 -m pip --version", "apt-get --version",
                "apt-get install -s --no-download coreutils"]
    if shutil.which("gcc"):
        commands.append(compile_and_run)

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            assert await _probe(environment, *ORDINARY) == _expected(*ORDINARY)
            for command in commands:
                done = await environment.exec(command)
                assert done.return_code == 0, (command, done.stdout, done.stderr)

    run(scenario)


HOSTILE_TEST = textwrap.dedent("""\
    #!/bin/sh
    # Reward 1 when the build step and the agent met every refusal and ordinary work ran.
    mkdir -p /logs/verifier
    cat /build-probe.json /app/trial-probe.json
    python3 - <<'EOF' > /logs/verifier/reward.txt
    import json
    expected = json.loads({expected!r})
    probes = [json.load(open(path)) for path in ("/build-probe.json", "/app/trial-probe.json")]
    print(1 if all(probe == expected for probe in probes) else 0)
    EOF
""")


@pytest.mark.harbor
def test_a_hostile_task_meets_the_same_refusals_in_its_build_and_its_trial(
    tmp_path: Path, trial_key: str
) -> None:
    """In harbor's own job: a Dockerfile `RUN` step and the oracle's solve.sh run the
    probes; the verifier scores 1 only if each was refused (or ran) as under Docker."""
    task = tmp_path / "tasks" / "hostile-kernel"
    shutil.copytree(TASKS / "hello-file", task)
    shutil.copy(PROBE, task / "environment" / "syscall_probe.py")
    (task / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY syscall_probe.py /syscall_probe.py\n"
        f"RUN TRIAL_KEY={trial_key} python3 /syscall_probe.py > /build-probe.json\n"
    )
    (task / "solution" / "solve.sh").write_text(
        f"#!/bin/sh\nTRIAL_KEY={trial_key} python3 /syscall_probe.py > /app/trial-probe.json\n")
    expected = json.dumps(_expected(*REFUSED, *ORDINARY))
    (task / "tests" / "test.sh").write_text(HOSTILE_TEST.format(expected=expected))

    [result] = run_oracle_job(tmp_path / "jobs", task, cache_dir=str(tmp_path / "cache")).values()
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0
    assert not _in_user_keyring(trial_key)


@pytest.mark.harbor
def test_a_machine_without_libseccomp_fails_the_job_with_one_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pyseccomp raises this at import where no libseccomp shared library is installed.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pyseccomp.py").write_text('raise RuntimeError("Unable to find libseccomp")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow), str(REPO)]))

    completed = run_harbor(tmp_path / "jobs", "-p", str(TASKS / "hello-file"), "-a", "oracle")

    output = completed.stdout + completed.stderr
    assert completed.returncode != 0
    assert output.count("LocalEnvironment cannot run on this machine") == 1
    assert "libseccomp cannot be loaded (Unable to find libseccomp)" in output
