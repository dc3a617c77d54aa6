"""Anytime-valid elimination of candidates: e-processes by betting, combined by averages.

Pure numpy, no harbor, no I/O: the harbor race, the research API's race and the
simulations in the tests and the benchmark all run these functions. Every array has a
leading batch axis (one row per race), so a thousand simulated races run as one.

The method, its assumptions and its references are in docs/race.md ("The method"). In
short: each hypothesis h ("candidate b is not worse than candidate a") has a test
supermartingale W_h = prod(1 + lambda_t * D_t) over the paired per-task differences
D_t = X_a - X_b in [-1, 1], with a predictable stake lambda_t in [0, BET_CAP] (the
universal portfolio's stake for the pair, `stakes`). By Ville's inequality a true
hypothesis's W ever reaches 1 / alpha with probability at most alpha, however often it is
looked at; so does the mean of the W of a set of true hypotheses. The race rejects h once
its W has, after the mean of the whole family has (per candidate), or once every mean of W
over a set of hypotheses holding h has (`closed_rejections`, family-wise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]
Ints = npt.NDArray[np.int64]

# The most of its wealth a hypothesis stakes on one task: 1 + lambda * D >= 1 - BET_CAP > 0
# for every D in [-1, 1], so one task never takes more than three quarters of it.
BET_CAP = 0.75
# The constant stakes the universal portfolio mixes, equally weighted: the midpoints of
# STAKE_GRID equal cells of [0, BET_CAP].
STAKE_GRID = 16
_STAKES = (np.arange(STAKE_GRID) + 0.5) / STAKE_GRID * BET_CAP
_LOG_WIN, _LOG_LOSS = np.log1p(_STAKES), np.log1p(-_STAKES)


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


def wins_and_losses(total: npt.ArrayLike, squares: npt.ArrayLike) -> tuple[Floats, Floats]:
    """A pair's history as the wins and losses it amounts to, from the sums of its
    differences D and of D^2: n+ - n- = sum(D), n+ + n- = sum(D^2). Exact for rewards of 0
    or 1 and one attempt (D in {-1, 0, 1}), a summary by the first two moments otherwise."""
    t = np.asarray(total, dtype=np.float64)
    q = np.asarray(squares, dtype=np.float64)
    return np.maximum((q + t) / 2, 0.0), np.maximum((q - t) / 2, 0.0)


def stakes(total: npt.ArrayLike, squares: npt.ArrayLike, *,
           prior_wins: npt.ArrayLike = 0.0, prior_losses: npt.ArrayLike = 0.0) -> Floats:
    """The stake on a pair's next difference D = X_a - X_b from the sums of D and D^2 over
    the tasks both ran before it (predictable): the stake of Cover's universal portfolio
    over the constant stakes in (0, BET_CAP], i.e. their mean weighted by the wealth each
    would have won on the pair's history (`wins_and_losses`), from a uniform prior over the
    grid `_STAKES`.

    `prior_wins` and `prior_losses` are counted as if the pair had won and lost them
    before its own history: the prior the race learns from its other pairs (a power
    prior; docs/race.md, "The stake"). The constant stake l's wealth is then
    (1 + l)^(n+ + prior wins) (1 - l)^(n- + prior losses). The stake only changes how fast
    the evidence grows: any stake fixed before the difference is seen keeps the wealth a
    test supermartingale.
    """
    wins, losses = wins_and_losses(total, squares)
    wins = wins + np.asarray(prior_wins, dtype=np.float64)
    losses = losses + np.asarray(prior_losses, dtype=np.float64)
    weight = np.multiply.outer(wins, _LOG_WIN)
    weight += np.multiply.outer(losses, _LOG_LOSS)
    weight -= weight.max(axis=-1, keepdims=True)
    np.exp(weight, out=weight)
    result: Floats = (weight @ _STAKES) / weight.sum(axis=-1)
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


def comparators(sums: npt.ArrayLike, running: npt.ArrayLike) -> Floats:
    """For each candidate j, the weights `[..., j, c]` of the running candidates it is held
    against: the leader among the others (the highest total score over the tasks every
    running candidate has run), the leaders' mean when several tie, so the rule does not
    depend on the order the candidates were given in (ties at the start are the rule, not
    the exception). The leader itself is held against the runner-up. A candidate with no
    running other gets no weight (its difference is then 0)."""
    totals = np.where(np.asarray(running, dtype=bool), np.asarray(sums, dtype=np.float64),
                      -np.inf)
    count = totals.shape[-1]
    eye = np.eye(count, dtype=bool)
    others = np.where(eye, -np.inf, totals[..., np.newaxis, :])  # [..., j, c]: c != j
    top = np.max(others, axis=-1, keepdims=True)
    # Equal up to the rounding of summed fractions (the means of -k attempts).
    leaders = (others >= top - 1e-9) & np.isfinite(others)
    result: Floats = leaders / np.maximum(leaders.sum(axis=-1, keepdims=True), 1)
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
