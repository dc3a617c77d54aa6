"""The race's error rates and savings on simulated races, for both controls:
`python -m benchmarks.race [--quick] [--races N] [--only TABLE]`.

Runs the race's own rule (`wmo_trio.race._elimination`) on seeded simulated races
(`wmo_trio.race._simulation`, its model described in docs/race.md) and prints the Markdown
tables of docs/race.md ("How it was checked"), each error rate with its exact 95 %
binomial interval and each mean share of the full evaluation's trials with its standard
error:

- `checks`: the three checks of issue 37 under independent (rho 0) and correlated (rho 0.5,
  0.9) candidates, per candidate and family-wise;
- `clear`: (c), the share of trials with one candidate 0.25 better among 8, at rho 0 and
  0.5, rounds as `-n 4` and `-n 40` size them, both controls (seeds of its own);
- `gaps`: (c) for one better candidate among 8 across gaps and base rates, rho 0 (the
  hardest base rate for a gap is the one that centres the pair on 0.5);
- `tied`: several candidates tied for best: how often each, any and all of them are
  dropped (what per candidate controls and what it does not);
- `variants`: the clearly better candidate at rho 0 decided by variants of the rule that a
  race cannot run (not valid, or knowing which candidate is best), to show where the
  trials go.

`--quick` runs 200 races per row (a shape check for `make bench-quick`); the full run
10,000 (about an hour of one core).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from wmo_trio.race._elimination import Elimination, Verdict
from wmo_trio.race._sequential import Bools, Floats, comparators
from wmo_trio.race._simulation import Scenario, Simulated, binomial_interval, simulate

CLEAR = (0.75,) + (0.5,) * 7
CONTROLS = (("per candidate", False), ("family-wise", True))
# (label, means, baseline, rounds): rounds as `-n` sizes them in the harbor race.
CHECKS: list[tuple[str, tuple[float, ...], int | None, int]] = [
    ("equal means, 8 candidates (a)", (0.5,) * 8, None, 4),
    ("one 0.25 better, 8 candidates, -n 4 (b, c)", CLEAR, None, 4),
    ("the same, -n 40 (b, c)", CLEAR, None, 40),
    ("one 0.05 better, 8 candidates (b)", (0.55,) + (0.5,) * 7, None, 4),
    ("against a baseline, 4 equal to it (a)", (0.5,) * 5, 0, 4),
    ("against a baseline: 0.8, 0.2, 0.5 vs 0.5", (0.5, 0.8, 0.2, 0.5), 0, 4),
]
TIED: list[tuple[str, tuple[float, ...], int]] = [
    ("3 of 5 tied: 0.7 x 3, 0.5 x 2", (0.7, 0.7, 0.7, 0.5, 0.5), 3),
    ("4 of 8 tied: 0.5 x 4, 0.1 x 4", (0.5,) * 4 + (0.1,) * 4, 4),
    ("7 of 8 tied: 0.5 x 7, 0.1", (0.5,) * 7 + (0.1,), 7),
]


class Ungated(Elimination):
    """Each hypothesis rejected on its own e-process alone (W >= 1 / alpha), with no test
    of the global null first: (b) holds, (a) does not (with equal candidates it errs up to
    K times alpha). What no gate or closure of these e-processes can beat."""

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


class KnownBestUngated(KnownBest, Ungated):
    """Both of the above."""


class KnownBestKellyStake(KnownBestUngated):
    """And the stake fixed at 0.5, the Kelly stake of this scenario's gap at rho 0 (a race
    cannot know it: it is the gap's, not a rule's)."""

    def _bets(self, against: Floats) -> Floats:
        result: Floats = np.where(against.sum(axis=-1) > 0, 0.5, 0.0)
        return result


# (label, rule, familywise)
VARIANTS: list[tuple[str, type[Elimination], bool]] = [
    ("the race, family-wise (closure)", Elimination, True),
    ("the race, per candidate (gate, then each alone)", Elimination, False),
    ("no gate: each alone (not valid for (a))", Ungated, False),
    ("per candidate, the best known in advance as comparator", KnownBest, False),
    ("no gate and the best known", KnownBestUngated, False),
    ("no gate, the best known, the stake fixed at this gap's Kelly stake 0.5",
     KnownBestKellyStake, False),
]


def rate(count: int, total: int) -> str:
    low, high = binomial_interval(count, total)
    return f"{count / total:.4f} [{low:.4f}, {high:.4f}]"


def mean_share(result: Simulated, digits: int = 3) -> str:
    """The races' mean share of the full evaluation's trials, ± its standard error."""
    error = result.share.std(ddof=1) / np.sqrt(result.races)
    return f"{result.share.mean():.{digits}f} ± {error:.{digits}f}"


def share(result: Simulated) -> str:
    return f"{mean_share(result)}, {result.share.max():.3f}"


def checks(races: int) -> None:
    print(f"{races} races per row, 200 tasks, 1 attempt, alpha 0.05, rounds as -n 4 sizes "
          "them unless said\n")
    print("| scenario | rho | control | any false verdict | best dropped / wrongly worse | "
          "share of trials (mean ± s.e., max) |")
    print("|---|---|---|---|---|---|")
    for seed, (label, means, baseline, concurrency) in enumerate(CHECKS):
        for rho in (0.0, 0.5, 0.9):
            for control, familywise in CONTROLS:
                result = simulate(Scenario(means=means, correlation=rho, baseline=baseline,
                                           concurrency=concurrency, familywise=familywise),
                                  races, seed=1000 * seed + int(rho * 10))
                print(f"| {label} | {rho} | {control} | "
                      f"{rate(int(result.false_declaration.sum()), races)} | "
                      f"{rate(int(result.best_dropped.sum()), races)} | {share(result)} |",
                      flush=True)


def clear(races: int) -> None:
    print(f"\n(c): one 0.25 better among 8, {races} races per cell, share of trials "
          "(mean ± s.e.)\n")
    cells = [(rho, n) for rho in (0.0, 0.5) for n in (4, 40)]
    print("| | " + " | ".join(f"rho {rho}, -n {n}" for rho, n in cells) + " |")
    print("|---|" + "---|" * len(cells))
    for control, familywise in CONTROLS:
        row = []
        for rho, n in cells:
            result = simulate(Scenario(means=CLEAR, correlation=rho, concurrency=n,
                                       familywise=familywise),
                              races, seed=2000 + int(rho * 10) + n)
            row.append(mean_share(result, digits=4))
        print(f"| {control} | " + " | ".join(row) + " |", flush=True)
    print("\n(a) on as many races: equal means, 8 candidates, -n 4, any false verdict\n")
    print("| | rho 0.0 | rho 0.5 |")
    print("|---|---|---|")
    for control, familywise in CONTROLS:
        rates = []
        for rho in (0.0, 0.5):
            result = simulate(Scenario(means=(0.5,) * 8, correlation=rho, concurrency=4,
                                       familywise=familywise),
                              races, seed=2100 + int(rho * 10))
            rates.append(rate(int(result.false_declaration.sum()), races))
        print(f"| {control} | " + " | ".join(rates) + " |", flush=True)


def gaps(races: int) -> None:
    print(f"\n(c) across gaps and base rates: one better candidate among 8, rho 0, -n 4, "
          f"{races} races per cell, share of trials (mean ± s.e.)\n")
    print("| the 7 others' mean | gap | per candidate | family-wise |")
    print("|---|---|---|---|")
    for base in (0.5, 0.375, 0.25, 0.15):
        for gap in (0.1, 0.25, 0.4):
            cells = []
            for _, familywise in CONTROLS:
                result = simulate(Scenario(means=(base + gap,) + (base,) * 7, concurrency=4,
                                           familywise=familywise),
                                  races, seed=int(1000 * base + 100 * gap))
                cells.append(mean_share(result))
            print(f"| {base} | {gap} | {cells[0]} | {cells[1]} |", flush=True)


def tied(races: int) -> None:
    print(f"\nSeveral tied for best, -n 4, {races} races per row: how often each best "
          "candidate (the highest of their rates), any of them and all of them are dropped\n")
    print("| means | rho | control | each best dropped (highest) | any best dropped | "
          "all best dropped |")
    print("|---|---|---|---|---|---|")
    for seed, (label, means, best) in enumerate(TIED):
        for rho in (0.0, 0.9):
            for control, familywise in CONTROLS:
                result = simulate(Scenario(means=means, correlation=rho, concurrency=4,
                                           familywise=familywise),
                                  races, seed=500 + 10 * seed + int(rho * 10))
                dropped = result.verdicts[:, :best] == Verdict.WORSE
                each = dropped.sum(axis=0)
                print(f"| {label} | {rho} | {control} | {rate(int(each.max()), races)} | "
                      f"{rate(int(dropped.any(axis=-1).sum()), races)} | "
                      f"{rate(int(dropped.all(axis=-1).sum()), races)} |", flush=True)


def variants(races: int) -> None:
    print(f"\nWhere the trials go: one 0.25 better among 8, rho 0, {races} races, the same "
          "races for each variant (the best listed first), fixed rounds\n")
    print("| rule | rounds of 5 tasks: share (mean ± s.e., max) | rounds of 1 |")
    print("|---|---|---|")
    for label, rule, familywise in VARIANTS:
        cells = [share(simulate(Scenario(means=CLEAR, batch=batch, familywise=familywise),
                                races, seed=77, rule=rule, shuffle=False)) for batch in (5, 1)]
        print(f"| {label} | {cells[0]} | {cells[1]} |", flush=True)


TABLES: dict[str, Callable[[int], None]] = {"checks": checks, "clear": clear, "gaps": gaps,
                                            "tied": tied, "variants": variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--races", type=int, default=None)
    parser.add_argument("--only", choices=sorted(TABLES), action="append")
    args = parser.parse_args()
    races = args.races or (200 if args.quick else 10_000)
    started = time.perf_counter()
    for name in args.only or TABLES:
        TABLES[name](races)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
