"""A candidate's identity in harbor's own machinery, and argument errors before the job
(issue 27, items 1 to 3), through harbor's real command line.

harbor reuses a trial (`harbor run --diff <job>`) when its `lock.json` matches, and
resumes a job (`harbor jobs resume`) from its `config.json`: the agent is identified there
by its document's `doc_hash`, never by how the document was given. A mistake in the
agent's arguments is one short message before any trial starts.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from console_scripts import run_in_one_process
from harbor_jobs import JOB_TIMEOUT_S
from support.harbor_runs import (
    AGENT,
    HARNESS,
    LOCAL_ENVIRONMENT,
    REPO,
    SKIP_MODEL_LOOKUP,
    harbor_env,
    harbor_executable,
    make_task,
)

from wmo_trio.harbor import WmoTrioHarborAgent
from wmo_trio.harness import load_harness
from wmo_trio.trace import parse_trace

OFFLINE = '{"kind": "scripted", "model": "offline"}'
# A task must have a semantic version for harbor to reuse its trials at all.
VERSIONED = '[task]\nname = "wmo/hello-file"\nversion = "1.0.0"\n\n'


def versioned_task(root: Path) -> Path:
    task = make_task(root, "hello-file")
    toml = task / "task.toml"
    toml.write_text(VERSIONED + toml.read_text())
    return task


def harbor(*arguments: str) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run([harbor_executable(), *arguments], cwd=REPO, env=harbor_env(),
                               capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
    return completed


def run_arguments(task: Path, jobs: Path, job_name: str, harness: Path, *extra: str,
                  model: str = "scripted/offline") -> list[str]:
    """The arguments of `harbor run` of the agent, as the README writes it."""
    return ["run", "-p", str(task), "-a", AGENT, "-m", model, "-e", LOCAL_ENVIRONMENT,
            "-o", str(jobs), "--job-name", job_name, "-y", "-q", SKIP_MODEL_LOOKUP,
            "--ak", f"harness={harness}", "--ak", f"provider_config={OFFLINE}", *extra]


def harbor_run(task: Path, jobs: Path, job_name: str, harness: Path, *extra: str,
               model: str = "scripted/offline") -> subprocess.CompletedProcess[str]:
    return harbor(*run_arguments(task, jobs, job_name, harness, *extra, model=model))


def output_of(completed: subprocess.CompletedProcess[str]) -> str:
    return completed.stdout + completed.stderr


def one_line(completed: subprocess.CompletedProcess[str]) -> str:
    return " ".join(output_of(completed).split())  # harbor wraps its lines to the terminal


def with_changed_prompt(path: Path) -> None:
    document = json.loads(path.read_text())
    prompt = next(s for s in document["surfaces"] if s["kind"] == "prompt")
    prompt["content"] += " Be brief."
    path.write_text(json.dumps(document))


@contextmanager
def changed_for_the_block(path: Path) -> Iterator[None]:
    """The document at `path` changed (`with_changed_prompt`) for the block, then as it was:
    a test changes a shared job's document without the others seeing it."""
    original = path.read_bytes()
    with_changed_prompt(path)
    try:
        yield
    finally:
        path.write_bytes(original)


def trace_doc_hashes(job: Path) -> list[str | None]:
    return [parse_trace(p.read_bytes()).doc_hash for p in sorted(job.glob("*/agent/wmo-run.json"))]


@pytest.fixture(scope="module")
def first_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One trial of the example document on a versioned task, the document given as a
    path; what the later jobs are compared with, and the source a regrade re-scores. A
    test that changes its document does so only for its block (`changed_for_the_block`)."""
    root = tmp_path_factory.mktemp("identity")
    task = versioned_task(root / "tasks")
    harness = root / "h.json"
    harness.write_text(HARNESS.read_text())
    completed = harbor_run(task, root / "jobs", "first", harness)
    assert completed.returncode == 0, output_of(completed)[-3000:]
    assert trace_doc_hashes(root / "jobs" / "first") == [load_harness(HARNESS).doc_hash]
    return {"root": root, "task": task, "harness": harness, "job": root / "jobs" / "first"}


# -- 1. reuse and resume follow the document -------------------------------------------


@pytest.mark.harbor
def test_the_same_document_at_another_path_and_reformatted_is_reused(
    before_any_trial: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    completed = before_any_trial["reuse"]
    text = one_line(completed)
    assert completed.returncode == 0, text[-3000:]
    assert "Reuse: 1/1" in text and "Nothing to execute." in text, text[-3000:]


@pytest.mark.harbor
def test_a_changed_document_at_the_same_path_reruns(first_job: dict[str, Any],
                                                     tmp_path: Path) -> None:
    # issue 27.1: the same path was "Reuse: 1/1 ... Nothing to execute" after the change.
    harness = first_job["harness"]
    with changed_for_the_block(harness):
        changed_hash = load_harness(harness).doc_hash
        completed = harbor_run(first_job["task"], tmp_path / "jobs", "changed", harness,
                               "--diff", str(first_job["job"]))
    text = one_line(completed)
    assert completed.returncode == 0, text[-3000:]
    assert "Rerun: 1/1" in text, text[-3000:]
    assert changed_hash != load_harness(HARNESS).doc_hash
    assert trace_doc_hashes(tmp_path / "jobs" / "changed") == [changed_hash]


@pytest.mark.harbor
def test_the_locks_and_configs_harbor_writes_name_the_document_not_the_path(
    first_job: dict[str, Any],
) -> None:
    doc_hash = load_harness(HARNESS).doc_hash
    [trial] = [p for p in first_job["job"].iterdir() if p.is_dir()]
    lock = json.loads((trial / "lock.json").read_text())["agent"]["kwargs"]
    assert lock["doc_hash"] == doc_hash and "harness" not in lock
    for config in (first_job["job"] / "config.json", trial / "config.json"):
        data = json.loads(config.read_text())
        agent = data["agents"][0] if "agents" in data else data["agent"]
        assert agent["kwargs"]["doc_hash"] == doc_hash  # what a resumed job is checked against
        assert agent["kwargs"]["harness"].endswith("h.json")  # and the path it reads


@pytest.fixture(scope="module")
def job_of_another_document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A job of two trials stopped during one of them (its result.json gone), whose
    document has changed since at the same path: what a resume, or a run into its
    directory, meets. Neither may run a trial of the new document in it."""
    root = tmp_path_factory.mktemp("another-document")
    task = versioned_task(root / "tasks")
    harness = root / "h.json"
    harness.write_text(HARNESS.read_text())
    completed = harbor_run(task, root / "jobs", "job", harness, "-k", "2")
    assert completed.returncode == 0, output_of(completed)[-3000:]
    job = root / "jobs" / "job"
    unfinished, _finished = sorted(p for p in job.iterdir() if p.is_dir())
    (unfinished / "result.json").unlink()  # as if the job had been stopped during it
    with_changed_prompt(harness)
    return {"root": root, "task": task, "harness": harness, "job": job, "unfinished": unfinished}


def assert_no_trial_of_the_new_document_ran(job: dict[str, Any]) -> None:
    assert not (job["unfinished"] / "result.json").exists()
    assert trace_doc_hashes(job["job"]) == [load_harness(HARNESS).doc_hash] * 2


@pytest.mark.harbor
def test_a_resumed_job_whose_document_changed_is_refused_in_one_line(
    job_of_another_document: dict[str, Any],
    before_any_trial: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    completed = before_any_trial["resume"]
    text = one_line(completed)
    assert completed.returncode != 0, text[-3000:]
    assert len(output_of(completed).splitlines()) <= 10, output_of(completed)
    changed_hash = load_harness(job_of_another_document["harness"]).doc_hash
    assert "doc_hash" in text and changed_hash in text, text
    assert_no_trial_of_the_new_document_ran(job_of_another_document)


@pytest.mark.harbor
def test_a_run_into_the_directory_of_a_job_of_another_document_is_refused_in_one_line(
    job_of_another_document: dict[str, Any],
    before_any_trial: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    # harbor resumes a job whose directory exists: a changed document must not join it.
    job = job_of_another_document
    completed = before_any_trial["run-into"]
    text = one_line(completed)
    assert completed.returncode != 0, text[-3000:]
    assert len(output_of(completed).splitlines()) <= 10, output_of(completed)
    assert load_harness(job["harness"]).doc_hash in text and "another --job-name" in text, text
    assert_no_trial_of_the_new_document_ran(job)


@pytest.mark.harbor
def test_a_regraded_trial_keeps_the_document_that_produced_it(first_job: dict[str, Any],
                                                              tmp_path: Path) -> None:
    # A regrade runs only the verifier on the recorded trial: its lock must name the
    # document that trial ran, not whatever the file holds now, or a later --diff would
    # credit the file's new document with it. harbor regrades with the task given here,
    # which must verify in an environment of its own; the source job's task need not.
    task = versioned_task(tmp_path / "tasks")
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n'))
    (task / "tests" / "test.sh").write_text("#!/bin/sh\nmkdir -p /logs/verifier\n"
                                           "echo 1 > /logs/verifier/reward.txt\n")
    with changed_for_the_block(first_job["harness"]):
        completed = harbor("jobs", "regrade", str(first_job["job"]), "-p", str(task),
                           "-e", LOCAL_ENVIRONMENT, "-o", str(tmp_path / "jobs"),
                           "--job-name", "regraded", "-y")
    assert completed.returncode == 0, output_of(completed)[-3000:]
    [lock] = (tmp_path / "jobs" / "regraded").glob("*/lock.json")
    assert json.loads(lock.read_text())["agent"]["kwargs"]["doc_hash"] == load_harness(HARNESS).doc_hash


# -- 2 and 3. argument errors before the job -------------------------------------------

EXAMPLE_TASK = REPO / "examples" / "tasks" / "hello-file"
# Each mistake: the arguments it adds, the model it gives, and what its message names.
ARGUMENT_ERRORS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "model": ((), "scripted/other", "model_name"),
    "agent-env": (("--ae", "SOME_NAME=value"), "scripted/offline", "agent environment"),
    "misspelled": (("--ak", "episode_timeout=60"), "scripted/offline",
                   "did you mean episode_timeout_sec?"),
    "other-document": (("--ak", "doc_hash=0123456789abcdef0123456789abcdef"), "scripted/offline",
                       "doc_hash"),
    # Before: "must be a JSON object with kind and model, got str".
    "broken-json": (("--ak", 'provider_config={"kind": "scripted", "model": "offline"'),
                    "scripted/offline", "provider_config: is not valid JSON"),
}


@pytest.mark.harbor
@pytest.mark.parametrize("mistake", list(ARGUMENT_ERRORS))
def test_an_argument_error_is_a_short_message_before_any_trial(
    before_any_trial: dict[str, subprocess.CompletedProcess[str]], mistake: str,
) -> None:
    # issue 27.2/27.3: a 508-line traceback per job, one error per trial, a job directory
    # of failed trials; a misspelled name silently ignored.
    completed = before_any_trial[mistake]
    named = ARGUMENT_ERRORS[mistake][2]
    output = output_of(completed)
    assert completed.returncode != 0, output[-3000:]
    assert len(output.splitlines()) <= 10, output
    assert named in one_line(completed), output
    assert not (before_any_trial_jobs(completed) / "job").exists()  # no job, so no trial, was started


def before_any_trial_jobs(completed: subprocess.CompletedProcess[str]) -> Path:
    """The jobs directory (`-o`) a command of `before_any_trial` was given."""
    arguments = list(completed.args)
    return Path(arguments[arguments.index("-o") + 1])


@pytest.fixture(scope="module")
def before_any_trial(
    first_job: dict[str, Any], job_of_another_document: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """This module's harbor commands that end before any trial starts (a job with nothing
    to execute, the refusals), each through harbor's own command line as its console script
    runs it, one after another in one process (tests/console_scripts.py): each one's own
    process would start harbor and import its modules again, over two CPU-seconds a command.
    The reuse goes first, where nothing else has run in the process yet, as when run alone."""
    root = tmp_path_factory.mktemp("before-any-trial")
    elsewhere = root / "another name.json"
    elsewhere.write_text(json.dumps(json.loads(HARNESS.read_text()), indent=5, sort_keys=True))
    another = job_of_another_document
    commands = {
        "reuse": run_arguments(first_job["task"], root / "reuse", "again", elsewhere,
                               "--diff", str(first_job["job"])),
        "resume": ["jobs", "resume", "-p", str(another["job"])],
        "run-into": run_arguments(another["task"], another["root"] / "jobs", "job",
                                  another["harness"]),
    }
    for mistake, (extra, model, _named) in ARGUMENT_ERRORS.items():
        commands[mistake] = run_arguments(EXAMPLE_TASK, root / mistake, "job", HARNESS, *extra,
                                          model=model)
    completed = run_in_one_process("harbor.cli.main:app", "harbor",
                                   [(argv, harbor_env()) for argv in commands.values()],
                                   cwd=REPO, timeout=JOB_TIMEOUT_S)
    return dict(zip(commands, completed, strict=True))


# -- the reach into harbor (wmo_trio.harbor._identity) ----------------------------------


def test_harbor_still_builds_trial_locks_where_the_identity_hook_wraps_them() -> None:
    # If a harbor release moves lock building, this fails before any reuse goes wrong.
    import harbor.models.job.lock as lock_module
    import harbor.trial.trial as trial_module

    for module in (lock_module, trial_module):
        assert getattr(module.build_trial_lock, "_wmo_identity", False), module.__name__


def test_harbors_preflight_hands_the_agent_its_configuration_to_pin() -> None:
    from harbor.agents.factory import AgentFactory
    from harbor.models.trial.config import AgentConfig

    config = AgentConfig(import_path="wmo_trio.harbor:WmoTrioHarborAgent",
                         model_name="scripted/offline", skip_model_parsing=True,  # as the README runs it
                         kwargs={"harness": str(HARNESS), "provider_config": json.loads(OFFLINE)})
    AgentFactory.run_preflight(config, skip_credential_checks=True)
    assert config.kwargs["doc_hash"] == load_harness(HARNESS).doc_hash
    assert WmoTrioHarborAgent.options_model is not None
