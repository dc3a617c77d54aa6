"""Candidates summarised and compared with the baseline, task by task.

A task's score for a candidate is the mean reward of its attempts, so a task run three
times weighs what a task run once does; every statistic is over tasks.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, Unpack

from pydantic import BaseModel, ConfigDict, Field

from wmo_trio.compare import _stats
from wmo_trio.compare._records import CompareError, TrialRecord, load_jobs

SCHEMA_VERSION = 1
MIN_RESAMPLES = 10_000
_TIE = 1e-12


# A candidate: a document's hash (or another agent's key) and its model, None when pooled.
Key = tuple[str, str | None]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Settings(_Model):
    confidence: float
    resamples: int
    seed: int
    missing_as_zero: bool
    pool_models: bool = Field(default=False, description="a document's trials with every "
                              "model are one candidate (else one per model)")


class TaskScore(_Model):
    task: str = Field(description="the task's label: its name, with its digest's start when "
                                  "the name alone is ambiguous")
    digest: str
    attempts: int
    scored: int = Field(description="attempts with a reward (all of them with missing_as_zero)")
    mean_reward: float | None


class CandidateSummary(_Model):
    doc_hash: str = Field(description="the group key: a document's doc_hash, or agent/model"
                                      "[#arguments] for another harbor agent")
    name: str
    model: str | None = Field(default=None, description="the model of this candidate's "
                              "trials; None when models are pooled or unknown")
    models: list[str] = Field(default_factory=list, description="every model its trials ran "
                              "with (more than one only when pooled)")
    sources: list[str]
    trials: int
    tasks: int = Field(description="tasks with at least one scored attempt")
    mean_reward: float | None
    ci_low: float | None
    ci_high: float | None
    pass_at_k: dict[str, float] = Field(description="k -> pass@k, for binary rewards")
    timeouts: int
    exceptions: int
    episode_errors: int = Field(default=0, description="episodes that ended in `error` (the "
                                "document's code or the episode raised), harbor's exception "
                                "or not")
    exception_types: dict[str, int] = Field(default_factory=dict, description="type -> "
                                            "trials, for `exceptions`")
    unscored: int = Field(description="trials without a reward; left out of the means "
                                      "unless missing_as_zero")
    input_tokens: int
    output_tokens: int
    mean_agent_seconds: float | None
    per_task: list[TaskScore]

    @property
    def key(self) -> Key:
        return (self.doc_hash, self.model)


class TaskDifference(_Model):
    task: str
    baseline: float
    candidate: float
    difference: float


class ComparisonSummary(_Model):
    baseline: str
    candidate: str
    baseline_model: str | None = None
    candidate_model: str | None = None
    tasks: int = Field(description="tasks scored for both")
    mean_difference: float | None = Field(description="candidate minus baseline, over the "
                                                      "paired tasks")
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    p_method: str | None
    wins: int
    losses: int
    ties: int
    only_baseline: list[str]
    only_candidate: list[str]
    per_task: list[TaskDifference]

    @property
    def baseline_key(self) -> Key:
        return (self.baseline, self.baseline_model)

    @property
    def candidate_key(self) -> Key:
        return (self.candidate, self.candidate_model)


class Report(_Model):
    """The whole comparison; `model_dump_json` is `wmo-trio compare --json`."""

    schema_version: int = SCHEMA_VERSION
    settings: Settings
    candidates: list[CandidateSummary]
    comparisons: list[ComparisonSummary]


@dataclass
class _Group:
    name: str
    sources: list[str] = field(default_factory=list)
    records: list[TrialRecord] = field(default_factory=list)

    @property
    def scored(self) -> bool:
        return any(record.reward is not None for record in self.records)


def candidate_label(doc_hash: str, model: str | None) -> str:
    """A candidate as `--baseline` takes it and errors name it: key, then `@model`."""
    return doc_hash if model is None else f"{doc_hash}@{model}"


def compare(
    records: Iterable[TrialRecord],
    *,
    baseline: str | None = None,
    missing_as_zero: bool = False,
    resamples: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
    pool_models: bool = False,
) -> Report:
    """Summarise each candidate of `records` and compare each with the baseline.

    A candidate is a document (or another agent) and the model it ran with; with
    `pool_models` a document's trials with every model are one. `baseline` is a
    candidate's key (`doc_hash` or `doc_hash@model`) or a unique prefix of one (default:
    the first candidate, in record order, that has a scored trial). Trials without a reward
    are left out of every mean, or count as 0 with `missing_as_zero`. Intervals are seeded
    BCa bootstraps over tasks with `resamples` resamples (at least 10,000); the p-value is
    the exact sign-flip test over the paired tasks (Wilcoxon past `EXACT_SIGN_FLIP_LIMIT`
    non-zero differences). Raises `CompareError` for an empty input, too few resamples or
    a baseline that names no candidate.
    """
    if resamples < MIN_RESAMPLES:
        raise CompareError(f"resamples={resamples}: use at least {MIN_RESAMPLES:,}, so that "
                           "the seed moves the intervals' ends little")
    if not 0.5 <= confidence < 1:
        raise CompareError(f"confidence={confidence}: give a level in [0.5, 1), e.g. 0.95")
    groups: dict[Key, _Group] = {}
    for record in records:
        key = (record.candidate, None if pool_models else record.model)
        group = groups.setdefault(key, _Group(record.name))
        group.records.append(record)
        if record.source and record.source not in group.sources:
            group.sources.append(record.source)
    if not groups:
        raise CompareError("no trials to compare")
    base = _resolve(baseline, groups)
    labels = _task_labels(r for g in groups.values() for r in g.records)
    settings = Settings(confidence=confidence, resamples=resamples, seed=seed,
                        missing_as_zero=missing_as_zero, pool_models=pool_models)

    scores: dict[Key, dict[tuple[str, str], float]] = {}
    candidates = []
    for key, group in groups.items():
        summary, scores[key] = _summarise(key, group, labels, settings)
        candidates.append(summary)
    comparisons = [
        _compare_pair(base, key, scores[base], scores[key], labels, settings)
        for key in groups if key != base
    ]
    # The baseline leads, so readers and the JSON see it first.
    candidates.sort(key=lambda c: c.key != base)
    return Report(settings=settings, candidates=candidates, comparisons=comparisons)


class CompareOptions(TypedDict, total=False):
    """`compare`'s keyword arguments, for what passes them on."""

    baseline: str | None
    missing_as_zero: bool
    resamples: int
    seed: int
    confidence: float
    pool_models: bool


def compare_jobs(paths: Sequence[Path | str], **options: Unpack[CompareOptions]) -> Report:
    """`compare` over the finished trials of harbor job directories, or of directories of
    them (`load_jobs`), with `compare`'s keyword arguments."""
    return compare(load_jobs(paths), **options)


def _resolve(baseline: str | None, groups: dict[Key, _Group]) -> Key:
    keys = list(groups)
    if baseline is None:
        # A candidate none of whose trials has a reward (all failed before the verifier)
        # would leave every comparison empty.
        return next((key for key in keys if groups[key].scored), keys[0])
    names = {candidate_label(*key): key for key in keys}
    if baseline in names:
        return names[baseline]
    matches = {key for name, key in names.items() if name.startswith(baseline)}
    if len(matches) == 1:
        return matches.pop()
    known = ", ".join(names)
    if not matches:
        raise CompareError(f"baseline {baseline!r} is no candidate of these trials; "
                           f"candidates: {known}")
    raise CompareError(f"baseline {baseline!r} is the start of several candidates; give more "
                       f"of it (@model picks a model): {known}")


def _task_labels(records: Iterable[TrialRecord]) -> dict[tuple[str, str], str]:
    digests: dict[str, set[str]] = defaultdict(set)
    for record in records:
        digests[record.task].add(record.task_digest)
    return {(task, digest): task if len(found) == 1 else f"{task}@{digest[:8] or '-'}"
            for task, found in digests.items() for digest in found}


def _summarise(key: Key, group: _Group, labels: dict[tuple[str, str], str],
               settings: Settings) -> tuple[CandidateSummary, dict[tuple[str, str], float]]:
    attempts: dict[tuple[str, str], list[TrialRecord]] = defaultdict(list)
    for record in group.records:
        attempts[(record.task, record.task_digest)].append(record)
    per_task, means, successes = [], {}, []
    binary = True
    for task in sorted(attempts, key=lambda t: labels[t]):
        rewards = [_score(r, settings.missing_as_zero) for r in attempts[task]]
        scored = [reward for reward in rewards if reward is not None]
        mean = sum(scored) / len(scored) if scored else None
        per_task.append(TaskScore(task=labels[task], digest=task[1], attempts=len(rewards),
                                  scored=len(scored), mean_reward=mean))
        if mean is not None:
            means[task] = mean
            successes.append([reward == 1.0 for reward in scored])
            binary = binary and all(reward in (0.0, 1.0) for reward in scored)
    values = list(means.values())
    low, high = _stats.bootstrap_interval(values or [0.0], resamples=settings.resamples,
                                          seed=settings.seed, confidence=settings.confidence)
    seconds = [r.agent_seconds for r in group.records if r.agent_seconds is not None]
    exceptions = Counter(r.exception for r in group.records if r.exception is not None)
    summary = CandidateSummary(
        doc_hash=key[0], name=group.name, model=key[1],
        models=sorted({r.model for r in group.records if r.model is not None}),
        sources=group.sources, trials=len(group.records),
        tasks=len(values), mean_reward=sum(values) / len(values) if values else None,
        ci_low=_finite(low), ci_high=_finite(high),
        pass_at_k={str(k): v for k, v in _stats.pass_at_k(successes).items()} if binary else {},
        timeouts=sum(r.timed_out for r in group.records),
        exceptions=exceptions.total(),
        episode_errors=sum(r.stop_reason == "error" for r in group.records),
        exception_types=dict(sorted(exceptions.items())),
        unscored=sum(r.reward is None for r in group.records),
        input_tokens=sum(r.input_tokens or 0 for r in group.records),
        output_tokens=sum(r.output_tokens or 0 for r in group.records),
        mean_agent_seconds=sum(seconds) / len(seconds) if seconds else None,
        per_task=per_task,
    )
    return summary, means


def _score(record: TrialRecord, missing_as_zero: bool) -> float | None:
    if record.reward is None and missing_as_zero:
        return 0.0
    return record.reward


def _compare_pair(base: Key, key: Key, baseline: dict[tuple[str, str], float],
                  candidate: dict[tuple[str, str], float], labels: dict[tuple[str, str], str],
                  settings: Settings) -> ComparisonSummary:
    paired = sorted(baseline.keys() & candidate.keys(), key=lambda t: labels[t])
    differences = [candidate[t] - baseline[t] for t in paired]
    mean = sum(differences) / len(differences) if differences else None
    low, high = _stats.bootstrap_interval(differences or [0.0], resamples=settings.resamples,
                                          seed=settings.seed, confidence=settings.confidence)
    p_value, method = _stats.sign_flip_p_value(differences) if differences else (None, None)
    return ComparisonSummary(
        baseline=base[0], candidate=key[0], baseline_model=base[1], candidate_model=key[1],
        tasks=len(paired), mean_difference=mean,
        ci_low=_finite(low), ci_high=_finite(high), p_value=p_value, p_method=method,
        wins=sum(d > _TIE for d in differences), losses=sum(d < -_TIE for d in differences),
        ties=sum(abs(d) <= _TIE for d in differences),
        only_baseline=sorted(labels[t] for t in baseline.keys() - candidate.keys()),
        only_candidate=sorted(labels[t] for t in candidate.keys() - baseline.keys()),
        per_task=[TaskDifference(task=labels[t], baseline=baseline[t], candidate=candidate[t],
                                 difference=d) for t, d in zip(paired, differences, strict=True)],
    )


def _finite(value: _stats.Floats) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None
