"""Who runs, who stops: the race's rule over per-task scores, for a batch of races.

Two families of hypotheses (docs/race.md, "The method"):

- a race (no baseline): for each candidate j, "j is among the best"; its e-process bets on
  D = X_c - X_j, c the leader among the other running candidates over the tasks before
  this one (the tied leaders' mean on a tie). Rejected: j is worse than some candidate,
  and stops at the end of the round.
- against a baseline: for each other candidate j, "j is not better than the baseline"
  (bets on X_j - X_base) and "j is not worse" (bets on X_base - X_j). Either rejected:
  j is shown better or worse, and stops.

Two ways to reject (docs/race.md, "The multiplicity"), looked at after every task
(Ville's inequality holds at every time):

- per candidate (the default): a gate per race, the global null (every hypothesis true)
  rejected once the mean of all the e-processes has reached 1 / alpha, open for good once
  open; then each hypothesis whose own e-process has reached 1 / alpha, at any task.
  Each true hypothesis is rejected with probability at most alpha, and with every
  hypothesis true nothing is rejected with probability at least 1 - alpha.
- `familywise`: the closure of the family under the arithmetic mean (e-Holm): the chance
  that any true hypothesis is rejected is at most alpha.

Scores are per-task means in [0, 1]; a task is observed by every running candidate (the
caller runs them all on it). Everything a stake or a comparator reads comes from the tasks
before the one it bets on, in the race's task order, whatever round they ran in. A
rejected hypothesis stops betting at once, its candidate at the end of the round.
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
    wins_and_losses,
)


class Verdict(IntEnum):
    RUNNING = 0
    WORSE = -1      # shown worse than another candidate (a race) or than the baseline
    BETTER = 1      # shown better than the baseline
    UNDECIDED = 2   # stopped without a verdict: the race ended with it still running


class Elimination:
    """The state of `races` races of `candidates` candidates at level `alpha`; with
    `baseline` (a candidate's index) each other candidate is held against it alone; with
    `familywise`, rejections by the closure instead of per candidate."""

    def __init__(self, races: int, candidates: int, *, alpha: float,
                 baseline: int | None = None, familywise: bool = False) -> None:
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
        self.familywise = familywise
        # Per candidate: whether each race's global null has been rejected (the gate), and
        # which hypotheses' own e-process has reached 1 / alpha at some task so far. Both
        # are Ville events about the whole path, so once true they stay true.
        self.gate: Bools = np.zeros(races, dtype=bool)
        self.reached: Bools = np.zeros((races, len(self.subjects)), dtype=bool)
        self._stop_finished()

    @property
    def hypotheses(self) -> int:
        return len(self.subjects)

    @property
    def global_evidence(self) -> Floats:
        """Per race, the e-process of the global null (every hypothesis true): the mean of
        the hypotheses' e-processes, one test supermartingale under it."""
        result: Floats = self.evidence.wealth.mean(axis=-1)
        return result

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
        candidate is running), then the rule's rejections as they stand after it."""
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
        """What the rule rejects now (docs/race.md, "The multiplicity").

        Per candidate: the gate opens once the mean of every hypothesis's e-process (the
        global null's test) reaches 1 / alpha; then every hypothesis whose own e-process
        has reached 1 / alpha, now or at an earlier task. With `familywise`, the closure by
        averages; only races where some wealth has reached 1 / alpha are sorted, since the
        closure rejects nothing whose own wealth (the set of it alone) is below."""
        wealth = self.evidence.wealth
        threshold = 1.0 / self.alpha
        if not self.familywise:
            self.reached |= wealth >= threshold
            self.gate |= self.global_evidence >= threshold
            gated: Bools = self.gate[:, np.newaxis] & self.reached
            return gated
        result: Bools = np.zeros(wealth.shape, dtype=bool)
        rows = np.flatnonzero((wealth >= threshold).any(axis=-1))
        result[rows] = closed_rejections(wealth[rows], self.alpha)
        return result

    def _bets(self, against: Floats) -> Floats:
        """Each hypothesis's stake: its comparators' weighted stakes, each from the pair's
        history (`stakes`), signed as the hypothesis bets (on the comparator, or on or
        against the baseline). Only the pairs with a weight are priced; a hypothesis
        without one stakes 0.

        In a race (no baseline) the pair's own history is preceded by a prior: the
        comparator's histories against the other candidates, together counted as one
        pair's worth (each at weight 1 / (candidates - 2)), so the stake learns how far a
        leader is ahead in this race from all of the leader's pairs at once (docs/race.md,
        "The stake"). Against a baseline its pairs point both ways by design, and each
        pair's stake reads its own history alone."""
        race, h, c = np.nonzero(against)
        j = self.subjects[h]
        total = self.pair_total[race, c, j]
        prior_wins: Floats | float = 0.0
        prior_losses: Floats | float = 0.0
        if self.baseline is not None:
            total = np.where(h < len(self.subjects) // 2, -total, total)
        elif self.count > 2:
            # The comparator's histories against everyone but j (the diagonal is 0), each
            # at 1 / (candidates - 2): one pair's worth.
            wins, losses = wins_and_losses(self.pair_total, self.pair_squares)
            weight = 1.0 / (self.count - 2)
            prior_wins = (wins.sum(axis=-1)[race, c] - wins[race, c, j]) * weight
            prior_losses = (losses.sum(axis=-1)[race, c] - losses[race, c, j]) * weight
        weighted = against[race, h, c] * stakes(total, self.pair_squares[race, c, j],
                                                prior_wins=prior_wins,
                                                prior_losses=prior_losses)
        shape = against.shape[:-1]
        result: Floats = np.bincount(race * shape[1] + h, weighted,
                                     minlength=shape[0] * shape[1]).reshape(shape)
        return result

    def end_round(self, ending: Bools | None = None) -> Bools:
        """Stop the candidates whose hypotheses are rejected, in the races whose round ends
        (`ending[race]`, default all), and return which candidates stopped
        (`[race, candidate]`)."""
        live = self.running.copy()
        if ending is not None:
            live &= np.asarray(ending, dtype=bool)[:, np.newaxis]
        better = np.zeros_like(live)
        worse = np.zeros_like(live)
        if self.baseline is None:
            worse[:, self.subjects] = self.rejected
        else:
            half = len(self.subjects) // 2
            better[:, self.subjects[:half]] = self.rejected[:, :half]
            worse[:, self.subjects[half:]] = self.rejected[:, half:]
        better &= live
        worse &= live
        # Shown both better and worse (only a false rejection can do it): worse.
        self.verdicts = np.where(worse, Verdict.WORSE,
                                 np.where(better, Verdict.BETTER, self.verdicts))
        stopping = better | worse
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
