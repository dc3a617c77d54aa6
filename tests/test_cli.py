"""`wmo-trio`, driven as a subprocess the way a new user runs it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import dataclass
from pathlib import Path

import pyte
import pytest

from wmo_trio.harness import load_harness

pytestmark = pytest.mark.slow  # runs the wmo-trio command in subprocesses

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from wmo_trio.cli import main; main()"]


def wmo_trio(*args: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 300, cli: list[str] = CLI) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    return subprocess.run([*cli, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**environment, **(env or {})})


# `wmo-trio`, writing as it exits the harbor modules it imported to the file $HARBOR_IMPORTS.
CLI_NOTING_HARBOR = [sys.executable, "-c", """
import atexit, json, os, sys
from pathlib import Path
atexit.register(lambda: Path(os.environ["HARBOR_IMPORTS"]).write_text(json.dumps(sorted(
    m for m in sys.modules if m == "harbor" or m.startswith("harbor.")))))
from wmo_trio.cli import main
main()
"""]
# All of harbor that judging `wmo-trio run`'s options needs, plain modules: its options
# model, which the agent's arguments are, and its enum of environment types.
HARBORS_PLAIN_MODULES = {"harbor", "harbor.agents", "harbor.agents.options", "harbor.models",
                         "harbor.models.environment_type"}


@dataclass
class TerminalRun:
    """A command run in a terminal: its exit code, what the terminal shows at its end, every
    byte it wrote there (each frame of a live display), and its stderr (a pipe)."""

    returncode: int
    screen: str
    written: str
    stderr: str


def wmo_trio_in_terminal(*args: str, cwd: Path, columns: int = 150,
                         lines: int = 60) -> TerminalRun:
    """`wmo-trio args` with its stdout on a pseudo-terminal, as a user at a terminal runs
    it; the terminal's screen is kept by a terminal emulator (pyte)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    environment = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    environment.update(TERM="xterm-256color", COLUMNS=str(columns), LINES=str(lines))
    process = subprocess.Popen([*CLI, *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave,
                               stderr=subprocess.PIPE, env=environment)
    os.close(slave)
    chunks: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    try:
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
        reader.join()
        os.close(master)
    written = b"".join(chunks).decode("utf-8", "replace")
    screen = pyte.Screen(columns, lines)
    pyte.Stream(screen).feed(written)
    return TerminalRun(process.returncode, "\n".join(line.rstrip() for line in screen.display),
                       written, err.decode("utf-8", "replace"))


@pytest.fixture(scope="module")
def demo_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[TerminalRun, Path]:
    """The demo: `wmo-trio run` with every default, on the bundled tasks, in a terminal."""
    cwd = tmp_path_factory.mktemp("demo")
    completed = wmo_trio_in_terminal("run", "-o", "jobs", "--job-name", "demo", cwd=cwd)
    return completed, cwd / "jobs" / "demo"


@pytest.mark.harbor
def test_the_demo_runs_the_bundled_tasks_and_ends_with_a_summary(
    demo_job: tuple[TerminalRun, Path],
) -> None:
    completed, job_dir = demo_job
    assert completed.returncode == 0, completed.stderr
    out = completed.screen
    assert "submitted" in out and "AgentTimeoutError" in out
    assert f"job directory: {job_dir}" in out.replace("\n", "")
    results = [json.loads(p.read_text()) for p in job_dir.glob("*/result.json")]
    rewards = sorted(r["verifier_result"]["rewards"]["reward"] for r in results)
    assert rewards == [0.0, 1.0, 1.0]
    # Each row names its trial, so repeated trials of one task can be told apart.
    for trial in job_dir.glob("*/result.json"):
        assert re.search(rf"│ {re.escape(trial.parent.name)}\s+│", out), out
    # Timeouts (a candidate's outcome, still scored) and errors (a broken trial) apart.
    assert "3 trials: mean reward 0.667, 1 timed out (AgentTimeoutError, still scored), " \
        "0 errors" in out


@pytest.mark.harbor
def test_the_demo_terminal_shows_one_display_and_says_what_it_waits_for(
    demo_job: tuple[TerminalRun, Path],
) -> None:
    completed, _ = demo_job
    # harbor's own bar ("Running trials...", then "Mean: 0.667") drew itself under the
    # live table in a third of the frames.
    assert "Running trials" not in completed.written and "Mean:" not in completed.written
    # The first seconds (harbor's import, the job's creation) are named: each display
    # draws its first frame as it starts.
    assert "loading harbor" in completed.written
    assert "creating the job" in completed.written
    # The live display is cleared at the end: the summary's title is on the screen once.
    assert completed.screen.count("wmo-trio run") == 1, completed.screen
    # wmo_trio serves the model itself: harbor does not look it up in litellm's tables.
    assert "could not resolve model" not in completed.written + completed.stderr


@pytest.mark.harbor
def test_trace_shows_a_real_trial_step_by_step(
    demo_job: tuple[TerminalRun, Path],
) -> None:
    _, job_dir = demo_job
    trial = next(job_dir.glob("hello-file__*"))
    completed = wmo_trio("trace", str(trial), cwd=ROOT)
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert "I will write the file with the requested line." in out  # the model's text
    assert "write_file /app/greeting.txt (20 characters)" in out and "wrote /app/greeting.txt" in out
    assert "stop reason: submitted" in out
    assert "reward: 1\n" in out  # from harbor's result.json beside the trace
    assert re.search(r"usage: [\d,]+ input \(0 cached\), [\d,]+ output, 3 calls", out), out


@pytest.mark.harbor
def test_trace_prints_a_command_as_it_was_sent(demo_job: tuple[TerminalRun, Path]) -> None:
    _, job_dir = demo_job
    trial = next(job_dir.glob("proof-of-work__*"))
    sent = json.loads((trial / "agent" / "wmo-run.json").read_text())["steps"][0]["action"][
        "arguments"]["command"]
    completed = wmo_trio("trace", str(trial), cwd=ROOT)
    assert completed.returncode == 0, completed.stderr
    # Every line of the command as the shell got it (its quoting was shown escaped twice).
    for line in sent.splitlines():
        assert line in completed.stdout, line
    assert "\\'" not in completed.stdout
    assert "reward: 0   exception: AgentTimeoutError" in completed.stdout


@pytest.mark.harbor
def test_trace_json_covers_every_trial_of_a_job(
    demo_job: tuple[TerminalRun, Path],
) -> None:
    _, job_dir = demo_job
    completed = wmo_trio("trace", str(job_dir), "--json", cwd=ROOT)
    assert completed.returncode == 0, completed.stderr
    traces = json.loads(completed.stdout)
    reasons = sorted(t["trace"]["stop_reason"] for t in traces)
    assert reasons == ["cancelled-by-harbor-timeout", "submitted", "submitted"]
    assert sorted(t["reward"] for t in traces) == [0.0, 1.0, 1.0]
    partial = next(t["trace"] for t in traces if t["trace"].get("partial"))
    assert partial["worker_usage"]["calls"] >= 1


@pytest.mark.harbor
def test_trace_finds_the_traces_of_a_directory_of_jobs(demo_job: tuple[TerminalRun, Path]) -> None:
    _, job_dir = demo_job
    completed = wmo_trio("trace", str(job_dir.parent), cwd=ROOT)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.count("stop reason: ") == 3


@pytest.mark.harbor
@pytest.mark.parametrize("name", ["agent/trajectory.json", "result.json"])
def test_trace_of_harbors_own_files_shows_the_trials_trace(
    demo_job: tuple[TerminalRun, Path], name: str,
) -> None:
    """harbor's ATIF trajectory and its trial result are not traces: they were 136 and 31
    lines of validation errors; the trace beside them is shown, with a note saying so."""
    _, job_dir = demo_job
    trial = next(job_dir.glob("hello-file__*"))
    completed = wmo_trio("trace", str(trial / name), cwd=ROOT)
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.count("\n") == 1 and "showing the trace of its trial" in completed.stderr
    assert f"{trial}/agent/wmo-run.json" in completed.stdout.replace("\n", "")
    assert "stop reason: submitted" in completed.stdout


def test_doc_hash_prints_the_example_documents_hash() -> None:
    completed = wmo_trio("doc", "hash", "examples/harness.json", cwd=ROOT)
    assert completed.returncode == 0
    assert completed.stdout.strip() == load_harness(ROOT / "examples/harness.json").doc_hash


def test_doc_validate_accepts_the_example() -> None:
    completed = wmo_trio("doc", "validate", "examples/harness.json", cwd=ROOT)
    assert completed.returncode == 0 and "valid" in completed.stdout


def _assert_bad_input(completed: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert completed.returncode == 2, (completed.stdout, completed.stderr)
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, completed.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    ("args", "env", "fragments"),
    [
        (["-p", "no/such/tasks"], {}, ["no/such/tasks does not exist"]),
        (["--harness", "bad.json"], {}, ["bad.json", "param:max-turns"]),
        (["-m", "openia/gpt"], {}, ["unknown provider kind 'openia'", "anthropic", "scripted"]),
        (["-m", "anthropic/claude-sonnet-4-5"], {}, ["ANTHROPIC_API_KEY"]),
        (["-e", "docker"], {"PATH": "/nonexistent"}, ["Docker daemon", "LocalEnvironment"]),
        (["-m", "offline"], {}, ["must be kind/model"]),
        (["--backend", "sandbox"], {"PATH": "/nonexistent"},
         ["harness_backend='sandbox' cannot run on this machine", "bwrap"]),
        (["--backend", "cloud"], {}, ["harness_backend must be one of 'local', 'e2b', 'sandbox'"]),
    ],
    ids=["tasks", "document", "provider-kind", "api-key", "docker", "kind/model", "sandbox",
         "backend"],
)
def test_bad_input_is_one_line_exit_2_and_starts_nothing(
    tmp_path: Path, args: list[str], env: dict[str, str], fragments: list[str],
) -> None:
    """Each refusal comes before harbor's machinery loads (a second of CPU)."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "b", "surfaces": [
        {"id": "prompt:core", "kind": "prompt", "content": "x"},
        {"id": "param:max-turns", "kind": "param", "content": "many"}]}))
    imports = tmp_path / "harbor-imports.json"
    full_env = {**env, "PATH": env["PATH"] + ":" + os.path.dirname(sys.executable)} if env else {}
    completed = wmo_trio("run", "-o", "jobs", "-p", str(ROOT / "examples/tasks/hello-file"),
                         *args, cwd=tmp_path, env={**full_env, "HARBOR_IMPORTS": str(imports)},
                         cli=CLI_NOTING_HARBOR)
    _assert_bad_input(completed, *fragments)
    assert not (tmp_path / "jobs").exists()
    harbor = set(json.loads(imports.read_text()))
    assert harbor <= HARBORS_PLAIN_MODULES, sorted(harbor)


# Every other refusal, in one process: what it says, and that harbor's machinery is still
# not loaded after all of them.
_REFUSALS_PROBE = """
import json, sys
from pathlib import Path
from wmo_trio.cli._run import BadInput, RunOptions, build_job_config, examples_dir

said = {}
for case, fields in json.loads(sys.argv[1]).items():
    fields = {name: [Path(p) for p in value] if name == "paths" else
              Path(value) if name == "jobs_dir" else value for name, value in fields.items()}
    try:
        build_job_config(RunOptions(**{"paths": [examples_dir() / "tasks" / "hello-file"],
                                        **fields}))
    except BadInput as error:
        said[case] = str(error)
def harbor():
    return sorted(m for m in sys.modules if m == "harbor" or m.startswith("harbor."))
refused = harbor()
# What the probe would see if a refusal had loaded it: the config of options that pass.
build_job_config(RunOptions(paths=[examples_dir() / "tasks" / "hello-file"],
                            environment="wmo_trio.harbor:LocalEnvironment"))
print(json.dumps({"said": said, "harbor": refused, "then": harbor()}))
"""


def test_every_refusal_comes_before_harbor_loads(tmp_path: Path) -> None:
    (tmp_path / "no-tasks").mkdir()
    (tmp_path / "jobs" / "taken").mkdir(parents=True)
    for task in ("plain", "multi"):
        (tmp_path / "mixed" / task / "environment").mkdir(parents=True)
        (tmp_path / "mixed" / task / "task.toml").write_text("")
    (tmp_path / "mixed" / "multi" / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    build: .\n")
    cases = {
        "-n 0": ({"concurrency": 0}, "-n (--n-concurrent) must be at least 1, got 0"),
        "-k -1": ({"attempts": -1}, "-k (--n-attempts) must be at least 1, got -1"),
        # Named by the -m given, not by the agent's provider_config the user never wrote.
        "an unknown scripted model": ({"model": "scripted/online"},
                                      "-m scripted/online: scripted model 'online' does not "
                                      "exist"),
        # Before: "model_name (-m) must be 'anthropic/offline'", of a -m never given.
        "a kind in --provider-config": ({"provider_settings": {"kind": "anthropic"}},
                                        "--provider-config names the provider's kind, which -m "
                                        "gives (now scripted/offline)"),
        "--command-timeout": ({"command_timeout_sec": 241},
                              "command_timeout_sec must be an integer in [1, 240], got 241"),
        "--episode-timeout": ({"episode_timeout_sec": 0.0},
                              "episode_timeout_sec must be a finite positive number of seconds"),
        "no tasks": ({"paths": ["no-tasks"]}, "no-tasks is neither a harbor task"),
        "a taken job": ({"jobs_dir": "jobs", "job_name": "taken"},
                        "job directory jobs/taken already exists"),
        "a provider setting": ({"provider_settings": {"scirpt": []}},
                               "scripted provider: unknown setting scirpt"),
        "e2b without a key": ({"backend": "e2b"}, "harness_backend='e2b' needs an E2B API key"),
        "an unknown environment": ({"environment": "nosuch"}, "unknown environment 'nosuch'"),
        # Before: harbor's traceback at the first such trial, the job's other trials lost.
        "a Compose task without Docker": (
            {"paths": ["mixed"], "environment": "wmo_trio.harbor:LocalEnvironment"},
            "1 task needs Docker Compose (multi), which the docker-free sandbox does not run: "
            "run them with -e docker"),
    }
    environment = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    completed = subprocess.run(
        [sys.executable, "-c", _REFUSALS_PROBE,
         json.dumps({case: fields for case, (fields, _) in cases.items()})],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=environment)
    assert completed.returncode == 0, completed.stderr
    found = json.loads(completed.stdout)
    for case, (_, fragment) in cases.items():
        assert fragment in found["said"].get(case, "(not refused)"), (case, found["said"])
    assert set(found["harbor"]) <= HARBORS_PLAIN_MODULES, found["harbor"]
    assert "harbor.models.job.config" in found["then"]


def test_an_invalid_document_is_bad_input_for_doc_commands(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    _assert_bad_input(wmo_trio("doc", "hash", str(broken), cwd=tmp_path), "is not JSON")


def test_trace_of_a_missing_path_is_bad_input(tmp_path: Path) -> None:
    _assert_bad_input(wmo_trio("trace", str(tmp_path / "nothing"), cwd=tmp_path), "does not exist")


def _hostile_document(tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"{case}.json"
    valid = {"name": "t", "surfaces": [{"id": "prompt:core", "kind": "prompt", "content": "x"}]}
    if case == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "latin1":
        path.write_bytes(json.dumps({**valid, "name": "café"}, ensure_ascii=False).encode("latin-1"))
    elif case == "bigint":
        path.write_text(json.dumps(valid).replace('"name"', '"version": ' + "9" * 5000 + ', "name"'))
    elif case == "surrogate":
        path.write_text(json.dumps({**valid, "name": "a\ud800b"}))  # written as a \ud800 escape
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "many":
        surfaces = [{"id": f"param:p{i}", "kind": "param", "content": "1"} for i in range(100_000)]
        path.write_text(json.dumps({**valid, "surfaces": [*valid["surfaces"], *surfaces]}))
    return path


@pytest.mark.parametrize(("case", "fragment"), [
    ("deep", "nests arrays and objects more than 16 levels deep"),
    ("latin1", "is not UTF-8 text"),
    ("bigint", "a number of 5,000 digits"),
    ("surrogate", "name: is not valid text"),
    ("fifo", "it is a FIFO (named pipe), not a regular file"),
    ("many", "its limit is 1,000 surfaces"),
])
@pytest.mark.parametrize("command", ["validate", "hash"])
def test_a_hostile_document_is_one_line_exit_2(tmp_path: Path, case: str, fragment: str,
                                               command: str) -> None:
    path = _hostile_document(tmp_path, case)
    # Bounded in CPU time, which a busy machine does not stretch: the whole command (start-up
    # included) takes about 0.3 s, 100,000 surfaces once took 13.7 s. A FIFO used to hang
    # the command without using CPU: the timeout turns that into a failure, not a pass.
    completed, cpu_seconds = wmo_trio_cpu("doc", command, str(path), cwd=tmp_path, timeout=60)
    _assert_bad_input(completed, str(path), fragment)
    assert completed.stdout == ""
    assert cpu_seconds < 5, f"the refusal took {cpu_seconds:.1f} s of CPU"


def wmo_trio_cpu(*args: str, cwd: Path,
                 timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """`wmo-trio args` run to its end (killed after `timeout` seconds), and the CPU time it
    used, user and system, as the kernel counted it for that one process."""
    with (cwd / "stdout").open("w+") as out, (cwd / "stderr").open("w+") as err:
        process = subprocess.Popen([*CLI, *args], cwd=cwd, stdout=out, stderr=err, text=True)
        killer = threading.Timer(timeout, process.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            killer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        completed = subprocess.CompletedProcess(process.args, process.returncode, out.read(),
                                                err.read())
    assert process.returncode != -9, f"killed after {timeout} s: {completed}"
    return completed, usage.ru_utime + usage.ru_stime


def test_a_long_argument_that_names_no_file_is_quoted_short(tmp_path: Path) -> None:
    argument = "x" * 100_000
    completed = wmo_trio("doc", "validate", argument, cwd=tmp_path)
    _assert_bad_input(completed, "cannot read harness document 'xxx", "(100,000 characters)")
    assert len(completed.stderr) < 400, completed.stderr


def test_doc_validate_prints_the_hash_on_the_same_line_when_piped(tmp_path: Path) -> None:
    document = json.loads((ROOT / "examples/harness.json").read_text())
    document["name"] = "a-candidate-with-a-name-long-enough-to-need-wrapping-" * 2
    path = tmp_path / ("a-directory-with-a-long-name-" * 3) / "candidate.json"
    path.parent.mkdir()
    path.write_text(json.dumps(document))
    completed = wmo_trio("doc", "validate", str(path), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    expected_hash = load_harness(path).doc_hash
    assert completed.stdout.count("\n") == 1 and len(completed.stdout) > 200
    assert completed.stdout.startswith(f"{path}: valid (")
    assert completed.stdout.endswith(f"; hash {expected_hash})\n")


def test_doc_validate_summarises_unread_parameters_in_one_note(tmp_path: Path) -> None:
    surfaces = [{"id": "prompt:core", "kind": "prompt", "content": "x"},
                *({"id": f"param:extra-{i}", "kind": "param", "content": "1"} for i in range(30))]
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({"name": "t", "surfaces": surfaces}))
    completed = wmo_trio("doc", "validate", str(path), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    notes = completed.stderr.splitlines()
    assert len(notes) == 1 and notes[0].startswith("note: 30 parameter surfaces wmo_trio does "
                                                   "not read, kept and hashed: param:extra-0, ")
    assert notes[0].endswith(" and 25 more")
