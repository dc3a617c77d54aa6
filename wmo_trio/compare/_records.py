"""Trials as comparable records: from harbor job directories and from the research API.

A record names its candidate by a key that never depends on where files live: a harness
document's `doc_hash`, or for any other harbor agent its name, model and arguments. Its
task is the task's name and content digest, so two jobs are paired on the same task only
when the task did not change between them.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    ValidationError,
)

from wmo_trio._files import read_bounded
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
    model: str | None = Field(default=None, description="the worker model a document ran "
                              "with (harbor's -m, <kind>/<model>); None when unknown, and for "
                              "other agents, whose key names their model")
    task: str
    task_digest: str = ""
    reward: FiniteFloat | None = Field(description="None: the trial has no reward (not verified)")
    timed_out: bool = False
    exception: str | None = Field(default=None,
                                  description="the type of any exception other than the "
                                              "agent's timeout")
    stop_reason: str | None = Field(default=None, description="how the episode ended, where "
                                    "the agent or its trace says")
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
    model: str | None = None,
) -> TrialRecord:
    """A record of a research-API episode: `result` is what `EpisodePool.run` returned or
    raised (a `fan_out` outcome unwrapped), `reward` the caller's own score of it (the
    research API has no verifier), `task_digest` whatever identifies the task's content
    (for example a hash of its instruction), `model` the provider's `<kind>/<model>` (a
    candidate is a document and a model)."""
    if isinstance(result, BaseException):
        return TrialRecord(candidate=doc.doc_hash, name=doc.name, model=model, task=task,
                           task_digest=task_digest, reward=reward,
                           exception=type(result).__name__, agent_seconds=agent_seconds,
                           source=source)
    usage = result.worker_usage
    return TrialRecord(
        candidate=doc.doc_hash, name=doc.name, model=model, task=task, task_digest=task_digest,
        reward=reward, timed_out=result.stop_reason.value == "budget",
        stop_reason=result.stop_reason.value,
        input_tokens=usage.input_tokens if usage else None,
        output_tokens=usage.output_tokens if usage else None,
        agent_seconds=agent_seconds, source=source, trial=result.task_id,
    )


def _read_bounded(path: Path, limit: int) -> bytes:
    """`wmo_trio._files.read_bounded` (never through a link), its failure a `CompareError`."""
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
    """The finished trials of harbor job directories, in the order given (a directory of
    jobs gives its jobs in name order, which is start order for harbor's default names),
    each job's trials in name order, each trial once however often it is found. Raises
    `CompareError` for a path that is neither."""
    records: list[TrialRecord] = []
    seen: set[str] = set()
    for path in paths:
        for job_dir in job_directories(Path(path)):
            for record in load_job(job_dir):
                if record.trial_id not in seen:
                    seen.add(record.trial_id)
                    records.append(record)
    return records


def job_directories(path: Path) -> list[Path]:
    """`path` when it is a job directory, else the job directories directly in it (as
    `wmo-trio trace` takes a directory of jobs; never through a link)."""
    if (path / "config.json").is_file() or not path.is_dir():
        return [path]
    with os.scandir(path) as entries:
        jobs = sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)
                      and os.path.isfile(os.path.join(e.path, "config.json")))
    return jobs or [path]  # none: load_job says what is missing


def load_job(job_dir: Path) -> list[TrialRecord]:
    from harbor.models.job.config import JobConfig

    config = job_dir / "config.json"
    if not job_dir.is_dir() or not config.is_file():
        raise CompareError(f"{job_dir} is not a harbor job directory (no config.json) nor a "
                           "directory of them; pass the directories harbor run wrote under "
                           "its jobs directory (-o), or that directory")
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
    # Read only when the result lacks what it holds (a trace can be megabytes).
    trace = functools.cache(lambda: _trace(path.parent))
    candidate, name, model = _candidate(trial, path.parent, trace)
    rewards = trial.verifier_result.rewards if trial.verifier_result is not None else None
    exception = trial.exception_info.exception_type if trial.exception_info else None
    n_input, _, n_output, _ = trial.compute_token_cost_totals()
    timing = trial.agent_execution
    seconds = None
    if timing is not None and timing.started_at and timing.finished_at:
        seconds = max(0.0, (timing.finished_at - timing.started_at).total_seconds())
    metadata = trial.agent_result.metadata if trial.agent_result is not None else None
    stop_reason = (metadata or {}).get("stop_reason") or trace().get("stop_reason")
    return TrialRecord(
        candidate=candidate, name=name, model=model, task=trial.task_name,
        task_digest=trial.task_checksum, reward=_reward(rewards),
        timed_out=exception == AGENT_TIMEOUT,
        exception=exception if exception != AGENT_TIMEOUT else None,
        stop_reason=stop_reason if isinstance(stop_reason, str) else None,
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


def _candidate(trial: Any, trial_dir: Path,
               trace: Callable[[], Mapping[str, Any]]) -> tuple[str, str, str | None]:
    """(group key, label, model) of a trial's agent: for a wmo_trio candidate the document's
    hash, from the result's agent metadata, else its trace, else the `doc_hash` harbor's
    records of the trial hold (its configuration, its lock: a trial that failed before
    the agent ran has only these), and the model it ran with; for another agent its
    name, model and arguments."""
    agent = trial.config.agent
    metadata = trial.agent_result.metadata if trial.agent_result is not None else None
    def recorded() -> Iterator[Any]:  # in order, each read only if those before lack it
        yield (metadata or {}).get("candidate_doc_hash")
        yield trace().get("doc_hash")
        yield agent.kwargs.get("doc_hash")
        yield _locked_doc_hash(trial_dir)

    doc_hash = next((value for value in recorded() if _is_doc_hash(value)), None)
    model = agent.model_name or (trial.agent_info.model_info.name
                                 if trial.agent_info and trial.agent_info.model_info else None)
    if doc_hash is not None:
        return doc_hash, _harness_label(agent.kwargs.get("harness")), model
    name = agent.name or agent.import_path or trial.agent_info.name
    key = f"{name}/{model}" if model else str(name)
    if agent.kwargs:
        canonical = json.dumps(agent.kwargs, sort_keys=True, default=str)
        key += "#" + hashlib.blake2b(canonical.encode(), digest_size=4).hexdigest()
    return key, key, None


def _is_doc_hash(value: Any) -> TypeGuard[str]:
    return (isinstance(value, str) and len(value) == 32
            and all(c in "0123456789abcdef" for c in value))


def _trace(trial_dir: Path) -> dict[str, Any]:
    """The trial's `agent/wmo-run.json` as JSON data; empty when absent or unreadable."""
    agent = trial_dir / "agent"
    trace = agent / TRACE_FILENAME
    if agent.is_symlink() or not trace.is_file() or trace.is_symlink():
        return {}
    try:
        data = json.loads(_read_bounded(trace, TRACE_LIMIT))
    except (CompareError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _locked_doc_hash(trial_dir: Path) -> Any:
    """The `doc_hash` the trial's `lock.json` names its agent by (wmo_trio's agent writes it
    there in place of the document's path, see wmo_trio.harbor._identity)."""
    lock = trial_dir / "lock.json"
    if not lock.is_file() or lock.is_symlink():
        return None
    try:
        data = json.loads(_read_bounded(lock, RESULT_LIMIT))
    except (CompareError, ValueError):
        return None
    agent = data.get("agent") if isinstance(data, dict) else None
    kwargs = agent.get("kwargs") if isinstance(agent, dict) else None
    return kwargs.get("doc_hash") if isinstance(kwargs, dict) else None


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
