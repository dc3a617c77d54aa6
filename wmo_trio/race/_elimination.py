"""Who runs, who stops: the race's rule over per-task scores, for a batch of races.

Two families of hypotheses (docs/race.md, "The method"):

- a race (no baseline): for each candidate j, "j is among the best"; its e-process bets on
  D = X_c - X_j, c the leader among the other running candidates when the round began.
  Rejected: j is worse than some candidate, and stops.
- against a baseline: for each other candidate j, "j is not better than the baseline"
  (bets on X_j - X_base) and "j is not worse" (bets on X_base - X_j). Either rejected:
  j is shown better or worse, and stops.

Scores are per-task means in [0, 1]; a task is observed by every running candidate (the
caller runs them all on it). Pure numpy: `Elimination` holds one row per race.
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
    kelly_bets,
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
        # The candidate each one was shown worse than (a race), or -1.
        self.beaten_by: Ints = np.full(shape, -1, dtype=np.int64)
        if baseline is None:
            self.subjects: Ints = np.arange(candidates, dtype=np.int64)
        else:
            others = np.array([j for j in range(candidates) if j != baseline], dtype=np.int64)
            self.subjects = np.concatenate([others, others])  # "not better", then "not worse"
        self.evidence = Evidence.start((races, len(self.subjects)))
        self.rejected: Bools = np.zeros((races, len(self.subjects)), dtype=bool)
        self.against: Ints = np.zeros((races, len(self.subjects)), dtype=np.int64)
        self._stop_finished()
        self.begin_round()

    @property
    def hypotheses(self) -> int:
        return len(self.subjects)

    def begin_round(self) -> None:
        """Fix each hypothesis's comparator for the coming round from the rounds before it
        (predictable: the choice cannot see the round's own scores)."""
        if self.baseline is None:
            self.against = comparators(self.sums, self.running)
        else:
            self.against = np.full(self.evidence.wealth.shape, self.baseline, dtype=np.int64)

    def observe(self, scores: npt.ArrayLike) -> None:
        """One task's scores, `scores[race, candidate]` in [0, 1] (read only where the
        candidate is running)."""
        x = np.where(self.running, np.asarray(scores, dtype=np.float64), 0.0)
        subject = x[:, self.subjects]
        other = np.take_along_axis(x, self.against, axis=-1)
        if self.baseline is None:
            differences = other - subject
        else:
            half = len(self.subjects) // 2
            differences = subject - other
            differences[:, half:] *= -1.0
        live = self.running[:, self.subjects] & ~self.rejected
        live &= np.take_along_axis(self.running, self.against, axis=-1)
        self.evidence.observe(differences, self._bets(), live)
        both = self.running[:, :, np.newaxis] & self.running[:, np.newaxis, :]
        step = x[:, :, np.newaxis] - x[:, np.newaxis, :]
        self.pair_total = np.where(both, self.pair_total + step, self.pair_total)
        self.pair_squares = np.where(both, self.pair_squares + step * step, self.pair_squares)
        self.sums = np.where(self.running, self.sums + x, self.sums)
        self.tasks = np.where(self.running, self.tasks + 1, self.tasks)

    def _bets(self) -> Floats:
        """Each hypothesis's stake from its pair's differences so far, signed as the
        hypothesis bets (on the comparator, or on or against the baseline)."""
        rows = np.arange(self.running.shape[0])[:, np.newaxis]
        subject = self.subjects[np.newaxis, :]
        if self.baseline is None:
            total = self.pair_total[rows, self.against, subject]
        else:
            half = len(self.subjects) // 2
            total = self.pair_total[rows, subject, self.against]
            total[:, half:] *= -1.0
        return kelly_bets(total, self.pair_squares[rows, self.against, subject])

    def end_round(self) -> Bools:
        """Reject what the closure rejects now, stop those candidates, and return which
        candidates stopped in this round (`[race, candidate]`)."""
        newly = closed_rejections(self.evidence.wealth, self.alpha) & ~self.rejected
        self.rejected |= newly
        stopping = np.zeros_like(self.running)
        rows, hyps = np.nonzero(newly)
        for row, h in zip(rows.tolist(), hyps.tolist(), strict=True):
            j = int(self.subjects[h])
            if not self.running[row, j]:
                continue
            stopping[row, j] = True
            if self.baseline is None:
                self.verdicts[row, j] = Verdict.WORSE
                self.beaten_by[row, j] = self.against[row, h]
            else:
                self.verdicts[row, j] = (Verdict.BETTER if h < len(self.subjects) // 2
                                         else Verdict.WORSE)
        self.running &= ~stopping
        stopping |= self._stop_finished()
        self.begin_round()
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
