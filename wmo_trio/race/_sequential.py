"""Anytime-valid elimination of candidates: e-processes by betting, closed by averages.

Pure numpy, no harbor, no I/O: the harbor race, the research API's race and the
simulations in the tests and the benchmark all run these functions. Every array has a
leading batch axis (one row per race), so a thousand simulated races run as one.

The method, its assumptions and its references are in docs/race.md ("The method"). In
short: each hypothesis h ("candidate b is not worse than candidate a") has a test
supermartingale W_h = prod(1 + lambda_t * D_t) over the paired per-task differences
D_t = X_a - X_b in [-1, 1], with a predictable bet lambda_t in [0, BET_CAP]; the closure
of the family under the arithmetic mean rejects h once every average of W over a set of
hypotheses holding h reaches 1 / alpha, which keeps the chance of any false rejection, at
any time of the race however often it is looked at, at most alpha.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]
Ints = npt.NDArray[np.int64]

# The most of its wealth a hypothesis stakes on one task: 1 + lambda * D >= 1 - BET_CAP > 0
# for every D in [-1, 1], so the wealth never reaches zero on one bad task.
BET_CAP = 0.5
# The bet's prior: this many pseudo-tasks of squared difference 1 in the denominator, so
# the first tasks' bets stay small (aGRAPA's plug-in is wild on two or three tasks).
PRIOR_TASKS = 2.0


def closed_rejections(wealth: npt.ArrayLike, alpha: float) -> Bools:
    """Which hypotheses the closure of the family rejects at level `alpha`.

    `wealth[..., h]` is hypothesis h's e-process now. The intersection of a set S of
    hypotheses is tested by the mean of their e-processes (a mean of test
    supermartingales of one filtration is one under the intersection); h is rejected when
    every set holding h has a mean of at least 1 / alpha. The lowest such mean takes h
    with the m smallest others, for the best m, so it is found by one sort.
    """
    values = np.asarray(wealth, dtype=np.float64)
    count = values.shape[-1]
    order = np.argsort(values, axis=-1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=-1)
    prefix = np.cumsum(ordered, axis=-1)
    prefix = np.concatenate([np.zeros_like(prefix[..., :1]), prefix], axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(count), axis=-1)
    m = np.arange(count)  # how many others join h
    # The sum of the m smallest others: the first m of the order when h's own place is
    # past them, else the first m + 1 less h itself.
    before = prefix[..., np.newaxis, :count]
    after = prefix[..., np.newaxis, 1:] - values[..., :, np.newaxis]
    others = np.where(m < rank[..., :, np.newaxis] + 1, before, after)
    lowest_mean = np.min((values[..., :, np.newaxis] + others) / (1 + m), axis=-1)
    result: Bools = lowest_mean >= 1.0 / alpha
    return result


def kelly_bets(total: npt.ArrayLike, squares: npt.ArrayLike) -> Floats:
    """The stake on the next difference from the sums of the differences seen before it
    (predictable): the approximate Kelly fraction mean(D) / mean(D^2) (aGRAPA,
    Waudby-Smith and Ramdas 2023, section 5), with PRIOR_TASKS pseudo-tasks of D^2 = 1,
    never below 0 (a bet against the hypothesis only) nor above BET_CAP."""
    result: Floats = np.clip(np.asarray(total, dtype=np.float64)
                             / (np.asarray(squares, dtype=np.float64) + PRIOR_TASKS),
                             0.0, BET_CAP)
    return result


@dataclass
class Evidence:
    """The e-processes of a family of hypotheses, for a batch of races (`wealth`), and how
    many differences each has bet on (`seen`)."""

    wealth: Floats
    seen: Floats = field(init=False)

    def __post_init__(self) -> None:
        self.seen = np.zeros_like(self.wealth)

    @classmethod
    def start(cls, shape: tuple[int, ...]) -> Evidence:
        return cls(np.ones(shape))

    def observe(self, differences: npt.ArrayLike, bets: npt.ArrayLike,
                mask: npt.ArrayLike) -> None:
        """One task's differences D = X_a - X_b in [-1, 1] and the stakes on them, fixed
        before the task was seen, for the hypotheses in `mask` (the others do not bet on
        this task, and their wealth stays)."""
        d = np.clip(np.nan_to_num(np.asarray(differences, dtype=np.float64)), -1.0, 1.0)
        stake = np.clip(np.asarray(bets, dtype=np.float64), 0.0, BET_CAP)
        on = np.asarray(mask, dtype=bool)
        self.wealth = np.where(on, self.wealth * (1.0 + stake * d), self.wealth)
        self.seen = np.where(on, self.seen + 1, self.seen)


def comparators(sums: npt.ArrayLike, running: npt.ArrayLike) -> Ints:
    """For each candidate, the running candidate it is held against: the leader (the
    highest total score over the tasks every running candidate has run) other than
    itself; the leader itself is held against the runner-up. Ties go to the lower index.
    A candidate with no running other gets itself (its difference is then 0)."""
    totals = np.where(np.asarray(running, dtype=bool), np.asarray(sums, dtype=np.float64),
                      -np.inf)
    count = totals.shape[-1]
    eye = np.eye(count, dtype=bool)
    others = np.where(eye, -np.inf, totals[..., np.newaxis, :])  # [..., j, i]: i != j
    best = np.argmax(others, axis=-1)
    alone = np.isneginf(np.max(others, axis=-1))
    result: Ints = np.where(alone, np.arange(count), best).astype(np.int64)
    return result


def betting_interval(differences: npt.ArrayLike, alpha: float,
                     grid: int = 2001) -> tuple[float, float]:
    """A 1 - alpha confidence sequence for the mean of paired differences in [-1, 1], at
    its current time: the hedged betting CS of Waudby-Smith and Ramdas (2023, Theorem 3,
    predictable plug-in bets), on the differences mapped to [0, 1]. The set of means not
    rejected, as its hull (on a grid of `grid` points). No difference: [-1, 1]."""
    d = np.asarray(differences, dtype=np.float64).ravel()
    if len(d) == 0:
        return -1.0, 1.0
    x = (np.clip(d, -1.0, 1.0) + 1.0) / 2.0
    n = len(x)
    t = np.arange(1, n + 1)
    # The plug-in estimates before each observation, with one prior pseudo-observation.
    mean_before = (0.5 + np.concatenate([[0.0], np.cumsum(x)[:-1]])) / t
    mean_after = (0.5 + np.cumsum(x)) / (t + 1)
    variance_after = (0.25 + np.cumsum((x - mean_after) ** 2)) / (t + 1)
    variance_before = np.concatenate([[0.25], variance_after[:-1]])
    del mean_before  # the plug-in bet uses the variance only
    lam = np.sqrt(2.0 * np.log(2.0 / alpha) / (variance_before * t * np.log(t + 1.0)))
    m = np.linspace(0.0, 1.0, grid)[:, np.newaxis]
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.minimum(lam, 0.5 / m)
        down = np.minimum(lam, 0.5 / (1.0 - m))
        log_up = np.sum(np.log1p(up * (x - m)), axis=1)
        log_down = np.sum(np.log1p(-down * (x - m)), axis=1)
    wealth = 0.5 * np.exp(np.minimum(log_up, 700)) + 0.5 * np.exp(np.minimum(log_down, 700))
    kept = np.flatnonzero(wealth < 1.0 / alpha)
    if len(kept) == 0:  # numerically everything rejected: the sample mean alone
        centre = float(np.mean(d))
        return centre, centre
    values = m[:, 0]
    return float(2.0 * values[kept[0]] - 1.0), float(2.0 * values[kept[-1]] - 1.0)
