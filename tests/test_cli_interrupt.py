"""Ctrl-C in `wmo-trio run` (issue 38): the real command in a terminal, sent SIGINT as a
terminal sends it (to its whole process group) at moments it shows: a line on its
display, a file in its job directory. Never a sleep: each test waits for its event, and
its time limits only tell a hang from a slow machine."""

from __future__ import annotations

import json
import os
import pty
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from processes import running

pytestmark = pytest.mark.harbor  # real harbor jobs, in subprocesses

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "tasks"
CLI = [sys.executable, "-c", "from wmo_trio.cli import main; main()"]
# Long enough to tell a hang from a loaded machine; no test waits for it when all is well.
HANG_S = 240
# Every model call of the offline policy waits this long: an agent is in its episode until
# the test interrupts it.
SLOW_MODEL = '{"latency_s": 3600}'


class Terminal:
    """`wmo-trio` with its stdout on a pseudo-terminal and its stderr on a pipe, leading a
    process group of its own, as a shell runs a command in the foreground."""

    def __init__(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        master, slave = pty.openpty()
        environment = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
        environment.update(TERM="xterm-256color", COLUMNS="150", **(env or {}))
        self.process = subprocess.Popen([*CLI, *args], cwd=cwd, stdin=subprocess.DEVNULL,
                                        stdout=slave, stderr=subprocess.PIPE, env=environment,
                                        start_new_session=True)
        os.close(slave)
        self._master = master
        self._written = bytearray()
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                chunk = b""
            with self._changed:
                self._written += chunk
                self._changed.notify_all()
            if not chunk:
                return

    @property
    def written(self) -> str:
        with self._changed:
            return self._written.decode("utf-8", "replace")

    def wait_for_output(self, text: str) -> None:
        with self._changed:
            shown = self._changed.wait_for(
                lambda: text.encode() in self._written or self.process.poll() is not None,
                timeout=HANG_S)
        assert shown and text in self.written, f"never showed {text!r}:\n{self.written[-2000:]}"

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Check `condition` each time the terminal changes, and every 50 ms (a file)."""
        deadline = time.monotonic() + HANG_S
        with self._changed:
            while not condition() and self.process.poll() is None:
                assert time.monotonic() < deadline, f"never saw {what}:\n{self.written[-2000:]}"
                self._changed.wait(0.05)
        assert condition(), f"never saw {what}:\n{self.written[-2000:]}"

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the command's process group, as the terminal sends it."""
        os.killpg(self.process.pid, signal.SIGINT)

    def end(self) -> tuple[int, str]:
        """The exit code and stderr; fails the test (and kills the group) on a hang."""
        try:
            _, err = self.process.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate()
            pytest.fail(f"wmo-trio run did not end:\n{self.written[-2000:]}")
        finally:
            self._reader.join(timeout=HANG_S)
            os.close(self._master)
        return self.process.returncode, err.decode("utf-8", "replace")

    def group_is_gone(self) -> bool:
        """No process of the command's group is left (the issue saw a zombie child)."""
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return True
        return False


def json_file(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or half written
        return {}
    return data if isinstance(data, dict) else {}


def test_ctrl_c_while_trials_run_is_exit_130_one_line_and_every_trace(tmp_path: Path) -> None:
    run = Terminal("run", "-p", str(TASKS / "hello-file"), "-k", "2", "-n", "2",
                   "--provider-config", SLOW_MODEL, "--job-name", "job", cwd=tmp_path)
    run.wait_for_output("now: 2 running the agent")
    run.interrupt()
    code, err = run.end()
    job = tmp_path / "jobs" / "job"
    # Before: exit 1 and an exception group's traceback of about a hundred lines.
    assert code == 130, err
    assert err.splitlines() == [
        f"wmo-trio: interrupted: 0 trials finished, 2 cancelled (each with its trace); job "
        f"directory: {job.resolve()}"], err
    trials = sorted(path for path in job.iterdir() if path.is_dir())
    assert len(trials) == 2
    for trial in trials:
        trace = json_file(trial / "agent" / "wmo-run.json")
        assert trace.get("stop_reason") == "cancelled-by-harbor", trace
        assert json_file(trial / "result.json").get("finished_at")
    # harbor itself leaves an interrupted job's finished_at unset.
    assert json_file(job / "result.json").get("finished_at")
    assert run.group_is_gone()


def test_ctrl_c_while_environments_start_is_one_line_too(tmp_path: Path) -> None:
    """Before: a line a trial besides the command's ("nothing to copy out of ...: its
    environment did not start", harbor's "Failed to download logs" with a traceback)."""
    task = tmp_path / "tasks" / "slow-build"
    shutil.copytree(TASKS / "hello-file", task)
    building = f"sleep 3599.{secrets.randbelow(10**6):06d}"  # this run's own
    with (task / "environment" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"RUN {building}\n")  # its build runs until the Ctrl-C
    run = Terminal("run", "-p", str(task), "-k", "2", "-n", "2", "--job-name", "job",
                   "-e", "wmo_trio.harbor:LocalEnvironment", cwd=tmp_path)
    run.wait_for_output("now: 2 starting its environment")
    run.wait_until(lambda: running(building), "the image's build under way")
    run.interrupt()
    code, err = run.end()
    # harbor's job shows its records on the terminal while it runs, logging's last resort
    # after: neither shows a cancelled trial's cleanup.
    assert "nothing to copy out" not in run.written + err, run.written[-2000:]
    assert code == 130, err
    assert err.splitlines() == [
        "wmo-trio: interrupted: 0 trials finished, 2 cancelled (before their agent ran: no "
        f"trace); job directory: {(tmp_path / 'jobs' / 'job').resolve()}"], err
    assert run.group_is_gone()


def test_a_second_ctrl_c_leaves_while_the_cleanup_hangs(tmp_path: Path) -> None:
    stopped = tmp_path / "stopped"
    run = Terminal("run", "-p", str(TASKS / "hello-file"), "--provider-config", SLOW_MODEL,
                   "-e", "stuck_environment:StopNeverReturns", "--job-name", "job",
                   cwd=tmp_path, env={"WMO_TEST_STOPPED": str(stopped),
                                      "PYTHONPATH": str(Path(__file__).parent)})
    run.wait_for_output("now: 1 running the agent")
    run.interrupt()
    run.wait_for_output("Ctrl-C again to leave at once")
    run.wait_until(stopped.exists, "the environment's stop under way")
    run.interrupt()
    code, err = run.end()  # before: the second Ctrl-C did nothing
    assert code == 130, err
    assert err.splitlines() == [
        "wmo-trio: interrupted again: left without waiting for the trials' cleanup (traces "
        f"may be missing); job directory: {(tmp_path / 'jobs' / 'job').resolve()}"], err


def test_the_summary_does_not_wait_for_harbors_telemetry(tmp_path: Path) -> None:
    """harbor builds its job-finished telemetry event in an executor thread, and building it
    imports litellm (6.6 s seen): wmo-trio run waited for that thread before its summary,
    and a Ctrl-C then hung it for good. Here that import never ends."""
    fake = tmp_path / "never" / "litellm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import threading\nthreading.Event().wait()\n")
    environment = {"PYTHONPATH": str(fake.parent), "HARBOR_TELEMETRY": "1",
                   "HTTPS_PROXY": "http://127.0.0.1:9"}  # should an event get out
    run = Terminal("run", "-p", str(TASKS / "hello-file"), "--job-name", "job", cwd=tmp_path,
                   env=environment)
    code, err = run.end()
    assert code == 0, err
    assert "1 trial: mean reward 1.000" in run.written


def test_ctrl_c_as_the_job_ends_ends_the_command(tmp_path: Path) -> None:
    """The moment the issue saw hang 3 of 3 times: the job's result has its finished_at and
    harbor's telemetry is being built (its real litellm import)."""
    run = Terminal("run", "-p", str(TASKS / "hello-file"), "--job-name", "job", cwd=tmp_path,
                   env={"HARBOR_TELEMETRY": "1", "HTTPS_PROXY": "http://127.0.0.1:9"})
    result = tmp_path / "jobs" / "job" / "result.json"
    run.wait_until(lambda: bool(json_file(result).get("finished_at")), "the job's end")
    try:
        run.interrupt()
    except ProcessLookupError:
        pass  # it had ended already: what matters is that it ends
    code, err = run.end()
    # Ended (0), interrupted (130), or killed by SIGINT while the interpreter waited for a
    # thread at its exit.
    assert code in (0, 130, -signal.SIGINT), err
    assert "Traceback" not in err and len(err.splitlines()) <= 1, err
    assert run.group_is_gone()
