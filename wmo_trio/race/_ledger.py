"""One race's bookkeeping: which tasks and candidates the next round runs, what a round's
rewards make of the standings, and the report. No harbor, no trio: the harbor race and
the research API's race drive the same ledger."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from wmo_trio.race._elimination import Elimination, Verdict
from wmo_trio.race._report import (
    CandidateStanding,
    LeftOutTask,
    RaceReport,
    RaceSettings,
    Status,
    StopReason,
)
from wmo_trio.race._sequential import betting_interval


class RaceError(Exception):
    """Input a race cannot use: one line saying what is wrong and what to do."""


@dataclass(frozen=True)
class Attempt:
    """One trial's outcome as the race reads it."""

    reward: float | None
    error: str | None = None  # the exception's type, other than the agent's timeout


@dataclass(frozen=True)
class Round:
    number: int
    tasks: tuple[str, ...]
    candidates: tuple[str, ...]  # keys, in the race's order


@dataclass
class _Candidate:
    key: str
    name: str
    trials: int = 0
    errors: int = 0
    unscored: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # exception type -> trials
    stopped_round: int | None = None
    behind: str | None = None
    scores: dict[str, float] = field(default_factory=dict)  # task -> mean of attempts


def task_order(tasks: Sequence[str], seed: int) -> list[str]:
    """The tasks in the race's order: a seeded shuffle of them sorted by name, so the same
    seed and task set give the same order whatever order they were listed in."""
    order = sorted(tasks)
    random.Random(seed).shuffle(order)
    return order


def default_batch(concurrency: int, running: int, attempts: int) -> int:
    """Tasks per round: enough trials to keep `concurrency` trials busy, at least one."""
    return max(1, math.ceil(concurrency / max(1, running * attempts)))


class RaceLedger:
    """A race of `candidates` (key -> name, in order) over `tasks` (already in the race's
    order). With `baseline` (a key) each other candidate is held against it."""

    def __init__(self, candidates: Mapping[str, str], tasks: Sequence[str], *,
                 alpha: float = 0.05, attempts: int = 1, seed: int = 0,
                 max_trials: int | None = None, baseline: str | None = None,
                 familywise: bool = False) -> None:
        if len(candidates) < 2:
            raise RaceError("a race needs at least two different candidates; to evaluate one "
                            "candidate, run it (wmo-trio run)")
        if not 0 < alpha < 1:
            raise RaceError(f"alpha={alpha}: give a level in (0, 1), e.g. 0.05")
        if attempts < 1:
            raise RaceError("attempts (-k) must be at least 1")
        if max_trials is not None and max_trials < 1:
            raise RaceError("--max-trials must be at least 1")
        if not tasks:
            raise RaceError("no tasks to race on")
        if len(set(tasks)) != len(tasks):
            raise RaceError("a task is listed twice; give each task once")
        if baseline is not None and baseline not in candidates:
            raise RaceError(f"baseline {baseline!r} is not one of the candidates")
        self.keys = list(candidates)
        self.candidates = {key: _Candidate(key, name) for key, name in candidates.items()}
        self.tasks = list(tasks)
        self.settings = RaceSettings(alpha=alpha, attempts=attempts, seed=seed,
                                     max_trials=max_trials, baseline=baseline,
                                     tasks=len(tasks), familywise=familywise)
        index = None if baseline is None else self.keys.index(baseline)
        self.rule = Elimination(1, len(self.keys), alpha=alpha, baseline=index,
                                familywise=familywise)
        self.next_task = 0
        self.rounds = 0
        self.trials = 0
        self.task_order: list[str] = []
        self.left_out: list[LeftOutTask] = []
        self.stop_reason: StopReason | None = None
        self.interrupted = False

    @property
    def running(self) -> list[str]:
        return [key for key, on in zip(self.keys, self.rule.running[0], strict=True) if on]

    def next_round(self, batch: int) -> Round | None:
        """The next round's tasks and candidates (`batch` tasks at most, fewer at the end of
        the tasks or the trial budget), or None when the race is over (`stop_reason` set)."""
        if self.stop_reason is not None:
            return None
        running = self.running
        if not running:
            self.stop_reason = ("one candidate left" if self.settings.baseline is None
                                else "all decided")
            return None
        size = min(max(1, batch), len(self.tasks) - self.next_task)
        if self.settings.max_trials is not None:
            room = self.settings.max_trials - self.trials
            size = min(size, room // (len(running) * self.settings.attempts))
        if len(self.tasks) == self.next_task:
            self._stop("tasks exhausted")
            return None
        if size < 1:
            self._stop("trial budget")
            return None
        tasks = tuple(self.tasks[self.next_task:self.next_task + size])
        return Round(self.rounds + 1, tasks, tuple(running))

    def _stop(self, reason: StopReason) -> None:
        self.stop_reason = reason
        self.rule.finish()

    def record(self, played: Round, attempts: Mapping[tuple[str, str], Sequence[Attempt]]) -> None:
        """A round's outcomes, `attempts[(key, task)]` (a missing pair: no trial ran). A task
        none of whose trials has a reward is left out, for every candidate; otherwise an
        attempt without a reward counts 0, and a task's score is its attempts' mean."""
        self.next_task += len(played.tasks)
        self.rounds = played.number
        for key in played.candidates:
            candidate = self.candidates[key]
            for task in played.tasks:
                done = attempts.get((key, task), ())
                candidate.trials += len(done)
                candidate.errors += sum(a.error is not None for a in done)
                candidate.unscored += sum(a.reward is None for a in done)
                for attempt in done:
                    if attempt.error is not None:
                        candidate.failures[attempt.error] = (
                            candidate.failures.get(attempt.error, 0) + 1)
                self.trials += len(done)
        for task in played.tasks:
            every = [a for key in played.candidates for a in attempts.get((key, task), ())]
            if not any(a.reward is not None for a in every):
                errors = sorted({a.error for a in every if a.error})
                self.left_out.append(LeftOutTask(task=task, reason=(
                    "no trial of it has a reward (" + (", ".join(errors) or "not verified")
                    + "): left out for every candidate")))
                continue
            self.task_order.append(task)
            scores = np.zeros((1, len(self.keys)))
            for key in played.candidates:
                done = attempts.get((key, task), ())
                rewards = [0.0 if a.reward is None else min(1.0, max(0.0, a.reward))
                           for a in done]
                score = sum(rewards) / len(rewards) if rewards else 0.0
                self.candidates[key].scores[task] = score
                scores[0, self.keys.index(key)] = score
            self.rule.observe(scores)
        leader = self.leader()
        stopped = self.rule.end_round()[0]
        for key, now in zip(self.keys, stopped, strict=True):
            if now:
                self.candidates[key].stopped_round = played.number
                if self.rule.verdicts[0, self.keys.index(key)] == Verdict.WORSE:
                    self.candidates[key].behind = leader

    def leader(self) -> str | None:
        """The candidate not dropped with the highest mean (the first on a tie)."""
        best: tuple[float, str] | None = None
        for key in self.keys:
            if self._verdict(key) == Verdict.WORSE and self.settings.baseline is None:
                continue
            scores = self.candidates[key].scores
            if scores:
                mean = sum(scores.values()) / len(scores)
                if best is None or mean > best[0]:
                    best = (mean, key)
        return best[1] if best else None

    def _verdict(self, key: str) -> int:
        return int(self.rule.verdicts[0, self.keys.index(key)])

    def interrupt(self) -> None:
        """The race was stopped from outside (Ctrl-C): the report says so."""
        self.interrupted = True
        self.stop_reason = "interrupted"

    def report(self) -> RaceReport:
        finished = self.stop_reason is not None and not self.interrupted
        reference = self.settings.baseline or self.leader()
        pairs = len(self.keys) * (len(self.keys) - 1) // 2
        standings = [self._standing(key, reference, pairs) for key in self.keys]
        full = len(self.keys) * (len(self.tasks)) * self.settings.attempts
        return RaceReport(
            settings=self.settings, finished=finished, stop_reason=self.stop_reason,
            rounds=self.rounds, leader=self.leader(),
            global_evidence=float(self.rule.global_evidence[0]),
            gate_open=None if self.settings.familywise else bool(self.rule.gate[0]),
            candidates=standings,
            task_order=list(self.task_order), left_out=list(self.left_out),
            trials=self.trials, full_trials=full, trials_saved=max(0, full - self.trials),
            share=self.trials / full if full else 0.0,
        )

    def _standing(self, key: str, reference: str | None, pairs: int) -> CandidateStanding:
        candidate = self.candidates[key]
        index = self.keys.index(key)
        difference = low = high = None
        if reference is not None and reference != key:
            other = self.candidates[reference].scores
            common = [t for t in self.task_order if t in candidate.scores and t in other]
            if common:
                diffs = [candidate.scores[t] - other[t] for t in common]
                difference = sum(diffs) / len(diffs)
                # Simultaneous over every pair: the reference is chosen by the data.
                low, high = betting_interval(diffs, self.settings.alpha / pairs)
        evidence = self.rule.evidence.wealth[0][self.rule.subjects == index]
        scores = candidate.scores
        return CandidateStanding(
            key=key, name=candidate.name, status=self._status(key), tasks=len(scores),
            trials=candidate.trials, errors=candidate.errors,
            failures=dict(sorted(candidate.failures.items())), unscored=candidate.unscored,
            mean_reward=sum(scores.values()) / len(scores) if scores else None,
            difference=difference, ci_low=low, ci_high=high,
            evidence=float(evidence.max()) if len(evidence) else 1.0,
            stopped_round=candidate.stopped_round, behind=candidate.behind,
        )

    def _status(self, key: str) -> Status:
        verdict = self._verdict(key)
        if key == self.settings.baseline:
            return "baseline"
        if verdict == Verdict.RUNNING:
            return "running"
        if verdict == Verdict.BETTER:
            return "better"
        if verdict == Verdict.WORSE:
            return "dropped" if self.settings.baseline is None else "worse"
        if self.settings.baseline is not None:
            return "undecided"
        return "survived"
