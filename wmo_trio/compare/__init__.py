"""Is the new candidate better? Paired statistics over harbor jobs and research runs.

    from wmo_trio.compare import compare_jobs
    report = compare_jobs(["jobs/baseline", "jobs/terse"])   # the first job's candidate leads
    for c in report.comparisons:
        print(c.candidate, c.mean_difference, c.ci_low, c.ci_high, c.p_value)

Trials are grouped by candidate (a document's `doc_hash` and the model it ran with, or
the document alone with `pool_models`; for another harbor agent its name, model and
arguments), paired by task (name and content digest) with attempts
averaged per task. Research-API episodes become records with `record_from_run` and go
through `compare` the same way. `Report` is the JSON of `wmo-trio compare --json`; its
shape is described in docs/compare.md.

numpy is imported with this package and scipy when a comparison computes its statistics,
never by `import wmo_trio` or the agent.
"""

from __future__ import annotations

from wmo_trio.compare._analysis import (
    CandidateSummary,
    ComparisonSummary,
    Report,
    TaskDifference,
    TaskScore,
    compare,
    compare_jobs,
)
from wmo_trio.compare._records import CompareError, TrialRecord, load_jobs, record_from_run
from wmo_trio.compare._report import plot, render

__all__ = [
    "CandidateSummary",
    "CompareError",
    "ComparisonSummary",
    "Report",
    "TaskDifference",
    "TaskScore",
    "TrialRecord",
    "compare",
    "compare_jobs",
    "load_jobs",
    "plot",
    "record_from_run",
    "render",
]
