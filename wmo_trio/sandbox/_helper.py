"""The process that runs inside a sandbox as its PID 1 and starts every command there.

It is started by bubblewrap with ``--as-pid-1`` and runs under the image's own Python
(``python3 -I -S``), so it imports only the standard library and keeps to Python 3.9
syntax. Its standard input is a ``SOCK_SEQPACKET`` socket to the host; each packet is
one message: a request is a ``marshal`` (format 4) dict, which only the host can write
(no process of the sandbox can reach this socket: see below), a reply is a JSON object,
which the host reads as anything the trial could have made. A ``spawn`` request carries
the command's three standard streams as file descriptors (``SCM_RIGHTS``), so output
never passes through this process.

It is on every trial's start path, so it imports little: ``os`` and modules the
interpreter holds built in, not ``json``, ``socket``, ``signal``, ``array`` or
``typing``, whose imports together cost more than the interpreter's own start (``pwd``
and ``grp`` only once a command runs as another user).

Requests (host to helper):

- ``{"op": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": "/x", "user": spec,
  "tag": "..."}`` with three descriptors: stdin, stdout, stderr.
- ``{"op": "kill", "id": N}``: end every process the command started.
- ``{"op": "end_others", "id": N}``: end every process of the sandbox but this one,
  however it detached, and reap them; replies ``{"id": N, "ended": 1}`` once none is
  left (a build's sandbox between two steps).
- ``{"op": "prepare", "id": N, "dirs": [...], "shared": [...]}``: make each directory
  (with its parents) as ``mkdir -p`` does, each ``shared`` one also world-writable, as
  Docker's start does for mount targets; replies ``{"id": N, "shell": "bash"}`` (or
  ``"sh"`` when the root has no ``/bin/bash``).

Replies: ``{"op": "ready"}`` once, then per command ``{"id": N, "pid": P}`` or
``{"id": N, "error": "...", "code": C}``, and ``{"id": N, "exit": status}``.

Commands start with an out-of-memory score 500 above this process's (as high as an
unprivileged process may raise its own, and no protection it could keep): when the
trial runs out of memory, the kernel ends a command rather than this process.

When the socket closes (the host stopped the trial, or died), the helper exits; the
kernel then kills every other process of the PID namespace. As PID 1 it cannot be
killed from inside the sandbox, whatever signal is sent (see :func:`ignore_signals`),
and it reaps every orphan. It is not dumpable, so no command, even as root, can trace
it, read its memory or environment or take its descriptors (the host's socket among
them): without ``CAP_SYS_PTRACE``, which no sandbox has, the kernel refuses all of these
on a process that is not dumpable.
"""

from __future__ import annotations

import _socket as socket
import marshal
import os
import select
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal
    from collections.abc import Callable
    from typing import Any
else:
    import _signal as signal

# Set in every command's environment: finds a command's daemons even after they left
# its session and were re-parented to this process.
TAG_VARIABLE = "WMO_TRIO_EXEC"
MAX_MESSAGE = 1 << 20
OOM_SCORE_ADJ_RAISE = 500
OOM_SCORE_ADJ_MAX = 1000
# Bounds a kill only for processes the kernel cannot end (stuck in uninterruptible I/O).
KILL_WAIT_SEC = 20.0
PR_SET_DUMPABLE = 4
FD_SIZE = 4  # a C int, as SCM_RIGHTS carries descriptors (``array`` costs an import)


class SpawnError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def resolve_user(spec: Any) -> tuple[int, int, list[int], str]:
    """uid, gid, supplementary groups and home for a harbor user spec (name, uid or
    ``name:group``), read from this sandbox's own /etc/passwd and /etc/group."""
    if spec is None or spec == 0 or spec == "root":
        return 0, 0, [0], "/root"
    import grp
    import pwd

    name, _, group = str(spec).partition(":")
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except KeyError:
        if not name.isdigit():
            raise SpawnError(
                f"unable to find user {spec}: no matching entries in passwd file", 126
            ) from None
        uid, gid, groups, home = int(name), 0, [], "/"
    else:
        uid, gid, home = entry.pw_uid, entry.pw_gid, entry.pw_dir or "/"
        groups = os.getgrouplist(entry.pw_name, gid)
    if group:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise SpawnError(
                f"unable to find group {group}: no matching entries in group file", 126
            ) from None
        groups = [gid]
    return uid, gid, groups, home


def spawn(request: dict[str, Any], fds: list[int]) -> int:
    """Fork and exec the command; its pid. Errors before exec (unknown user, missing
    directory or program) raise :class:`SpawnError`, as ``docker exec`` reports them."""
    uid, gid, groups, home = resolve_user(request.get("user"))
    env = dict(request["env"])
    env.setdefault("HOME", home)
    env[TAG_VARIABLE] = request["tag"]
    argv = request["argv"]
    report_read, report_write = os.pipe()
    try:
        pid = os.fork()
    except OSError as error:  # EAGAIN: the trial holds as many processes as it may
        os.close(report_read)
        os.close(report_write)
        raise SpawnError(f"cannot start {argv[0]}: {error.strerror} (the trial has as "
                         "many processes as its pids_limit allows)", 126) from None
    if pid == 0:  # the child: nothing here may return
        try:
            os.close(report_read)
            _raise_oom_score()
            os.setsid()
            for target, source in enumerate(fds):
                os.dup2(source, target)
            os.closerange(3, report_write)
            os.closerange(report_write + 1, 1 << 16)
            os.set_inheritable(report_write, False)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                os.chdir(request["cwd"])
            except OSError as error:
                raise SpawnError(f"cannot enter the working directory {request['cwd']}: "
                                 f"{error.strerror}", 126) from None
            try:
                os.execvpe(argv[0], argv, env)
            except OSError as error:
                code = 127 if isinstance(error, FileNotFoundError) else 126
                raise SpawnError(f"cannot run {argv[0]}: {error.strerror}", code) from None
        except SpawnError as error:
            os.write(report_write, marshal.dumps([str(error), error.code]))
        except BaseException as error:
            os.write(report_write, marshal.dumps([f"{type(error).__name__}: {error}", 126]))
        os._exit(126)
    os.close(report_write)
    with os.fdopen(report_read, "rb") as report:
        failure = report.read()
    if failure:
        os.waitpid(pid, 0)
        message, code = marshal.loads(failure)
        raise SpawnError(message, code)
    return pid


def _raise_oom_score() -> None:
    with open("/proc/self/oom_score_adj", "rb") as handle:
        current = int(handle.read())
    with open("/proc/self/oom_score_adj", "wb") as handle:
        handle.write(str(min(OOM_SCORE_ADJ_MAX, current + OOM_SCORE_ADJ_RAISE)).encode())


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    return text[text.rindex(b")") + 2 :].decode().split()


def processes_of(leader: int, tag: str) -> set[int]:
    """Live processes a command started: its session and group, their descendants, and
    every process still carrying its tag."""
    marker = f"{TAG_VARIABLE}={tag}".encode()
    parents: dict[int, int] = {}
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        fields = _stat_fields(int(name))
        if fields is None or fields[0] in ("Z", "X"):
            continue
        pid = int(name)
        parents[pid] = int(fields[1])
        if leader in (pid, int(fields[2]), int(fields[3])):
            found.add(pid)
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            continue
    pending = list(found)
    while pending:
        current = pending.pop()
        for pid, parent in parents.items():
            if parent == current and pid not in found:
                found.add(pid)
                pending.append(pid)
    return found


def kill_tree(leader: int, tag: str) -> None:
    """Stop every process of the command before killing any (a shell whose child died
    first could otherwise run the rest of its script), wait until each has died, and
    repeat while forks race. Returns once none is left alive, or after KILL_WAIT_SEC."""
    kill_all(lambda: processes_of(leader, tag))


def kill_all(find: Callable[[], set[int]]) -> int:
    """Kill what ``find`` returns as :func:`kill_tree` does, until it returns nothing;
    how many processes were killed."""
    deadline = time.monotonic() + KILL_WAIT_SEC
    killed = 0
    while time.monotonic() < deadline:
        victims = find()
        if not victims:
            return killed
        killed += len(victims)
        handles = _pidfds(victims)
        try:
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                _signal_each(handles, sig)
            if not _all_exited(handles, deadline):
                return killed
        finally:
            for handle in handles:
                os.close(handle)
    return killed


def _pidfds(pids: set[int]) -> list[int]:
    """A pidfd for each of ``pids`` still alive (a pid number could be reused; a pidfd
    names one process)."""
    handles = []
    for pid in pids:
        try:
            handles.append(os.pidfd_open(pid))
        except ProcessLookupError:
            pass
    return handles


def _signal_each(handles: list[int], sig: int) -> None:
    for handle in handles:
        try:
            signal.pidfd_send_signal(handle, sig)
        except ProcessLookupError:
            pass


def _all_exited(handles: list[int], deadline: float) -> bool:
    """Wait until every process of ``handles`` has exited; False once ``deadline`` passes
    first. A killed process stays alive until it is scheduled to run its exit, which
    takes a while on a busy machine; its pidfd turns readable once it has."""
    pending = handles
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select(pending, [], [], left)
        pending = [handle for handle in pending if handle not in ready]
    return True


def prepare(dirs: list[str], shared: list[str]) -> str:
    """Make the directories as ``mkdir -p`` would (failures are the commands' to
    meet), the ``shared`` ones mode 777; the shell commands run with."""
    for path in [*dirs, *shared]:
        try:
            os.makedirs(os.path.join("/", path), exist_ok=True)
            if path in shared:
                os.chmod(os.path.join("/", path), 0o777)
        except OSError:
            pass
    return "bash" if os.access("/bin/bash", os.X_OK) else "sh"


def to_json(message: dict[str, Any]) -> bytes:
    """A reply (string keys; integer and string values) as a JSON object."""
    fields = []
    for key, value in message.items():
        text = str(value) if isinstance(value, int) else json_string(value)
        fields.append(json_string(key) + ":" + text)
    return ("{" + ",".join(fields) + "}").encode()


def json_string(text: str) -> str:
    """``text`` as a JSON string; lone surrogates escaped, so it encodes as UTF-8."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char < " " or "\ud800" <= char <= "\udfff":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


class Helper:
    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.running: dict[int, tuple[int, str]] = {}  # pid -> (request id, tag)

    def send(self, message: dict[str, Any]) -> None:
        self.channel.sendall(to_json(message))

    def handle(self, request: dict[str, Any], fds: list[int]) -> None:
        try:
            if request["op"] == "spawn":
                try:
                    pid = spawn(request, fds)
                except SpawnError as error:
                    self.send({"id": request["id"], "error": str(error), "code": error.code})
                else:
                    self.running[pid] = (request["id"], request["tag"])
                    self.send({"id": request["id"], "pid": pid})
            elif request["op"] == "kill":
                for pid, (request_id, tag) in list(self.running.items()):
                    if request_id == request["id"]:
                        kill_tree(pid, tag)
            elif request["op"] == "end_others":
                self.end_others()
                self.send({"id": request["id"], "ended": 1})
            elif request["op"] == "prepare":
                self.send({"id": request["id"], "shell": prepare(request["dirs"],
                                                                 request["shared"])})
        finally:
            for fd in fds:
                os.close(fd)

    def end_others(self) -> None:
        """SIGKILL every other process of the sandbox and reap them all (the commands
        among them reported as :meth:`reap` does); returns once none is left, or after
        KILL_WAIT_SEC. As the PID namespace's PID 1, one ``kill(-1)`` reaches every
        process of it, wherever it went, and the kernel lets no fork escape that signal;
        every orphan comes to this process, so having no child means none is left."""
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # there is no other process
            return
        deadline = time.monotonic() + KILL_WAIT_SEC
        while time.monotonic() < deadline:
            self.reap()
            try:
                os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            time.sleep(0.001)

    def reap(self) -> None:
        """Reap every exited child, then report the commands among them: once the host
        hears that a killed command exited, none of its processes is left, zombies
        included."""
        exited = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.running:
                request_id, _ = self.running.pop(pid)
                exited.append({"id": request_id, "exit": os.waitstatus_to_exitcode(status)})
        for message in exited:
            self.send(message)

    def serve(self) -> None:
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.send({"op": "ready"})
        while True:
            self.reap()
            readable, _, _ = select.select([self.channel.fileno(), wake_read], [], [])
            if wake_read in readable:
                os.read(wake_read, 4096)
            if self.channel.fileno() in readable:
                data, ancillary, _, _ = self.channel.recvmsg(
                    MAX_MESSAGE, socket.CMSG_SPACE(16 * FD_SIZE)
                )
                if not data:
                    return
                fds = []
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        for start in range(0, len(payload) - FD_SIZE + 1, FD_SIZE):
                            fds.append(int.from_bytes(payload[start:start + FD_SIZE],
                                                      sys.byteorder, signed=True))
                self.handle(marshal.loads(data), fds)


def make_undumpable() -> None:
    """Refuse ptrace, /proc/1/mem, /proc/1/environ, /proc/1/fd and pidfd_getfd to every
    other process of the sandbox. A command's fork inherits the state until its exec,
    which makes it dumpable again.

    The kernel resets a process's dumpable flag to ``fs.suid_dumpable`` whenever its
    effective group changes: where that is 0 or 2 (both refuse all of the above to a
    process without ``CAP_SYS_PTRACE``), a change there and back does it without
    ``ctypes``, whose import costs as much as the rest of this start. Else, ``prctl``."""
    try:
        with open("/proc/sys/fs/suid_dumpable", "rb") as handle:
            reset_to = handle.read().strip()
    except OSError:
        reset_to = b""
    if reset_to in (b"0", b"2"):
        group = os.getegid()
        try:
            os.setegid(group + 1 if group < 65534 else group - 1)
            os.setegid(group)
        except OSError as error:
            sys.stderr.write(f"the sandbox's helper could not make itself undumpable: {error}\n")
            sys.exit(1)
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0
        reason = os.strerror(ctypes.get_errno()) if failed else ""
    except (ImportError, OSError, AttributeError) as error:
        failed, reason = True, str(error)
    if failed:
        sys.stderr.write(f"the sandbox's helper could not make itself undumpable: {reason}\n")
        sys.exit(1)


def ignore_signals() -> None:
    """Leave every signal a process of the sandbox can send at its default disposition,
    which for a PID 1 the kernel never delivers from inside its own PID namespace
    (SIGKILL and SIGSTOP included); only the host's can end it. Python's own handlers
    are the way in otherwise: its SIGINT one raised KeyboardInterrupt, and a ``kill
    -INT 1`` in a trial ended the helper with it. Two keep a disposition of their own,
    each harmless whoever sends it: SIGCHLD's handler only wakes the loop to reap, and
    SIGPIPE is ignored (a write to a closed socket raises instead; a command gets the
    default back, see :func:`spawn`)."""
    for number in signal.valid_signals():
        if number not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGPIPE):
            try:
                signal.signal(number, signal.SIG_DFL)
            except (OSError, ValueError):  # one the C library keeps for itself
                pass
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def main() -> None:
    make_undumpable()
    # Started with its program on a descriptor of its own; the commands must not inherit it.
    os.closerange(3, 1 << 16)
    ignore_signals()
    channel = socket.socket(fileno=0)
    try:
        Helper(channel).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    # No interpreter teardown: the kernel ends the sandbox's processes once this exits.
    os._exit(0)


if __name__ == "__main__":
    main()
