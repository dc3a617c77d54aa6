"""Simulated races: how often the rule errs and what it saves, under a stated model.

The model (docs/race.md, "How it was checked"): each race draws its own tasks. Task t's
difficulty for candidate i is z[t, i] = sqrt(rho) * u[t] + sqrt(1 - rho) * e[t, i] (u, e
standard normal), so rho is the correlation of a task's difficulty between candidates
(1: a task hard for one is as hard for all; 0: independent). Candidate i passes an attempt
of task t with probability Phi(a_i + spread * z[t, i]), a_i chosen so its mean over tasks
is `means[i]` (E Phi(a + s z) = Phi(a / sqrt(1 + s^2))); attempts are independent given
the task, and a task's score is the mean of its `attempts` pass/fail rewards. The tasks
come in a random order (they are drawn independently), in rounds of `batch` tasks (or, with
`concurrency`, of as many as the harbor race gives `-n concurrency`), every running
candidate on every task of a round: the race's own code (`Elimination`) decides.
Each race lists the candidates in an order of its own (a seeded shuffle), so no figure
depends on where the best one stands in the list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from wmo_trio.race._elimination import Elimination, Verdict
from wmo_trio.race._sequential import Bools, Floats, Ints


@dataclass(frozen=True)
class Scenario:
    means: tuple[float, ...]
    tasks: int = 200
    attempts: int = 1
    correlation: float = 0.0
    spread: float = 1.5
    batch: int = 5
    concurrency: int | None = None  # rounds sized as `-n concurrency` sizes them, not `batch`
    alpha: float = 0.05
    baseline: int | None = None
    familywise: bool = False

    def round_size(self, running: Ints) -> Ints:
        """Tasks in a race's next round, given its running candidates."""
        if self.concurrency is None:
            return np.full_like(running, self.batch)
        result: Ints = np.maximum(1, -(-self.concurrency // np.maximum(1, running
                                                                        * self.attempts)))
        return result


@dataclass(frozen=True)
class Simulated:
    """Per race: whether any declaration was false, whether a best candidate was dropped
    (a race) or a candidate declared worse than a baseline it is not worse than, and the
    share of the full evaluation's trials it ran; per race and candidate (in the
    scenario's order), its verdict and the tasks it ran."""

    false_declaration: Bools
    best_dropped: Bools
    share: Floats
    tasks_run: Ints
    verdicts: Ints

    @property
    def races(self) -> int:
        return len(self.share)


def scores(scenario: Scenario, races: int, rng: np.random.Generator) -> Floats:
    """Per-task scores `[race, task, candidate]` under the scenario's model."""
    count = len(scenario.means)
    rho, spread = scenario.correlation, scenario.spread
    from scipy.special import ndtr, ndtri

    shift = ndtri(np.asarray(scenario.means, dtype=np.float64)) * math.sqrt(1 + spread ** 2)
    shared = rng.standard_normal((races, scenario.tasks, 1))
    own = rng.standard_normal((races, scenario.tasks, count))
    difficulty = math.sqrt(rho) * shared + math.sqrt(1 - rho) * own
    p = ndtr(shift + spread * difficulty)
    # Attempts as uniforms under p: numpy's binomial sampler is several times slower.
    passes = (rng.random((scenario.attempts, *p.shape)) < p).sum(axis=0)
    result: Floats = passes / scenario.attempts
    return result


def simulate(scenario: Scenario, races: int, seed: int, *,
             rule: type[Elimination] = Elimination, shuffle: bool = True) -> Simulated:
    """`races` seeded races of the scenario, all at once, decided by `rule` (the race's
    own, or a variant for a benchmark's comparison). `tasks_run` is per candidate of the
    scenario (in its order), whatever place each race gave it; `shuffle=False` lists
    them in the scenario's order in every race."""
    rng = np.random.default_rng(seed)
    data = scores(scenario, races, rng)
    count = len(scenario.means)
    # place[r, i]: where race r lists candidate i; the baseline keeps its index, since
    # the rule singles it out by index, not by place.
    place = np.argsort(rng.random((races, count)), axis=-1)
    if scenario.baseline is not None or not shuffle:
        place[:] = np.arange(count)
    listed = np.empty_like(data)
    np.put_along_axis(listed, np.broadcast_to(place[:, np.newaxis, :], data.shape), data,
                      axis=-1)
    decider = rule(races, count, alpha=scenario.alpha, baseline=scenario.baseline,
                   familywise=scenario.familywise)
    left = np.zeros(races, dtype=np.int64)  # tasks left in each race's round
    for t in range(scenario.tasks):
        if not decider.active.any():
            break
        starting = left == 0
        left[starting] = scenario.round_size(decider.running[starting].sum(axis=-1))
        decider.observe(listed[:, t, :])
        left -= 1
        decider.end_round((left == 0) | (t == scenario.tasks - 1))
    decider.finish()
    verdicts = np.take_along_axis(decider.verdicts, place, axis=-1)  # in scenario order
    tasks_run = np.take_along_axis(decider.tasks, place, axis=-1)
    means = np.asarray(scenario.means)
    worse = verdicts == Verdict.WORSE
    if scenario.baseline is None:
        false = (worse & np.isclose(means, means.max())).any(axis=-1)
        best_dropped = false
    else:
        base = means[scenario.baseline]
        better = verdicts == Verdict.BETTER
        false_worse = (worse & (means >= base - 1e-12)).any(axis=-1)
        false_better = (better & (means <= base + 1e-12)).any(axis=-1)
        false = false_worse | false_better
        best_dropped = false_worse
    share = tasks_run.sum(axis=-1) / (count * scenario.tasks)
    return Simulated(false_declaration=false, best_dropped=best_dropped, share=share,
                     tasks_run=tasks_run, verdicts=verdicts)


def binomial_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a rate, by scipy."""
    from scipy.stats import binomtest

    ci = binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)
