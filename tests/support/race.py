"""A race's candidates and tasks for tests: documents whose episodes solve a task at a given
rate, and copies of the bundled hello-file task that ask for /app/answer.txt."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from wmo_trio import DirectoryEnvironment
from wmo_trio.models import RunResult
from wmo_trio.race import RaceTask
from wmo_trio.research import TrioEnvironment

HELLO = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "hello-file"
ENV = "wmo_trio.harbor:LocalEnvironment"

PROGRAM = """import hashlib
ANSWER = {answer!r}
{preamble}
RATE = {rate}


def run(kit):
    share = int(hashlib.sha256(kit.instruction.encode()).hexdigest()[:8], 16) / 2**32
    {pause}
    {mark}
    if share < RATE:
        kit.execute("write_file", {{"path": ANSWER, "content": "ok\\n"}})
    kit.execute("submit", {{"answer": "done"}})
"""

MARK = """import os
    with open({path!r}, "a") as marks:
        marks.write(f"{{os.getpid()}}\\n")"""


def candidate(directory: Path, name: str, rate: float, *, broken: bool = False,
              pause: float = 0.0, answer: str = "/app/answer.txt", pids: Path | None = None) -> Path:
    """A document whose program passes a task when the task's hash falls under `rate`;
    `broken`: its program raises as it loads, before `run` is called; `pids`: a file on
    the host its program (run in the agent's process, `--backend local`) appends that
    process's id to, one line an episode."""
    code = PROGRAM.format(rate=rate, answer=answer, preamble='raise RuntimeError("broken at load")'
                          if broken else "",
                          pause=f'kit.execute("bash", {{"command": "sleep {pause}"}})'
                          if pause else "pass",
                          mark=MARK.format(path=str(pids)) if pids else "pass")
    doc = {"name": name, "surfaces": [
        {"id": "prompt:core", "kind": "prompt", "content": f"Candidate {name}."},
        {"id": "code:runtime", "kind": "code", "content": code}]}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def make_tasks(root: Path, count: int, *, broken_build: bool = False) -> Path:
    """`count` tasks asking for /app/answer.txt, each instruction its own; and one whose
    image cannot be built."""
    for i in range(count):
        task = root / f"answer-{i:02d}"
        shutil.copytree(HELLO, task)
        (task / "instruction.md").write_text(f"Task {i}: write `ok` to /app/answer.txt.\n")
        (task / "tests" / "test.sh").write_text(
            "#!/bin/sh\nmkdir -p /logs/verifier\n"
            "if [ \"$(cat /app/answer.txt 2>/dev/null)\" = ok ]; then echo 1; else echo 0; fi"
            " > /logs/verifier/reward.txt\n")
    if broken_build:
        task = root / "unbuildable"
        shutil.copytree(HELLO, task)
        with (task / "environment" / "Dockerfile").open("a") as dockerfile:
            dockerfile.write("RUN exit 3\n")
    return root


def race_args(jobs: Path, tasks: Path, *docs: Path, name: str = "race") -> list[str]:
    args = ["race", "-p", str(tasks), "-o", str(jobs), "--job-name", name, "-e", ENV,
            "--backend", "local", "-n", "4"]
    for doc in docs:
        args += ["--harness", str(doc)]
    return args


def interrupted_race(root: Path, *options: str,
                     before_signal: Callable[[subprocess.Popen[str]], None] = lambda _: None,
                     timeout_s: float = 240) -> tuple[int | None, str, str]:
    """`wmo-trio race` of two slow candidates on eight tasks (job `root/jobs/race`), in a
    subprocess, sent SIGINT once a trial of its second round has started; its exit code, stdout
    and stderr. `before_signal` sees the process just before the signal."""
    from wmo_trio.race._harbor import read_race

    tasks = make_tasks(root / "tasks", 8)
    docs = [candidate(root, "slow-a", 0.5, pause=3), candidate(root, "slow-b", 0.5, pause=3)]
    command = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
               "signal.SIG_DFL); from wmo_trio.cli import main; sys.argv[0] = 'wmo-trio'; "
               "main()", *race_args(root / "jobs", tasks, *docs), "--alpha", "0.01", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "COLUMNS": "200"})
    job = root / "jobs" / "race"
    deadline = time.monotonic() + timeout_s
    try:
        while not ((job / "race.json").is_file() and read_race(job).rounds >= 1):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the first round never finished"
            time.sleep(0.2)
        counted = read_race(job).trials
        # into the second round: one of its trials has its directory (each runs 3 s at least)
        while sum(1 for path in job.iterdir() if path.is_dir()) <= counted:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the second round never started"
            time.sleep(0.2)
        before_signal(process)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, stdout, stderr


def assert_reads_as_the_race_so_far(job: Path) -> None:
    """The directory of an interrupted race: race.json says so, after a round at least,
    and it is a harbor job still (its counted trials, the round cut short too)."""
    from wmo_trio.compare import load_jobs
    from wmo_trio.race._harbor import read_race

    report = read_race(job)
    assert (report.finished, report.stop_reason) == (False, "interrupted")
    assert report.rounds >= 1 and report.note is not None
    assert len(load_jobs([job])) >= report.trials
    assert json.loads((job / "result.json").read_text())["finished_at"] is None


def answered(environment: TrioEnvironment, result: RunResult) -> float:
    assert isinstance(environment, DirectoryEnvironment)
    answer = environment.workdir / "answer.txt"
    return float(answer.is_file() and answer.read_text() == "ok\n")


def research_tasks(root: Path, count: int) -> list[RaceTask]:
    def fresh(name: str) -> DirectoryEnvironment:
        workdir = root / name / str(len(list((root / name).glob("*"))))
        workdir.mkdir(parents=True)
        return DirectoryEnvironment(workdir)

    for i in range(count):
        (root / f"task-{i}").mkdir(parents=True)
    return [RaceTask(f"task-{i}", f"Task {i}: write ok to answer.txt.",
                     lambda i=i: fresh(f"task-{i}"), answered) for i in range(count)]
