"""The system-call filter every sandbox runs under: Docker's default seccomp profile
(moby's ``profiles/seccomp/default.json``) as data, resolved for the capabilities the
sandbox keeps and compiled by libseccomp (through ``pyseccomp``) into the BPF program
bubblewrap loads with ``--seccomp``.

What it refuses, as Docker does without ``CAP_SYS_ADMIN`` and ``CAP_SYS_PTRACE``: every
system call not listed (``EPERM``), among them the kernel keyring (``add_key``,
``keyctl``, ``request_key``: the keyring is not namespaced), ``io_uring``, ``mount``,
``unshare``, ``setns``, ``bpf``, ``perf_event_open``, modules and ``kexec``,
``pidfd_getfd``; ``clone`` with a namespace flag; ``clone3`` with ``ENOSYS``, so that
glibc falls back to ``clone`` whose flags the filter can read; sockets of the
``AF_ALG`` and ``AF_VSOCK`` families; ``personality`` other than Linux's own domains.
Beyond Docker's profile: only the machine's own system-call ABI. A call through another
(x86_64's i386 ``int 0x80`` or x32, arm64's 32-bit ARM) kills the process: each ABI has
its own numbers and argument forms (i386 reaches sockets through ``socketcall``, whose
family the filter cannot read), and nothing a task image runs here needs them.

The program is compiled once per process; each sandbox gets a copy in a memfd of its own
(bubblewrap reads its descriptor to the end, so two launches cannot share one).
"""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["filter_fd", "filter_problem", "filter_program"]

# Docker's unconditional allow-list, in its order.
ALLOWED = """
accept accept4 access adjtimex alarm bind brk cachestat capget capset chdir chmod chown
chown32 clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime
clock_gettime64 clock_nanosleep clock_nanosleep_time64 close close_range connect
copy_file_range creat dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old
epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2 execve execveat exit
exit_group faccessat faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir
fchmod fchmodat fchmodat2 fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr
flistxattr flock fork fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64
fsync ftruncate ftruncate64 futex futex_requeue futex_time64 futex_wait futex_waitv
futex_wake futimesat getcpu getcwd getdents getdents64 getegid getegid32 geteuid
geteuid32 getgid getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp
getpid getppid getpriority getrandom getresgid getresgid32 getresuid getresuid32
getrlimit get_robust_list getrusage getsid getsockname getsockopt get_thread_area gettid
gettimeofday getuid getuid32 getxattr getxattrat inotify_add_watch inotify_init
inotify_init1 inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents
io_pgetevents_time64 ioprio_get ioprio_set io_setup io_submit ipc kill landlock_add_rule
landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr link linkat
listen listmount listxattr listxattrat llistxattr _llseek lremovexattr lseek lsetxattr
lstat lstat64 madvise map_shadow_stack membarrier memfd_create memfd_secret mincore
mkdir mkdirat mknod mknodat mlock mlock2 mlockall mmap mmap2 mprotect mq_getsetattr
mq_notify mq_open mq_timedreceive mq_timedreceive_time64 mq_timedsend
mq_timedsend_time64 mq_unlink mremap mseal msgctl msgget msgrcv msgsnd msync munlock
munlockall munmap name_to_handle_at nanosleep newfstatat _newselect open openat openat2
pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll
ppoll ppoll_time64 prctl pread64 preadv preadv2 prlimit64 process_mrelease pselect6
pselect6_time64 pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv recv
recvfrom recvmmsg recvmmsg_time64 recvmsg remap_file_pages removexattr removexattrat
rename renameat renameat2 restart_syscall riscv_hwprobe rmdir rseq rt_sigaction
rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait
rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_getaffinity sched_getattr sched_getparam
sched_get_priority_max sched_get_priority_min sched_getscheduler sched_rr_get_interval
sched_rr_get_interval_time64 sched_setaffinity sched_setattr sched_setparam
sched_setscheduler sched_yield seccomp select semctl semget semop semtimedop
semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg sendto setfsgid setfsgid32
setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid setpriority
setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid setreuid32
setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address setuid
setuid32 setxattr setxattrat shmat shmctl shmdt shmget shutdown sigaltstack signalfd
signalfd4 sigprocmask sigreturn socketcall socketpair splice stat stat64 statfs statfs64
statmount statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill time
timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime
timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime
timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat
uretprobe utime utimensat utimensat_time64 utimes vfork vmsplice wait4 waitid waitpid
write writev
""".split()

# Allowed from Linux 4.8 on, which runs the filter again after a tracer changed a call
# (so tracing cannot get around it); the kernel's own ptrace checks still hold, and they
# refuse the sandbox's PID 1, which is not dumpable, to a process without CAP_SYS_PTRACE.
ALLOWED_SINCE_4_8 = ("process_vm_readv", "process_vm_writev", "ptrace")

# Allowed only to a holder of the capability.
BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "CAP_DAC_READ_SEARCH": ("open_by_handle_at",),
    "CAP_SYS_ADMIN": (
        "bpf", "clone", "clone3", "fanotify_init", "fsconfig", "fsmount", "fsopen", "fspick",
        "lookup_dcookie", "lsm_get_self_attr", "lsm_list_modules", "lsm_set_self_attr",
        "mount", "mount_setattr", "move_mount", "open_tree", "perf_event_open", "quotactl",
        "quotactl_fd", "setdomainname", "sethostname", "setns", "syslog", "umount",
        "umount2", "unshare",
    ),
    "CAP_SYS_BOOT": ("reboot",),
    "CAP_SYS_CHROOT": ("chroot",),
    "CAP_SYS_MODULE": ("delete_module", "init_module", "finit_module"),
    "CAP_SYS_PACCT": ("acct",),
    "CAP_SYS_PTRACE": ("kcmp", "pidfd_getfd", "process_madvise", "process_vm_readv",
                       "process_vm_writev", "ptrace"),
    "CAP_SYS_RAWIO": ("iopl", "ioperm"),
    "CAP_SYS_TIME": ("settimeofday", "stime", "clock_settime", "clock_settime64"),
    "CAP_SYS_TTY_CONFIG": ("vhangup",),
    "CAP_SYS_NICE": ("get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node"),
    "CAP_SYSLOG": ("syslog",),
    "CAP_BPF": ("bpf",),
    "CAP_PERFMON": ("perf_event_open",),
}


@dataclass(frozen=True)
class Machine:
    """What the profile says of one architecture (``uname -m``)."""

    own_calls: tuple[str, ...] = ()
    clone_flags_arg: int = 0


MACHINES = {
    "x86_64": Machine(("arch_prctl", "modify_ldt")),
    "aarch64": Machine(("arm_fadvise64_64", "arm_sync_file_range", "sync_file_range2",
                        "breakpoint", "cacheflush", "set_tls")),
    "ppc64le": Machine(("sync_file_range2", "swapcontext")),
    "s390x": Machine(("s390_pci_mmio_read", "s390_pci_mmio_write", "s390_runtime_instr"),
                     clone_flags_arg=1),
    "riscv64": Machine(("riscv_flush_icache",)),
}

# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID and NEWNET.
NAMESPACE_FLAGS = 0x7E020000
# Every family but AF_ALG (38) and AF_VSOCK (40).
SOCKET_FAMILIES_REFUSED = (38, 40)
# Linux, its 32-bit domain, each with UNAME26, and the query.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)


@functools.cache
def _compile(capabilities: frozenset[str], extra: frozenset[str]) -> bytes | str:
    """The filter's BPF program, or why this machine cannot build it."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, RuntimeError) as error:
        return f"libseccomp cannot be loaded ({error})"
    try:
        return _build(seccomp, capabilities, extra)
    except (OSError, ValueError) as error:
        return f"libseccomp could not build the sandbox's system-call filter ({error})"


def _build(seccomp: Any, capabilities: frozenset[str], extra: frozenset[str]) -> bytes:
    machine = MACHINES.get(os.uname().machine, Machine())
    rules = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))
    # The native ABI only (no add_arch): a call through another is killed, not refused,
    # since a 32-bit program would go on past every failed call.
    rules.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)

    def allow(names: Iterable[str], *conditions: Any) -> None:
        for name in names:
            number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
            # Unknown to this libseccomp (newer than it): refused, as by Docker there.
            if number != -1:
                rules.add_rule(seccomp.ALLOW, number, *conditions)

    allow(ALLOWED)
    allow(machine.own_calls)
    if _kernel_at_least(4, 8):
        allow(ALLOWED_SINCE_4_8)
    for capability in sorted(capabilities):
        allow(BY_CAPABILITY.get(capability, ()))
    allow(sorted(extra))
    if "CAP_SYS_ADMIN" not in capabilities:
        allow(["clone"], seccomp.Arg(machine.clone_flags_arg, seccomp.MASKED_EQ,
                                     NAMESPACE_FLAGS, 0))
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    low, high = SOCKET_FAMILIES_REFUSED
    allow(["socket"], seccomp.Arg(0, seccomp.LT, low))
    allow(["socket"], seccomp.Arg(0, seccomp.EQ, low + 1))
    allow(["socket"], seccomp.Arg(0, seccomp.GT, high))
    for personality in PERSONALITIES:
        allow(["personality"], seccomp.Arg(0, seccomp.EQ, personality))
    scratch = os.memfd_create("wmo-trio-seccomp-export", os.MFD_CLOEXEC)
    try:
        rules.export_bpf(_Descriptor(scratch))
        size = os.lseek(scratch, 0, os.SEEK_CUR)
        return os.pread(scratch, size, 0)
    finally:
        os.close(scratch)


@dataclass(frozen=True)
class _Descriptor:
    """What libseccomp's export takes: a file that names its descriptor."""

    fd: int

    def fileno(self) -> int:
        return self.fd


def _kernel_at_least(*version: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and tuple(int(part) for part in found.groups()) >= version


def filter_problem(capabilities: Sequence[str], extra: Sequence[str] = ()) -> str | None:
    """Why no sandbox keeping ``capabilities`` can get its filter here, or None."""
    compiled = _compile(frozenset(capabilities), frozenset(extra))
    return compiled if isinstance(compiled, str) else None


def filter_program(capabilities: Sequence[str], extra: Sequence[str] = ()) -> bytes:
    """The compiled filter for a sandbox keeping ``capabilities`` and allowed the system
    calls ``extra`` besides (see :func:`filter_problem` when this raises
    ``RuntimeError``)."""
    compiled = _compile(frozenset(capabilities), frozenset(extra))
    if isinstance(compiled, str):
        raise RuntimeError(compiled)
    return compiled


def filter_fd(capabilities: Sequence[str], extra: Sequence[str] = ()) -> int:
    """A new descriptor holding the compiled filter from its start, for ``--seccomp``;
    the caller closes it."""
    program = filter_program(capabilities, extra)
    fd = os.memfd_create("wmo-trio-seccomp", os.MFD_CLOEXEC)
    try:
        if os.write(fd, program) != len(program):
            raise OSError(errno.EIO, "a short write to a memfd")
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
