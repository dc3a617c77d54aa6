"""One bubblewrap profile (`wmo_trio.sandbox._profile`): what a trial's sandbox, its
network stack's and a candidate's runner's hold to is one command line's rules, so none
can differ between them; and what they hide of the host, seen from inside each."""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from processes import descendants
from test_local_environment import make_environment, run, running
from test_local_environment import pytestmark as trial_marks
from test_sandbox_backend import PROBLEM as RUNNER_PROBLEM
from test_sandbox_backend import answer_of, runners, traced

from wmo_trio.backends import RUNNER_PROFILE, SandboxSettings
from wmo_trio.sandbox import default_cache_dir
from wmo_trio.sandbox._profile import (
    MASKED,
    NETWORK_STACK_PROFILE,
    READ_ONLY,
    TRIAL_PROFILE,
    Profile,
    bwrap_argv,
    launch_argv,
    profile_problem,
)

__all__ = ["runners"]  # the fixture, used by the runner's tests below

PROFILES = {"trial": TRIAL_PROFILE, "runner": SandboxSettings().profile,
            "network stack": NETWORK_STACK_PROFILE}
needs_libseccomp = pytest.mark.skipif(profile_problem(TRIAL_PROFILE) is not None,
                                      reason="the command line needs its filter (libseccomp)")
RUNNER_MARKS = [pytest.mark.skipif(RUNNER_PROBLEM is not None,
                                   reason=f"no sandbox backend here: {RUNNER_PROBLEM}"),
                pytest.mark.slow]


def marked(marks: list[pytest.MarkDecorator]) -> Any:
    """Apply each of ``marks`` (another module's ``pytestmark``) to one test."""
    def apply(test: Any) -> Any:
        for mark in marks:
            test = mark(test)
        return test
    return apply


# Read inside a sandbox: what each masked path of /proc and /sys shows, whether a write
# gets through, the kernel's command line, and whether mountinfo (read by df, findmnt,
# psutil and the like) names a host path.
SHOWN = """
import json, os
shown = {}
for path in %s:
    try:
        shown[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as error:
        shown[path] = type(error).__name__
    try:
        with open(path, "w") as handle:
            handle.write("x")
        shown[path + " written"] = True
    except OSError:
        pass
mountinfo = open("/proc/self/mountinfo").read()
shown["mountinfo lines"] = len(mountinfo.splitlines())
shown["mountinfo names"] = sorted(set(fragment for fragment in %s if fragment in mountinfo))
print(json.dumps(shown))
"""


def _rules(argv: list[str]) -> tuple[list[list[str]], set[str]]:
    """The /proc and /sys mounts of a command line (each option with its operands), and
    the flags every sandbox must carry."""
    operands = {"--ro-bind-try": 2, "--ro-bind-data": 2, "--tmpfs": 1, "--remount-ro": 1}
    mounts, flags, index = [], set(), 0
    while index < len(argv):
        word = argv[index]
        count = operands.get(word, 0)
        targets = argv[index + 1:index + 1 + count]
        if count and targets[-1].startswith(("/proc", "/sys")):
            mounts.append([word, targets[-1]])
        if word in ("--die-with-parent", "--new-session", "--clearenv", "--unshare-pid"):
            flags.add(word)
        index += 1 + count
    return mounts, flags


@needs_libseccomp
def test_every_sandbox_hides_and_locks_the_same_paths_of_proc_and_sys() -> None:
    """Trials masked 2 paths of /proc, the runner 5: every profile now masks Docker's
    whole list and more, and keeps Docker's read-only paths read-only."""
    seen, devices = {}, {}
    for name, profile in PROFILES.items():
        with ExitStack() as descriptors:
            argv, _ = bwrap_argv(profile, descriptors, command=["true"], hostname="h")
            seen[name], devices[name] = _rules(argv), "--dev" in argv
    assert devices == {"trial": True, "runner": True, "network stack": False}
    assert seen["trial"] == seen["runner"] == seen["network stack"]
    mounts, flags = seen["trial"]
    assert flags == {"--die-with-parent", "--new-session", "--clearenv", "--unshare-pid"}
    hidden = {target for _, target in mounts}
    # bubblewrap's --proc makes the rest of READ_ONLY read-only itself.
    assert set(READ_ONLY) - hidden == {"/proc/bus", "/proc/irq"}
    assert {path for path in MASKED if path.startswith("/proc/") and os.path.exists(path)} <= hidden
    assert {"/proc/keys", "/proc/cmdline", "/proc/timer_list", "/proc/interrupts"} <= set(MASKED)


@needs_libseccomp
def test_each_descriptor_the_command_line_opens_closes_with_its_stack() -> None:
    with ExitStack() as descriptors:
        argv, inherited = bwrap_argv(TRIAL_PROFILE, descriptors, command=["true"], hostname="h")
        assert argv[argv.index("--seccomp") + 1] == str(inherited[0])
        for fd in inherited:
            os.fstat(fd)  # open while the stack is
    for fd in inherited:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_the_runner_only_tightens_a_trials_profile() -> None:
    def differences(profile: Profile) -> dict[str, Any]:
        return {name: value for name, value in vars(profile).items()
                if value != getattr(TRIAL_PROFILE, name)}

    assert set(differences(RUNNER_PROFILE)) == {
        "namespaces", "capabilities", "environment", "command_is_pid_1"}
    assert RUNNER_PROFILE.namespaces > TRIAL_PROFILE.namespaces
    assert RUNNER_PROFILE.capabilities == () and RUNNER_PROFILE.environment == ()


def test_every_launch_joins_its_cgroup_then_a_keyring_of_its_own() -> None:
    argv = launch_argv(["bwrap", "--x"], cgroup_procs=[Path("/cg/a b/cgroup.procs")],
                       before="cd /s")
    assert argv[:2] == ["sh", "-c"] and argv[3:] == ["sh", "bwrap", "--x"]
    assert argv[2] == "echo $$ > '/cg/a b/cgroup.procs' && cd /s && exec keyctl session - \"$@\""


# -- inside a trial ------------------------------------------------------------------------


@marked(trial_marks)
def test_a_trial_sees_no_masked_path_no_command_line_and_no_host_path_in_mountinfo(
        tmp_path: Path) -> None:
    """/proc/cmdline showed this VM's vsock ports, mountinfo the state and cache
    directories (the overlays' options); both stay readable, as under Docker."""
    fragments = [str(tmp_path), str(default_cache_dir()), "/tmp/", "/root/"]
    script = SHOWN % (json.dumps(MASKED), json.dumps(fragments))

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            done = await environment.exec(f"python3 -c '{script}'")
            assert done.return_code == 0, done.stderr
            shown = json.loads(done.stdout or "")
            assert (await environment.exec("df / && cat /proc/mounts")).return_code == 0
            _hidden_alike(shown)

    run(scenario)


def _hidden_alike(shown: dict[str, Any]) -> None:
    assert shown.pop("mountinfo names") == []
    assert shown.pop("mountinfo lines") > 3
    for path in MASKED:
        assert shown[path] in ("", [], "FileNotFoundError"), path
    # /sys is empty: a trial's root may hold files there, of its own.
    written = [key for key in shown if key.endswith(" written") and key.startswith("/proc/")]
    assert written == []


@marked(trial_marks)
def test_slirp4netns_runs_in_a_sandbox_of_its_own_and_the_trial_still_reaches_a_registry(
        tmp_path: Path) -> None:
    """It ran as root with every capability, no filter and the host's whole tree while
    parsing each packet a trial sends."""
    fetch = ("python3 -c 'import urllib.request as u; "
             "print(u.urlopen(\"https://pypi.org/simple/pip/\", timeout=60).status)'")

    async def scenario() -> None:
        async with running(make_environment(tmp_path)) as environment:
            sandbox = environment._sandbox
            assert sandbox is not None and sandbox.network is not None
            [slirp] = [pid for pid in descendants(sandbox.network.pid)
                       if Path(f"/proc/{pid}/comm").read_text().strip() == "slirp4netns"]
            status = dict(line.split(":\t", 1) for line in
                          Path(f"/proc/{slirp}/status").read_text().splitlines())
            assert status["Seccomp"].strip() == "2"  # its own filter, on top of ours
            assert status["NoNewPrivs"].strip() == "1"
            # Only what its own sandbox keeps: CAP_NET_BIND_SERVICE.
            assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == 1 << 10
            for namespace in ("mnt", "pid", "ipc"):
                assert os.readlink(f"/proc/{slirp}/ns/{namespace}") != os.readlink(
                    f"/proc/self/ns/{namespace}"), namespace
            root = Path(f"/proc/{slirp}/root")
            assert sorted(os.listdir(root)) == ["etc", "run"]
            assert set(os.listdir(root / "etc")) <= {"ld.so.cache", "resolv.conf"}
            assert os.listdir(root / "run") == []
            reached = await environment.exec(fetch)
            assert reached.stdout == "200\n", reached.stderr

    run(scenario)


# -- inside a candidate's runner -----------------------------------------------------------


@marked(RUNNER_MARKS)
def test_a_runner_hides_what_a_trial_hides(tmp_path: Path, runners: Any) -> None:
    # Its Python runtime is bound at its host paths, which it sees anyway.
    script = SHOWN % (json.dumps(MASKED), json.dumps([str(tmp_path), "/tmp/"]))
    program = "def run(kit):\n" + "".join(f"    {line}\n" for line in script.strip().splitlines())
    result, _ = traced(re.sub(r"print\((.*)\)\n$", r'kit.execute("submit", {"answer": \1})\n',
                              program), tmp_path)
    _hidden_alike(answer_of(result))


@marked(RUNNER_MARKS)
def test_a_runners_pid_1_outlives_every_signal_and_no_32_bit_call_gets_through(
        tmp_path: Path, runners: Any) -> None:
    probe = Path(__file__).with_name("syscall_probe.py").read_text()
    probe = probe.replace('if __name__ == "__main__":\n    main()\n', "")
    result, trace = traced(probe + """
import signal

def run(kit):
    for number in signal.valid_signals():
        try:
            os.kill(1, number)
        except OSError:
            pass
    kit.execute("submit", {"answer": json.dumps(
        {name: globals()[name]() or "ok" for name in ("i386_socket_vsock", "x32_socket_vsock")})})
""", tmp_path)
    assert answer_of(result) == {"i386_socket_vsock": "SIGSYS", "x32_socket_vsock": "SIGSYS"}
    assert trace["stop_reason"] == "submitted"
