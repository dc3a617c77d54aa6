"""The system-call filter on its own, loaded into a plain process (no sandbox): it
follows the capabilities a sandbox keeps, as Docker's profile does."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wmo_trio.sandbox._profile import CAPABILITIES
from wmo_trio.sandbox._seccomp import filter_problem, filter_program

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or filter_problem(CAPABILITIES) is not None,
    reason="the probes use x86_64 system call numbers; the filter needs libseccomp",
)

PROBE = Path(__file__).with_name("syscall_probe.py")
# Loads the filter read from stdin, then runs the probes under it.
LOADER = textwrap.dedent("""
    import ctypes, os, sys
    program = sys.stdin.buffer.read()
    libc = ctypes.CDLL(None, use_errno=True)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    loaded = libc.prctl(22, 2, ctypes.byref(Program(len(program) // 8, program)), 0, 0)
    assert loaded == 0, os.strerror(ctypes.get_errno())
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
""")


def _under_filter(capabilities: tuple[str, ...], *names: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", LOADER, str(PROBE), *names],
                          input=filter_program(capabilities), capture_output=True,
                          timeout=60, check=True)
    probed: dict[str, str] = json.loads(done.stdout)
    return probed


def test_without_cap_sys_admin_clone3_is_enosys_and_namespaces_eperm() -> None:
    assert _under_filter(CAPABILITIES, "clone3", "unshare_user", "thread", "spawn") == {
        "clone3": "ENOSYS", "unshare_user": "EPERM", "thread": "ok", "spawn": "ok"}


def test_a_capability_kept_opens_its_group() -> None:
    # clone3 with no arguments: the kernel's own EINVAL once the filter lets it through.
    assert _under_filter((*CAPABILITIES, "CAP_SYS_ADMIN"), "clone3") == {"clone3": "EINVAL"}
    assert _under_filter(CAPABILITIES, "perf_event") == {"perf_event": "EPERM"}
    assert _under_filter((*CAPABILITIES, "CAP_PERFMON"), "perf_event") == {"perf_event": "ok"}


def test_the_program_is_compiled_once() -> None:
    assert filter_program(CAPABILITIES) is filter_program(tuple(reversed(CAPABILITIES)))


def test_a_system_call_through_another_abi_kills_the_caller() -> None:
    """i386's `int 0x80` reached socketcall(AF_VSOCK), whose family no filter can read,
    under the filter that gave 32-bit calls the same rules; x32 likewise. Docker allows
    both ABIs: here the first such call kills its process."""
    assert _under_filter(CAPABILITIES, "i386_socket_vsock", "x32_socket_vsock", "socket_vsock",
                         "socket_inet") == {"i386_socket_vsock": "SIGSYS",
                                            "x32_socket_vsock": "SIGSYS",
                                            "socket_vsock": "EPERM", "socket_inet": "ok"}
