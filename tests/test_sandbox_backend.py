"""The sandbox backend (`harness_backend='sandbox'`): an episode's program in a bubblewrap
sandbox of its own, its calls answered on the host.

Hostile `code:runtime` programs run through the real backend (and the research API, which
writes each one's trace), each with an assertion on the host that it was refused or
contained, and that the episode still ended with its trace. Every test checks that the
sandboxes it started are gone: their processes reaped, their cgroups removed.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from doubles import Spy
from test_code_runtime import AGENT, INSTRUCTION, SOLVE, code_doc

import wmo_trio
from wmo_trio.backends import (
    SandboxRuntime,
    SandboxSettings,
    build_runtime,
    check_backend,
    resolve_backend,
    sandbox_problem,
)
from wmo_trio.backends._frames import MAX_FRAME_BYTES
from wmo_trio.backends._sandbox_runner import python_runtime
from wmo_trio.episode import LocalDirEnvironment
from wmo_trio.models import RunResult, StopReason
from wmo_trio.research import LocalProcessEnvironment

PROBLEM = sandbox_problem()
pytestmark = [
    pytest.mark.skipif(PROBLEM is not None, reason=f"no sandbox backend here: {PROBLEM}"),
    pytest.mark.slow,  # real sandboxes
]
# No pool: each episode's runner is its own, so a test sees everything it started.
COLD = SandboxSettings(pool_size=0)


class Runners:
    """Every runner the runtimes of a test start, to check they are gone afterwards."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def gone(self) -> None:
        for runner in self.started:
            assert runner.process.returncode is not None, "a runner was not reaped"
            for directory in runner.cgroup.directories if runner.cgroup else ():
                assert not directory.exists(), f"cgroup {directory} left behind"


@pytest.fixture
def runners(monkeypatch: pytest.MonkeyPatch) -> Iterator[Runners]:
    """The runners the test's episodes ran on (from the pool or started for them)."""
    seen = Runners()
    original = SandboxRuntime._start

    def start(runtime: SandboxRuntime) -> Any:
        runner = original(runtime)
        seen.started.append(runner)
        return runner

    monkeypatch.setattr(SandboxRuntime, "_start", start)
    yield seen
    seen.gone()


class Scripted(Spy):
    """A `Spy` the research API can take as a caller's own provider."""

    def prepare(self) -> None:
        pass


def sandboxed(source: str, workdir: Path, script: list[dict[str, Any]] | None = None, *,
              settings: SandboxSettings = COLD, **kwargs: Any) -> tuple[RunResult, SandboxRuntime]:
    provider = Spy(script or [{"text": "unused"}])
    with SandboxRuntime(code_doc(source), provider, settings=settings, **kwargs) as runtime:
        return runtime.run("task", INSTRUCTION, LocalDirEnvironment(workdir, command_timeout_sec=30)), runtime


def traced(source: str, workdir: Path, script: list[dict[str, Any]] | None = None,
           **kwargs: Any) -> tuple[RunResult, dict[str, Any]]:
    """The episode through the research API on `sandbox`, and the trace it wrote."""
    trace = workdir / "trace.json"

    async def main() -> RunResult:
        async with wmo_trio.open_episode_pool(limit=2) as pool:
            return await pool.run(code_doc(source), Scripted(script or [{"text": "unused"}]), INSTRUCTION,
                                  LocalProcessEnvironment(workdir), trace_path=trace,
                                  backend="sandbox", **kwargs)

    result = trio.run(main)
    return result, json.loads(trace.read_text())


def answer_of(result: RunResult) -> Any:
    assert result.stop_reason is StopReason.SUBMITTED, result.steps
    return json.loads(result.answer)


def last_error(result: RunResult) -> str:
    errors = [s.observation.content for s in result.steps if s.observation.is_error]
    assert errors, result.steps
    return errors[-1]


# =======================================================================================
# Episodes run as they do locally
# =======================================================================================


def test_a_code_runtime_program_solves_the_task_in_the_sandbox(tmp_path: Path, runners: Runners) -> None:
    result, _ = sandboxed(AGENT, tmp_path, SOLVE)
    assert result.stop_reason is StopReason.SUBMITTED, result.steps
    assert (tmp_path / "out" / "greeting.txt").read_text() == "hi\n"  # host-side tools
    assert [s.action.name for s in result.steps] == ["write_file", "read_file", "submit"]
    assert len(runners.started) == 1


def test_the_built_in_loop_runs_in_the_sandbox_too(tmp_path: Path, runners: Runners) -> None:
    from doubles import make_doc

    script = [{"text": "", "tool_calls": [{"name": "bash", "arguments": {"command": "echo hi"}}]},
              {"text": "", "tool_calls": [{"name": "submit", "arguments": {"answer": "ok"}}]}]
    runtime = build_runtime(make_doc(), Spy(script), backend="sandbox", backend_settings=COLD)
    try:
        result = runtime.run("task", INSTRUCTION, LocalDirEnvironment(tmp_path, command_timeout_sec=30))
    finally:
        runtime.close()
    assert isinstance(runtime, SandboxRuntime)
    assert (result.stop_reason, result.answer) == (StopReason.SUBMITTED, "ok")
    assert result.steps[0].observation.content == "hi\n"


def test_a_pooled_runner_serves_an_episode(tmp_path: Path) -> None:
    settings = SandboxSettings(pool_size=1, memory_mb=200)  # a pool of its own
    for attempt in range(2):  # the first may start its own; the second finds one ready
        result, _ = sandboxed(AGENT, tmp_path / str(attempt), SOLVE, settings=settings)
        assert result.stop_reason is StopReason.SUBMITTED, result.steps


# =======================================================================================
# Hostile programs: refused or contained, the episode still ends with its trace
# =======================================================================================


def test_a_program_cannot_write_host_files(tmp_path: Path, runners: Runners) -> None:
    planted = tmp_path / "planted.txt"
    interpreter_dir = os.path.dirname(python_runtime().interpreter)
    result, trace = traced(f"""
        import json, os, sys
        def run(kit):
            outcome = {{}}
            for path in [{str(planted)!r}, {interpreter_dir + "/planted"!r}, "/usr/planted",
                         "/planted", "/tmp/planted"]:
                try:
                    with open(path, "w") as file:
                        file.write("x")
                    outcome[path] = "written"
                except OSError as error:
                    outcome[path] = type(error).__name__
            script = int(sys.argv[0].rsplit("/", 1)[1])  # portable.py, shared by every runner
            try:
                os.write(script, b"x")
                outcome["runner script"] = "written"
            except OSError as error:
                outcome["runner script"] = type(error).__name__
            kit.execute("submit", {{"answer": json.dumps(outcome)}})
    """, tmp_path)
    outcome = answer_of(result)
    assert outcome.pop("/tmp/planted") == "written"  # its own /tmp, gone with it
    assert all(value != "written" for value in outcome.values()), outcome
    assert not planted.exists() and not os.path.exists(interpreter_dir + "/planted")
    assert not os.path.exists("/tmp/planted") and not os.path.exists("/usr/planted")
    assert trace["stop_reason"] == "submitted"


def test_a_program_cannot_read_the_hosts_environment_or_secrets(
        tmp_path: Path, runners: Runners, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WMO_TRIO_TEST_SECRET", "s3cret-in-env")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-in-file")
    result, trace = traced(f"""
        import json, os
        def run(kit):
            seen = {{"environ": dict(os.environ)}}
            for path in [{str(secret)!r}, "/etc/shadow", "/etc/passwd", "/root", "/home",
                         "/proc/1/environ", "/proc/keys"]:
                try:
                    seen[path] = os.listdir(path) if os.path.isdir(path) else open(path).read()
                except OSError as error:
                    seen[path] = type(error).__name__
            kit.execute("submit", {{"answer": json.dumps(seen)}})
    """, tmp_path)
    seen = answer_of(result)
    assert set(seen.pop("environ")) <= {"PWD"}  # bubblewrap's own
    assert "s3cret" not in json.dumps(seen) and "s3cret" not in json.dumps(trace)
    assert seen[str(secret)] == "FileNotFoundError"
    for path in ("/etc/shadow", "/etc/passwd"):
        assert seen[path] == "FileNotFoundError", (path, seen[path])
    for home in ("/root", "/home"):  # at most the way down to the Python runtime
        leads = {target[len(home) + 1:].split("/")[0] for _, target in python_runtime().binds
                 if target.startswith(home + "/")}
        assert seen[home] == "FileNotFoundError" or set(seen[home]) <= leads, seen[home]
    assert seen["/proc/keys"] in ("", "PermissionError")  # masked


def test_a_program_reaches_neither_the_hosts_loopback_nor_the_network(
        tmp_path: Path, runners: Runners) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        result, trace = traced(f"""
            import json, socket
            def run(kit):
                outcome = {{}}
                for host in ["127.0.0.1", "10.0.2.2", "1.1.1.1", "example.com"]:
                    try:
                        socket.create_connection((host, {port}), timeout=5).close()
                        outcome[host] = "connected"
                    except OSError as error:
                        outcome[host] = type(error).__name__
                kit.execute("submit", {{"answer": json.dumps(outcome)}})
        """, tmp_path)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody came
    outcome = answer_of(result)
    assert all(value != "connected" for value in outcome.values()), outcome
    assert outcome["127.0.0.1"] == "ConnectionRefusedError"  # a loopback of its own
    assert trace["stop_reason"] == "submitted"


def test_a_program_runs_under_the_trial_sandboxes_system_call_filter(tmp_path: Path,
                                                                     runners: Runners) -> None:
    """Docker's default profile and a keyring of its own, as in every trial sandbox: the
    kernel keyring, new user namespaces and io_uring are refused."""
    result, trace = traced("""
        import ctypes, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        def errno_of(number, *arguments):
            if libc.syscall(number, *arguments) == -1:
                return os.strerror(ctypes.get_errno())
            return "allowed"
        def run(kit):
            outcome = {
                # x86_64 numbers: add_key, keyctl(KEYCTL_GET_KEYRING_ID, @u), unshare(NEWUSER),
                # io_uring_setup
                "add_key": errno_of(248, b"user", b"probe", b"x", 1, ctypes.c_int(-4)),
                "keyctl": errno_of(250, 0, ctypes.c_int(-4), 0),
                "unshare": errno_of(272, 0x10000000),
                "io_uring_setup": errno_of(425, 1, ctypes.create_string_buffer(120)),
            }
            kit.execute("submit", {"answer": json.dumps(outcome)})
    """, tmp_path)
    outcome = answer_of(result)
    assert outcome == dict.fromkeys(outcome, os.strerror(errno.EPERM)), outcome
    assert trace["stop_reason"] == "submitted"


def test_a_program_sees_only_the_python_runtime_of_the_hosts_tree(tmp_path: Path,
                                                                     runners: Runners) -> None:
    result, _ = traced("""
        import json, os
        def run(kit):
            files = []
            for root, dirs, names in os.walk("/"):
                if root.startswith(("/proc", "/dev", "/sys")):
                    dirs[:] = []
                    continue
                files += [os.path.join(root, name) for name in names]
            kit.execute("submit", {"answer": json.dumps({"top": sorted(os.listdir("/")),
                                                         "files": files})})
    """, tmp_path)
    seen = answer_of(result)
    runtime = python_runtime()
    allowed = [target for _, target in runtime.binds]
    assert set(seen["top"]) <= {"proc", "dev", "tmp"} | {p.split("/")[1] for p in allowed}
    assert all(any(f == p or f.startswith(p + "/") for p in allowed) for f in seen["files"])
    assert not any("site-packages/" in f for f in seen["files"])
    assert not any(f.startswith(str(tmp_path)) for f in seen["files"])


def test_a_fork_bomb_meets_the_process_ceiling_and_dies_with_the_episode(
        tmp_path: Path, runners: Runners) -> None:
    settings = SandboxSettings(pool_size=0, pids=32, cpus=0.5)
    result, _ = sandboxed("""
        import errno, json, os
        def run(kit):
            children = 0
            while True:
                try:
                    pid = os.fork()
                except OSError as error:
                    refused = errno.errorcode[error.errno]
                    break
                if pid == 0:
                    while True:  # every child forks on, refused or not
                        try:
                            os.fork()
                        except OSError:
                            pass
                children += 1
            kit.execute("submit", {"answer": json.dumps([children, refused])})
    """, tmp_path, settings=settings)
    children, refused = answer_of(result)
    assert refused == "EAGAIN" and children < 32
    runners.gone()  # the whole tree was killed, its cgroup removed


def test_a_memory_bomb_is_killed_at_the_memory_ceiling_and_the_episode_says_so(
        tmp_path: Path, runners: Runners) -> None:
    settings = SandboxSettings(pool_size=0, memory_mb=64)
    result, _ = sandboxed("""
        def run(kit):
            hoard = []
            while True:
                hoard.append(b"\\x01" * (8 << 20))
    """, tmp_path, settings=settings)
    assert result.stop_reason is StopReason.ERROR
    assert "killed at its memory ceiling of 64 MiB" in last_error(result)


@pytest.mark.parametrize("stop", ["abort", "close"])
def test_abort_or_close_kills_a_program_that_ignores_it(tmp_path: Path, runners: Runners,
                                                        stop: str) -> None:
    provider = Spy([{"text": "ok"}])
    runtime = SandboxRuntime(code_doc("""
        import signal
        def run(kit):
            kit.complete("s", [{"role": "user", "content": "go"}])
            for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(number, signal.SIG_IGN)
            while True:
                pass
    """), provider, settings=COLD)
    threading.Thread(target=lambda: (provider.calling.wait(60), getattr(runtime, stop)()),
                     daemon=True).start()
    try:
        result = runtime.run("task", INSTRUCTION, LocalDirEnvironment(tmp_path))
    finally:
        runtime.close()
    assert result.stop_reason is StopReason.CANCELLED
    runners.gone()


def test_the_budget_kills_a_program_that_never_calls_the_kit(tmp_path: Path, runners: Runners) -> None:
    result, trace = traced("""
        def run(kit):
            while True:
                pass
    """, tmp_path, episode_timeout=2)
    assert result.stop_reason is StopReason.BUDGET
    assert trace["stop_reason"] == "budget" and "wall-clock budget" in trace["steps"][-1][
        "observation"]["content"]


def test_cancelling_the_caller_kills_the_sandbox_and_writes_a_partial_trace(
        tmp_path: Path, runners: Runners) -> None:
    provider = Scripted([{"text": "ok"}])
    trace = tmp_path / "trace.json"

    async def main() -> None:
        async with wmo_trio.open_episode_pool(limit=1) as pool, trio.open_nursery() as nursery:
            nursery.start_soon(lambda: pool.run(
                code_doc("def run(kit):\n    kit.complete('s', [])\n    while True:\n        pass\n"),
                provider, INSTRUCTION, LocalProcessEnvironment(tmp_path),
                trace_path=trace, backend="sandbox"))
            await trio.to_thread.run_sync(provider.calling.wait, 60)
            nursery.cancel_scope.cancel()

    trio.run(main)
    written = json.loads(trace.read_text())
    assert written["stop_reason"] == "cancelled-by-caller" and written["partial"] is True
    runners.gone()


# -- frames ----------------------------------------------------------------------------------


# Requests the host refuses on every backend (floods included): tests/test_backend_contract.py.


@pytest.mark.parametrize("line, message", [
    (b"{not json", "not a JSON frame"),
    (b"[1, 2]", "a frame must be a JSON object"),
    (b"[" * 200_000, "nests deeper than the host parses"),
    (b'{"type": "execute", "id": "one", "tool": "bash"}', "field 'id' must be int"),
    (b'{"type": "step", "step": {"action": {"kind": "tool_call", "name": "bash"}, '
     b'"observation": {"content": "x"}}}', "may only carry a message step"),
    (b'{"type": "launch"}', "unknown frame type 'launch'"),
    (b'{"type": "done", "stop_reason": "max_turns"}', "which it may not give"),
    (b"\xff\xfe" * 10, "not a JSON frame"),
])
def test_malformed_frames_end_the_episode_with_an_error_step(
        tmp_path: Path, runners: Runners, line: bytes, message: str) -> None:
    result, trace = traced(f"""
        def run(kit):
            kit._channel._frames.write({line!r} + b"\\n")
            kit._channel._frames.flush()
            kit.complete("s", [])
    """, tmp_path)
    assert result.stop_reason in (StopReason.ERROR, StopReason.UNKNOWN_DONE_REASON)
    assert message in last_error(result)
    assert trace["stop_reason"] == result.stop_reason.value


def test_a_gigabyte_frame_is_cut_off_with_the_hosts_memory_bounded(tmp_path: Path,
                                                                    runners: Runners) -> None:
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    result, trace = traced("""
        def run(kit):
            chunk = b"x" * (1 << 20)
            for _ in range(1024):
                kit._channel._frames.write(chunk)
            kit._channel._frames.flush()
    """, tmp_path)
    assert result.stop_reason is StopReason.ERROR
    assert f"over {MAX_FRAME_BYTES} bytes without ending a frame" in last_error(result)
    assert trace["stop_reason"] == "error"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert peak - peak_before < 256 << 20  # never near the gigabyte sent


# =======================================================================================
# Choosing the backend
# =======================================================================================


def test_no_backend_named_is_sandbox_for_a_program_and_local_for_the_built_in_loop() -> None:
    from doubles import make_doc

    assert resolve_backend(code_doc(AGENT), None) == "sandbox"
    assert resolve_backend(make_doc(), None) == "local"
    assert resolve_backend(code_doc(AGENT), "local") == "local"
    assert isinstance(build_runtime(code_doc(AGENT), Spy([{"text": "unused"}])), SandboxRuntime)


def test_the_research_api_runs_a_program_in_the_sandbox_when_no_backend_is_named(
        tmp_path: Path, runners: Runners) -> None:
    async def main() -> RunResult:
        async with wmo_trio.open_episode_pool(limit=1) as pool:
            return await pool.run(code_doc(
                "import os\ndef run(kit):\n"
                "    kit.execute('submit', {'answer': repr(os.listdir('/'))})\n"),
                                  Scripted([{"text": "unused"}]), INSTRUCTION,
                                  LocalProcessEnvironment(tmp_path))

    result = trio.run(main)
    assert result.stop_reason is StopReason.SUBMITTED
    assert "work" not in result.answer and "tmp" in result.answer
    assert len(runners.started) == 1


def test_the_harbor_agent_chooses_the_sandbox_for_a_program_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from wmo_trio.harbor import WmoTrioHarborAgent

    document = json.loads(code_doc(AGENT).model_dump_json())
    agent = WmoTrioHarborAgent(tmp_path, "scripted/offline", harness=document,
                               provider_config={"kind": "scripted", "model": "offline"})
    assert agent._arguments.harness_backend == "sandbox"
    assert "host's rights" not in caplog.text
    local = WmoTrioHarborAgent(tmp_path, "scripted/offline", harness=document,
                               provider_config={"kind": "scripted", "model": "offline"},
                               harness_backend="local")
    assert local._arguments.harness_backend == "local" and "host's rights" in caplog.text


def test_where_the_sandbox_cannot_run_one_error_names_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from wmo_trio.harbor import WmoTrioHarborAgent

    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    sandbox_problem.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"harness_backend='sandbox' cannot run on this "
                                             r"machine: bubblewrap \(bwrap\) is not on PATH"):
            check_backend("sandbox")
        with pytest.raises(ValueError, match="bwrap"):
            WmoTrioHarborAgent(tmp_path, "scripted/offline", harness=code_doc(AGENT).model_dump(),
                               provider_config={"kind": "scripted", "model": "offline"},
                               harness_backend="sandbox")
        # Nothing named: local, with the warning it always had.
        agent = WmoTrioHarborAgent(tmp_path, "scripted/offline", harness=code_doc(AGENT).model_dump(),
                                   provider_config={"kind": "scripted", "model": "offline"})
        assert agent._arguments.harness_backend == "local" and "host's rights" in caplog.text
    finally:
        sandbox_problem.cache_clear()


def test_threads_that_ask_at_once_whether_the_sandbox_runs_start_one_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from wmo_trio.backends import _sandbox_runner

    probes: list[object] = []
    threads: list[threading.Thread] = []
    original = _sandbox_runner.Runner.start.__func__  # type: ignore[attr-defined]

    def start(cls: type, *args: Any) -> Any:
        if threading.current_thread() in threads:  # not a pool's, filling in the background
            probes.append(args)
        return original(cls, *args)

    monkeypatch.setattr(_sandbox_runner.Runner, "start", classmethod(start))
    sandbox_problem.cache_clear()
    asking = threading.Barrier(16)
    answers: list[str | None] = []

    def ask() -> None:
        asking.wait()
        answers.append(sandbox_problem())

    threads += [threading.Thread(target=ask) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [None] * 16 and len(probes) == 1


def test_bad_sandbox_settings_are_refused_naming_them() -> None:
    for bad in ({"pids": 1}, {"memory_mb": 0}, {"cpus": 0}, {"pool_size": -1}, {"pids": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SandboxSettings.parse(bad)


# =======================================================================================
# Through harbor's own CLI
# =======================================================================================


HOSTILE_SOLVER = """
import os, socket

def run(kit):
    notes = []
    try:
        with open({planted!r}, "w") as file:
            file.write("planted")
        notes.append("wrote the host file")
    except OSError as error:
        notes.append("host write refused: " + type(error).__name__)
    notes.append("secret: " + os.environ.get("WMO_TRIO_TEST_SECRET", "absent"))
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
        notes.append("reached the host's loopback")
    except OSError as error:
        notes.append("loopback refused: " + type(error).__name__)
    notes.append("root holds: " + ",".join(sorted(os.listdir("/"))))
    kit.execute("write_file", {{"path": "/app/greeting.txt", "content": "Hello from wmo_trio\\n"}})
    kit.execute("submit", {{"answer": "; ".join(notes)}})
"""


@pytest.mark.harbor
def test_a_hostile_program_through_harbors_cli_is_contained_and_scored(tmp_path: Path) -> None:
    from test_local_environment import reward, run_harbor, trial_results

    if os.geteuid() != 0:
        pytest.skip("harbor's trial runs in the docker-free environment, as root")
    repo = Path(__file__).resolve().parents[1]
    planted = tmp_path / "planted.txt"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        document = json.loads((repo / "examples" / "harness.json").read_text())
        document["surfaces"].append({"id": "code:runtime", "kind": "code", "content": HOSTILE_SOLVER.format(
            planted=str(planted), port=server.getsockname()[1])})
        harness = tmp_path / "hostile.json"
        harness.write_text(json.dumps(document))
        os.environ["WMO_TRIO_TEST_SECRET"] = "s3cret-in-harbor"
        try:
            completed = run_harbor(
                tmp_path / "jobs", "-p", str(repo / "examples" / "tasks" / "hello-file"),
                "-a", "wmo_trio.harbor:WmoTrioHarborAgent", "-m", "scripted/offline",
                "--skip-model-parsing-and-provider-mapping",  # as the README runs it
                "--ak", f"harness={harness}", "--ak", "harness_backend=sandbox",
                "--ak", 'provider_config={"kind": "scripted", "model": "offline"}')
        finally:
            del os.environ["WMO_TRIO_TEST_SECRET"]
        with pytest.raises(BlockingIOError):
            server.accept()
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result,) = trial_results(tmp_path / "jobs").values()
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0
    (trial,) = (tmp_path / "jobs" / "job").glob("*/agent/wmo-run.json")
    trace = json.loads(trial.read_text())
    assert trace["stop_reason"] == "submitted"
    assert "host write refused" in trace["answer"] and "secret: absent" in trace["answer"]
    assert "loopback refused: ConnectionRefusedError" in trace["answer"]
    assert "work" not in trace["answer"].split("root holds: ")[1].split(",")
    assert not planted.exists()
