"""The race's error rates and savings on simulated races: `python -m benchmarks.race
[--quick] [--races N]`.

Runs the race's own rule (`wmo_trio.race._elimination`) on seeded simulated races
(`wmo_trio.race._simulation`, its model described in docs/race.md) for the three checks of
issue 37 under independent (rho 0) and correlated (rho 0.5, 0.9) candidates, and prints a
Markdown table: each error rate with its exact 95 % binomial interval, and the mean share
of the full evaluation's trials with its standard error. A second table takes the clearly
better candidate at rho 0 apart: the same races decided by variants of the rule that a
race cannot run (they are not valid, or they know which candidate is best), to show where
the trials go. `--quick` runs 200 races per row (a shape check for `make bench-quick`);
the full run 10,000.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from wmo_trio.race._elimination import Elimination
from wmo_trio.race._sequential import Bools, Floats, comparators
from wmo_trio.race._simulation import Scenario, Simulated, binomial_interval, simulate

CLEAR = (0.75,) + (0.5,) * 7
ROWS: list[tuple[str, tuple[float, ...], int | None, int]] = [
    ("equal means, 8 candidates (a)", (0.5,) * 8, None, 5),
    ("one 0.25 better, 8 candidates (b, c)", CLEAR, None, 5),
    ("the same, rounds of 1 task (b, c)", CLEAR, None, 1),
    ("one 0.05 better, 8 candidates (b)", (0.55,) + (0.5,) * 7, None, 5),
    ("against a baseline, 4 equal to it (a)", (0.5,) * 5, 0, 5),
    ("against a baseline: 0.8, 0.2, 0.5 vs 0.5", (0.5, 0.8, 0.2, 0.5), 0, 5),
]


class Uncorrected(Elimination):
    """Each hypothesis rejected on its own e-process alone (W >= 1 / alpha): no correction
    for the multiplicity, so not valid (with ties at the top it errs up to K times alpha).
    What no closure of these e-processes can beat."""

    def _rejections(self) -> Bools:
        result: Bools = self.evidence.wealth >= 1.0 / self.alpha
        return result


class KnownBest(Elimination):
    """Every other candidate held against candidate 0 from the first task: the comparator
    a race would pick if it knew which candidate is best (simulate with shuffle=False and
    the best first)."""

    def _against(self) -> Floats:
        weights = comparators(self.sums, self.running)
        weights[:, 1:, :] = 0.0
        weights[:, 1:, 0] = self.running[:, np.newaxis, 0]
        return weights


class KnownBestUncorrected(KnownBest, Uncorrected):
    """Both of the above."""


class KnownBestKellyStake(KnownBestUncorrected):
    """And the stake fixed at 0.5, the Kelly stake of this scenario's gap at rho 0 (a race
    cannot know it: it is the gap's, not a rule's)."""

    def _bets(self, against: Floats) -> Floats:
        result: Floats = np.where(against.sum(axis=-1) > 0, 0.5, 0.0)
        return result


VARIANTS: list[tuple[str, type[Elimination]]] = [
    ("the race (valid)", Elimination),
    ("no multiplicity correction (not valid)", Uncorrected),
    ("the best known in advance as comparator", KnownBest),
    ("both", KnownBestUncorrected),
    ("both, and the stake fixed at this gap's Kelly stake 0.5", KnownBestKellyStake),
]


def rate(count: int, total: int) -> str:
    low, high = binomial_interval(count, total)
    return f"{count / total:.4f} [{low:.4f}, {high:.4f}]"


def share(result: Simulated) -> str:
    error = result.share.std(ddof=1) / np.sqrt(result.races)
    return f"{result.share.mean():.3f} ± {error:.3f}, {result.share.max():.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--races", type=int, default=None)
    args = parser.parse_args()
    races = args.races or (200 if args.quick else 10_000)
    print(f"{races} races per row, 200 tasks, 1 attempt, alpha 0.05, rounds of 5 tasks "
          "unless said\n")
    print("| scenario | rho | any false verdict | best dropped / wrongly worse | share of "
          "trials (mean ± s.e., max) | seconds |")
    print("|---|---|---|---|---|---|")
    for seed, (label, means, baseline, batch) in enumerate(ROWS):
        for rho in (0.0, 0.5, 0.9):
            started = time.perf_counter()
            result = simulate(Scenario(means=means, correlation=rho, baseline=baseline,
                                       batch=batch), races, seed=1000 * seed + int(rho * 10))
            print(f"| {label} | {rho} | {rate(int(result.false_declaration.sum()), races)} | "
                  f"{rate(int(result.best_dropped.sum()), races)} | {share(result)} | "
                  f"{time.perf_counter() - started:.1f} |", flush=True)
    print("\nWhere the trials go: one 0.25 better among 8, rho 0, the same races for each "
          "variant (the best listed first)\n")
    print("| rule | rounds of 5: share (mean ± s.e., max) | rounds of 1 |")
    print("|---|---|---|")
    for label, rule in VARIANTS:
        cells = [share(simulate(Scenario(means=CLEAR, batch=batch), races, seed=77,
                                rule=rule, shuffle=False)) for batch in (5, 1)]
        print(f"| {label} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
