"""Trials as comparable records: from harbor job directories and from the research API.

A record names its candidate by a key that never depends on where files live: a harness
document's `doc_hash`, or for any other harbor agent its name, model and arguments. Its
task is the task's name and content digest, so two jobs are paired on the same task only
when the task did not change between them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    ValidationError,
)

from wmo_trio.files import read_bounded
from wmo_trio.harness import DocumentForm, document_form
from wmo_trio.settings import validation_problem

if TYPE_CHECKING:
    from wmo_trio.harness import HarnessDoc
    from wmo_trio.models import RunResult

AGENT_TIMEOUT = "AgentTimeoutError"
TRACE_FILENAME = "wmo-run.json"  # as wmo_trio.trace names it, without importing the engine
# A trial's files are read with a bound: a result or a trace bigger than this is refused.
RESULT_LIMIT = 16 * 2**20
TRACE_LIMIT = 64 * 2**20


class CompareError(Exception):
    """Input a comparison cannot use: one line saying what is wrong and what to do."""


class TrialRecord(BaseModel):
    """One attempt of one task by one candidate, as a comparison sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate: str = Field(description="doc_hash, or agent/model[#args] for other agents")
    name: str = Field(description="a label for people; never used to group")
    task: str
    task_digest: str = ""
    reward: FiniteFloat | None = Field(description="None: the trial has no reward (not verified)")
    timed_out: bool = False
    exception: str | None = Field(default=None,
                                  description="the type of any exception other than the "
                                              "agent's timeout")
    input_tokens: NonNegativeInt | None = None
    output_tokens: NonNegativeInt | None = None
    agent_seconds: NonNegativeFloat | None = None
    source: str = ""
    trial: str = ""
    trial_id: str = Field(default="", description="harbor's trial id: a trial found twice "
                                                  "(a job given twice, or copied) counts once")


def record_from_run(
    doc: HarnessDoc,
    task: str,
    result: RunResult | BaseException,
    reward: float | None,
    *,
    task_digest: str = "",
    agent_seconds: float | None = None,
    source: str = "research",
) -> TrialRecord:
    """A record of a research-API episode: `result` is what `EpisodePool.run` returned or
    raised (a `fan_out` outcome unwrapped), `reward` the caller's own score of it (the
    research API has no verifier), `task_digest` whatever identifies the task's content
    (for example a hash of its instruction)."""
    if isinstance(result, BaseException):
        return TrialRecord(candidate=doc.doc_hash, name=doc.name, task=task,
                           task_digest=task_digest, reward=reward,
                           exception=type(result).__name__, agent_seconds=agent_seconds,
                           source=source)
    usage = result.worker_usage
    return TrialRecord(
        candidate=doc.doc_hash, name=doc.name, task=task, task_digest=task_digest,
        reward=reward, timed_out=result.stop_reason.value == "budget",
        input_tokens=usage.input_tokens if usage else None,
        output_tokens=usage.output_tokens if usage else None,
        agent_seconds=agent_seconds, source=source, trial=result.task_id,
    )


def _read_bounded(path: Path, limit: int) -> bytes:
    """`wmo_trio.files.read_bounded` (never through a link), its failure a `CompareError`."""
    try:
        return read_bounded(path, limit)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CompareError(f"{path} is a symbolic link; not followed (a trial's files are "
                               "read only where harbor wrote them)") from None
        raise CompareError(f"cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise CompareError(f"cannot read {path}: {error}") from None


def load_jobs(paths: Iterable[Path | str]) -> list[TrialRecord]:
    """The finished trials of harbor job directories, in the order given, each job's
    trials in name order, each trial once however often it is found. Raises
    `CompareError` for a path that is not a job directory."""
    records: list[TrialRecord] = []
    seen: set[str] = set()
    for path in paths:
        for record in load_job(Path(path)):
            if record.trial_id not in seen:
                seen.add(record.trial_id)
                records.append(record)
    return records


def load_job(job_dir: Path) -> list[TrialRecord]:
    from harbor.models.job.config import JobConfig

    config = job_dir / "config.json"
    if not job_dir.is_dir() or not config.is_file():
        raise CompareError(f"{job_dir} is not a harbor job directory (no config.json); pass "
                           "the directories harbor run wrote under its jobs directory (-o)")
    try:
        JobConfig.model_validate_json(_read_bounded(config, RESULT_LIMIT))
    except ValidationError as error:
        raise CompareError(f"{config} is not a harbor job configuration: "
                           f"{validation_problem(error, most=1)}") from None
    records = []
    with os.scandir(job_dir) as entries:
        trial_dirs = sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
    for trial_dir in trial_dirs:
        result = trial_dir / "result.json"
        # harbor writes result.json itself: a link there is refused by the read, loudly.
        if result.is_file() or result.is_symlink():
            record = _trial_record(result, source=str(job_dir))
            if record is not None:
                records.append(record)
    if not records:
        raise CompareError(f"{job_dir} holds no finished trial (no <trial>/result.json with "
                           "finished_at); wait for the job to finish, or pass another job")
    return records


def _trial_record(path: Path, *, source: str) -> TrialRecord | None:
    from harbor.models.trial.result import TrialResult

    try:
        trial = TrialResult.model_validate_json(_read_bounded(path, RESULT_LIMIT))
    except ValidationError as error:
        raise CompareError(f"{path} is not a harbor trial result: "
                           f"{validation_problem(error, most=1)}") from None
    if trial.finished_at is None:
        return None  # still running
    candidate, name = _candidate(trial, path.parent)
    rewards = trial.verifier_result.rewards if trial.verifier_result is not None else None
    exception = trial.exception_info.exception_type if trial.exception_info else None
    n_input, _, n_output, _ = trial.compute_token_cost_totals()
    timing = trial.agent_execution
    seconds = None
    if timing is not None and timing.started_at and timing.finished_at:
        seconds = max(0.0, (timing.finished_at - timing.started_at).total_seconds())
    return TrialRecord(
        candidate=candidate, name=name, task=trial.task_name, task_digest=trial.task_checksum,
        reward=_reward(rewards), timed_out=exception == AGENT_TIMEOUT,
        exception=exception if exception != AGENT_TIMEOUT else None,
        input_tokens=n_input, output_tokens=n_output, agent_seconds=seconds,
        source=source, trial=trial.trial_name, trial_id=str(trial.id),
    )


def _reward(rewards: Mapping[str, Any] | None) -> float | None:
    """The trial's reward: `reward`, or the only value there is; None when there is none."""
    if not rewards:
        return None
    value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None  # not a number a mean can take: the trial counts as unscored
    return float(value)


def _candidate(trial: Any, trial_dir: Path) -> tuple[str, str]:
    """(group key, label) of a trial's agent: the document's hash for a wmo_trio candidate
    (from the result's agent metadata, else from its trace), else agent, model and
    arguments."""
    agent = trial.config.agent
    metadata = trial.agent_result.metadata if trial.agent_result is not None else None
    doc_hash = (metadata or {}).get("candidate_doc_hash") or _trace_doc_hash(trial_dir)
    if isinstance(doc_hash, str) and doc_hash:
        return doc_hash, _harness_label(agent.kwargs.get("harness"))
    name = agent.name or agent.import_path or trial.agent_info.name
    model = agent.model_name or (trial.agent_info.model_info.name
                                 if trial.agent_info.model_info else None)
    key = f"{name}/{model}" if model else str(name)
    if agent.kwargs:
        canonical = json.dumps(agent.kwargs, sort_keys=True, default=str)
        key += "#" + hashlib.blake2b(canonical.encode(), digest_size=4).hexdigest()
    return key, key


def _trace_doc_hash(trial_dir: Path) -> str | None:
    agent = trial_dir / "agent"
    trace = agent / TRACE_FILENAME
    if agent.is_symlink() or not trace.is_file() or trace.is_symlink():
        return None
    try:
        data = json.loads(_read_bounded(trace, TRACE_LIMIT))
    except (CompareError, ValueError):
        return None
    value = data.get("doc_hash") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _harness_label(harness: Any) -> str:
    """What the user called the document: its file's name, or a JSON document's `name`."""
    form = document_form(harness)
    if form is DocumentForm.JSON_TEXT:
        try:
            harness = json.loads(harness)
        except ValueError:
            return "wmo-harness"
    if isinstance(harness, Mapping):
        return str(harness.get("name") or "wmo-harness")
    if form is DocumentForm.PATH and harness:
        return Path(harness).stem
    return "wmo-harness"
