"""The race's error rates and savings on simulated races: `python -m benchmarks.race
[--quick] [--races N]`.

Runs the race's own rule (`wmo_trio.race._elimination`) on seeded simulated races
(`wmo_trio.race._simulation`, its model described in docs/race.md) for the three checks of
issue 37 under independent (rho 0) and correlated (rho 0.5, 0.9) candidates, and prints a
Markdown table: each error rate with its exact 95 % binomial interval, and the mean share
of the full evaluation's trials. `--quick` runs 200 races per row (a shape check for
`make bench-quick`); the full run 10,000.
"""

from __future__ import annotations

import argparse
import time

from wmo_trio.race._simulation import Scenario, binomial_interval, simulate

CLEAR = (0.75,) + (0.5,) * 7
ROWS: list[tuple[str, tuple[float, ...], int | None]] = [
    ("equal means, 8 candidates (a)", (0.5,) * 8, None),
    ("one 0.25 better, 8 candidates (b, c)", CLEAR, None),
    ("one 0.05 better, 8 candidates (b)", (0.55,) + (0.5,) * 7, None),
    ("against a baseline, 4 equal to it (a)", (0.5,) * 5, 0),
    ("against a baseline: 0.8, 0.2, 0.5 vs 0.5", (0.5, 0.8, 0.2, 0.5), 0),
]


def rate(count: int, total: int) -> str:
    low, high = binomial_interval(count, total)
    return f"{count / total:.4f} [{low:.4f}, {high:.4f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--races", type=int, default=None)
    args = parser.parse_args()
    races = args.races or (200 if args.quick else 10_000)
    print(f"{races} races per row, 200 tasks, 1 attempt, alpha 0.05, rounds of 5 tasks\n")
    print("| scenario | rho | any false verdict | best dropped / wrongly worse | share of "
          "trials (mean, max) | seconds |")
    print("|---|---|---|---|---|---|")
    for seed, (label, means, baseline) in enumerate(ROWS):
        for rho in (0.0, 0.5, 0.9):
            started = time.perf_counter()
            result = simulate(Scenario(means=means, correlation=rho, baseline=baseline),
                              races, seed=1000 * seed + int(rho * 10))
            print(f"| {label} | {rho} | {rate(int(result.false_declaration.sum()), races)} | "
                  f"{rate(int(result.best_dropped.sum()), races)} | "
                  f"{result.share.mean():.3f}, {result.share.max():.3f} | "
                  f"{time.perf_counter() - started:.1f} |", flush=True)


if __name__ == "__main__":
    main()
