"""Run inside a sandbox (its own python3, standard library only): tries what Docker's
default seccomp profile refuses, and what ordinary programs need, and prints one JSON
object: probe name -> "ok" or the errno's name. x86_64 system call numbers.

The probes named on the command line run (all of them without arguments); ``HOST_KEY``
is the serial of a key the host added, ``TRIAL_KEY`` the description of the key the
trial tries to add to the user keyring.
"""

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import threading
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEY_SPEC_USER_KEYRING = -4
KEYCTL_READ = 11
CLONE_NEWUSER = 0x10000000
PTRACE_SEIZE = 0x4206


def call(number, *args):
    words = [ctypes.c_long(arg) if isinstance(arg, int) else arg for arg in args]
    result = libc.syscall(ctypes.c_long(number), *words)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def add_key():
    description = os.environ.get("TRIAL_KEY", "wmo-trio-trial-key").encode()
    call(248, b"user", description, b"from-the-trial", 14, KEY_SPEC_USER_KEYRING)


def read_host_key():
    serial = int(os.environ.get("HOST_KEY", str(KEY_SPEC_USER_KEYRING)))
    buffer = ctypes.create_string_buffer(256)
    call(250, KEYCTL_READ, serial, buffer, 256)


def read_user_keyring():
    buffer = ctypes.create_string_buffer(256)
    call(250, KEYCTL_READ, KEY_SPEC_USER_KEYRING, buffer, 256)


def list_proc_keys():
    with open("/proc/keys") as handle:
        if not handle.read().strip():
            raise OSError(errno.ENOENT, "empty")


def unshare_user():
    call(272, CLONE_NEWUSER)


def clone_user():
    child = call(56, CLONE_NEWUSER | 17, 0, 0, 0, 0)  # 17: SIGCHLD
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)


def clone3():
    call(435, 0, 0)


def ptrace_pid1():
    call(101, PTRACE_SEIZE, 1, 0, 0)


def read_pid1_memory():
    local = ctypes.create_string_buffer(8)
    iovec = (ctypes.c_void_p * 2)(ctypes.addressof(local), 8)
    call(310, 1, iovec, 1, iovec, 1, 0)  # process_vm_readv


def take_pid1_fd():
    pidfd = call(434, 1, 0)  # pidfd_open
    try:
        os.close(call(438, pidfd, 0, 0))  # pidfd_getfd: its stdin, the host's socket
    finally:
        os.close(pidfd)


def read_pid1_environ():
    with open("/proc/1/environ", "rb") as handle:
        handle.read()


def open_pid1_fd():
    os.close(os.open("/proc/1/fd/0", os.O_RDONLY))


def open_pid1_mem():
    os.close(os.open("/proc/1/mem", os.O_RDONLY))


def io_uring():
    os.close(call(425, 4, ctypes.create_string_buffer(120)))


def bpf_map():
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(attr, (ctypes.c_uint32 * 4)(2, 4, 4, 1), 16)  # an array of one int
    os.close(call(321, 0, attr, 128))


def perf_event():
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(attr, (ctypes.c_uint32 * 2)(1, 128), 8)  # software, cpu-clock
    ctypes.memmove(ctypes.byref(attr, 40), (ctypes.c_uint64 * 1)(0b1100000), 8)  # no kernel
    os.close(call(298, attr, 0, -1, -1, 0))


def kexec():
    call(246, 0, 0, 0, 0)


def load_module():
    call(313, -1, b"", 0)


def mount_tmpfs():
    call(165, b"none", b"/mnt", b"tmpfs", 0, None)


def socket_alg():
    os.close(call(41, 38, 5, 0))


def socket_vsock():
    os.close(call(41, 40, 1, 0))


def personality_exec():
    call(135, 0x0400000)  # READ_IMPLIES_EXEC


def in_child(probe):
    """Run ``probe`` in a child: a filter that kills the caller kills only the child.
    "ok", the errno's name, or the signal that killed it."""
    child = os.fork()
    if child == 0:
        try:
            probe()
        except OSError as error:
            os._exit(error.errno)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        return "SIG" + {31: "SYS", 9: "KILL", 11: "SEGV"}.get(os.WTERMSIG(status), "?")
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))


def _i386_socketcall_vsock():
    # socketcall(SYS_SOCKET, [AF_VSOCK, SOCK_STREAM, 0]) through the i386 ABI (int 0x80),
    # from code and arguments below 4 GiB, where a 32-bit pointer reaches them.
    page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40,  # MAP_32BIT
                     prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    arguments = address + 64
    code = (b"\x53" b"\xb8\x66\x00\x00\x00" b"\xbb\x01\x00\x00\x00"  # push rbx; eax=102; ebx=1
            + b"\xb9" + arguments.to_bytes(4, "little")  # ecx = arguments
            + b"\xcd\x80" b"\x5b" b"\xc3")  # int 0x80; pop rbx; ret
    page[:len(code)] = code
    page[64:76] = (40).to_bytes(4, "little") + (1).to_bytes(4, "little") + bytes(4)
    result = ctypes.CFUNCTYPE(ctypes.c_int)(address)()
    if result < 0:
        raise OSError(-result, os.strerror(-result))
    os.close(result)


def i386_socket_vsock():
    return in_child(_i386_socketcall_vsock)


def x32_socket_vsock():
    return in_child(lambda: os.close(call(0x40000000 | 41, 40, 1, 0)))


# What ordinary programs do, which must keep working.
def thread():
    done = []
    worker = threading.Thread(target=done.append, args=[1])
    worker.start()
    worker.join()
    assert done == [1]


def spawn():
    subprocess.run(["true"], check=True)


def ptrace_own_child():
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        call(101, PTRACE_SEIZE, child, 0, 0)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def socket_inet():
    os.close(call(41, 2, 1, 0))


def personality_query():
    call(135, 0xFFFFFFFF)


PROBES = {name: function for name, function in globals().items()
          if callable(function) and getattr(function, "__module__", None) == "__main__"
          and not name.startswith("_") and name not in ("call", "in_child")}


def main():
    names = sys.argv[1:] or sorted(PROBES)
    results = {}
    for name in names:
        try:
            results[name] = PROBES[name]() or "ok"
        except OSError as error:
            results[name] = errno.errorcode.get(error.errno, str(error.errno))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
