"""Who runs, who stops: the race's rule over per-task scores, for a batch of races.

Two families of hypotheses (docs/race.md, "The method"):

- a race (no baseline): for each candidate j, "j is among the best"; its e-process bets on
  D = X_c - X_j, c the leader among the other running candidates over the tasks before
  this one (the tied leaders' mean on a tie). Rejected: j is worse than some candidate,
  and stops at the end of the round.
- against a baseline: for each other candidate j, "j is not better than the baseline"
  (bets on X_j - X_base) and "j is not worse" (bets on X_base - X_j). Either rejected:
  j is shown better or worse, and stops.

Scores are per-task means in [0, 1]; a task is observed by every running candidate (the
caller runs them all on it). Everything a stake or a comparator reads comes from the tasks
before the one it bets on, in the race's task order, whatever round they ran in; the
closure is looked at after every task (Ville's inequality holds at every time), and a
hypothesis it rejects stops betting at once, its candidate at the end of the round.
Pure numpy: `Elimination` holds one row per race.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import numpy.typing as npt

from wmo_trio.race._sequential import (
    Bools,
    Evidence,
    Floats,
    Ints,
    closed_rejections,
    comparators,
    stakes,
)


class Verdict(IntEnum):
    RUNNING = 0
    WORSE = -1      # shown worse than another candidate (a race) or than the baseline
    BETTER = 1      # shown better than the baseline
    UNDECIDED = 2   # stopped without a verdict: the race ended with it still running


class Elimination:
    """The state of `races` races of `candidates` candidates at level `alpha`; with
    `baseline` (a candidate's index) each other candidate is held against it alone."""

    def __init__(self, races: int, candidates: int, *, alpha: float,
                 baseline: int | None = None) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha={alpha}: give a level in (0, 1), e.g. 0.05")
        if candidates < 1:
            raise ValueError("a race needs at least one candidate")
        if baseline is not None and not 0 <= baseline < candidates:
            raise ValueError(f"baseline {baseline} is not a candidate's index")
        self.alpha = alpha
        self.baseline = baseline
        self.count = candidates
        shape = (races, candidates)
        self.running: Bools = np.ones(shape, dtype=bool)
        self.sums: Floats = np.zeros(shape)
        self.tasks: Ints = np.zeros(shape, dtype=np.int64)
        # Paired sums over the tasks both ran: [i, j] sums X_i - X_j, and its square. A
        # hypothesis's bet reads its pair's whole history, whatever it was held against.
        self.pair_total: Floats = np.zeros((races, candidates, candidates))
        self.pair_squares: Floats = np.zeros((races, candidates, candidates))
        self.verdicts: Ints = np.zeros(shape, dtype=np.int64)
        if baseline is None:
            self.subjects: Ints = np.arange(candidates, dtype=np.int64)
        else:
            others = np.array([j for j in range(candidates) if j != baseline], dtype=np.int64)
            self.subjects = np.concatenate([others, others])  # "not better", then "not worse"
        self.evidence = Evidence.start((races, len(self.subjects)))
        self.rejected: Bools = np.zeros((races, len(self.subjects)), dtype=bool)
        self._stop_finished()

    @property
    def hypotheses(self) -> int:
        return len(self.subjects)

    def _against(self) -> Floats:
        """Each hypothesis's comparator as weights over the candidates, `[race, h, c]`, from
        the tasks seen so far (predictable: it cannot see the task it bets on)."""
        if self.baseline is None:
            return comparators(self.sums, self.running)
        weights = np.zeros((*self.evidence.wealth.shape, self.count))
        weights[..., self.baseline] = self.running[:, np.newaxis, self.baseline]
        return weights

    def observe(self, scores: npt.ArrayLike) -> None:
        """One task's scores, `scores[race, candidate]` in [0, 1] (read only where the
        candidate is running), then the closure's rejections as they stand after it."""
        x = np.where(self.running, np.asarray(scores, dtype=np.float64), 0.0)
        against = self._against()
        subject = x[:, self.subjects]
        other = np.einsum("rhc,rc->rh", against, x)
        differences = other - subject
        if self.baseline is not None:  # "not better" bets on X_j - X_base; "not worse" on the other
            differences[:, : len(self.subjects) // 2] *= -1.0
        live = self.running[:, self.subjects] & ~self.rejected
        against *= live[..., np.newaxis]  # a rejected hypothesis bets no more: not priced
        self.evidence.observe(differences, self._bets(against), live)
        both = self.running[:, :, np.newaxis] & self.running[:, np.newaxis, :]
        step = (x[:, :, np.newaxis] - x[:, np.newaxis, :]) * both
        self.pair_total += step
        self.pair_squares += step * step
        self.sums = np.where(self.running, self.sums + x, self.sums)
        self.tasks = np.where(self.running, self.tasks + 1, self.tasks)
        self.rejected |= self._rejections()

    def _rejections(self) -> Bools:
        """What the closure of the family rejects now (docs/race.md, "The multiplicity").
        Only races where some wealth has reached 1 / alpha are sorted: the closure rejects
        nothing whose own wealth (the set of it alone) is below."""
        wealth = self.evidence.wealth
        result: Bools = np.zeros(wealth.shape, dtype=bool)
        rows = np.flatnonzero((wealth >= 1.0 / self.alpha).any(axis=-1))
        result[rows] = closed_rejections(wealth[rows], self.alpha)
        return result

    def _bets(self, against: Floats) -> Floats:
        """Each hypothesis's stake: its comparators' weighted stakes, each from the pair's
        history (`stakes`), signed as the hypothesis bets (on the comparator, or on or
        against the baseline). Only the pairs with a weight are priced; a hypothesis
        without one stakes 0."""
        race, h, c = np.nonzero(against)
        j = self.subjects[h]
        total = self.pair_total[race, c, j]
        if self.baseline is not None:
            total = np.where(h < len(self.subjects) // 2, -total, total)
        result: Floats = np.zeros(against.shape[:-1])
        np.add.at(result, (race, h),
                  against[race, h, c] * stakes(total, self.pair_squares[race, c, j]))
        return result

    def end_round(self) -> Bools:
        """Stop the candidates whose hypotheses the closure has rejected, and return which
        candidates stopped in this round (`[race, candidate]`)."""
        stopping = np.zeros_like(self.running)
        rows, hyps = np.nonzero(self.rejected)
        for row, h in zip(rows.tolist(), hyps.tolist(), strict=True):
            j = int(self.subjects[h])
            if not self.running[row, j]:
                continue
            stopping[row, j] = True
            if self.baseline is None:
                self.verdicts[row, j] = Verdict.WORSE
            else:
                self.verdicts[row, j] = (Verdict.BETTER if h < len(self.subjects) // 2
                                         else Verdict.WORSE)
        self.running &= ~stopping
        stopping |= self._stop_finished()
        return stopping

    def _stop_finished(self) -> Bools:
        """Races with nothing left to decide stop: one candidate left, or (against a
        baseline) the baseline alone. What stops here stops undecided."""
        if self.baseline is None:
            done = self.running.sum(axis=-1) <= 1
        else:
            others = self.running.copy()
            others[:, self.baseline] = False
            done = ~others.any(axis=-1)
        stopping = self.running & done[:, np.newaxis]
        self.running &= ~stopping
        self.verdicts = np.where(stopping, Verdict.UNDECIDED, self.verdicts)
        return stopping

    def finish(self) -> None:
        """The race ends (tasks or budget spent): whoever still runs stops undecided."""
        self.verdicts = np.where(self.running, Verdict.UNDECIDED, self.verdicts)
        self.running[:] = False

    @property
    def active(self) -> Bools:
        """Races still going."""
        result: Bools = self.running.any(axis=-1)
        return result
