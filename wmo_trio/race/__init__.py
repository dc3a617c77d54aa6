"""Racing candidates: the best of several for a fraction of the trials, with error rates
that hold however often the evidence is looked at (docs/race.md).

    from wmo_trio.race import RaceTask, race
    report = await race([doc_a, doc_b], tasks, provider={"kind": "scripted",
                                                         "model": "offline"})

Each round runs every candidate still in the race on the same fresh tasks and drops those
shown not to be the best (or, against a baseline, shown better or worse). `RaceReport` is
`wmo-trio race --json` and a race job directory's `race.json`. The statistics
(`wmo_trio.race._sequential`, `_elimination`) are pure numpy; harbor is loaded only by
the harbor race (`run_race`).
"""

from __future__ import annotations

from wmo_trio.race._episodes import RaceTask, race, race_rounds
from wmo_trio.race._ledger import Attempt, RaceError, RaceLedger, Round, task_order
from wmo_trio.race._report import CandidateStanding, LeftOutTask, RaceReport, RaceSettings

__all__ = [
    "Attempt",
    "CandidateStanding",
    "LeftOutTask",
    "RaceError",
    "RaceLedger",
    "RaceReport",
    "RaceSettings",
    "RaceTask",
    "Round",
    "race",
    "race_rounds",
    "task_order",
]
