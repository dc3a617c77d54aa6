"""The race as data: `RaceReport` is `wmo-trio race --json` and the job directory's
`race.json` (docs/race.md, "The JSON")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
RACE_FILENAME = "race.json"

Status = Literal["running", "dropped", "better", "worse", "survived", "undecided", "baseline"]
StopReason = Literal["one candidate left", "all decided", "tasks exhausted", "trial budget",
                     "interrupted"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RaceSettings(_Model):
    alpha: float
    attempts: int = Field(description="attempts of each task by each candidate (-k)")
    seed: int = Field(description="the seed of the task order")
    max_trials: int | None
    baseline: str | None = Field(description="the incumbent's key, with --baseline")
    tasks: int = Field(description="tasks available to the race")
    # Absent from the race.json files written before the choice existed, which all used
    # the closure: reading one gives True. A race always writes it.
    familywise: bool = Field(
        default=True, description="the control (docs/race.md, \"The multiplicity\"): false, "
        "per candidate (the default: with all candidates equal, no verdict with probability "
        "at least 1 - alpha; each candidate among the best, or not worse than the baseline, "
        "dropped with probability at most alpha); true, family-wise (--familywise: every "
        "verdict of the race right together with probability at least 1 - alpha)")


class CandidateStanding(_Model):
    key: str = Field(description="the candidate's doc_hash (the research API: its key)")
    name: str
    status: Status = Field(description="running; dropped (shown not the best: a race); "
                                       "better or worse (shown so against the baseline); "
                                       "survived (the race ended, it was not dropped); "
                                       "undecided (against a baseline, never shown either); "
                                       "baseline (the incumbent itself)")
    tasks: int = Field(description="tasks it was scored on")
    trials: int = Field(description="trials it ran, left-out tasks included")
    errors: int = Field(description="trials with an exception other than the agent's timeout")
    failures: dict[str, int] = Field(
        default_factory=dict, description="those trials by the exception's type (harbor's "
        "exception_info, e.g. AgentSetupTimeoutError for a trial that failed before its "
        "agent ran); each without a reward counts 0, as `unscored` says")
    unscored: int = Field(description="trials without a reward, counted as 0 (a task with no "
                                      "reward for any candidate is left out instead)")
    mean_reward: float | None = Field(description="over the tasks it was scored on")
    difference: float | None = Field(description="its mean paired difference with the leader "
                                                 "(or the baseline), candidate minus leader, "
                                                 "over the tasks both were scored on")
    ci_low: float | None = Field(description="the difference's anytime-valid interval (see "
                                             "docs/race.md); null for the leader itself")
    ci_high: float | None
    evidence: float = Field(description="the largest e-value against it (a race: that it is "
                                        "among the best; a baseline: that it is not better, "
                                        "or not worse); 1 at the start")
    stopped_round: int | None = Field(description="the round after which it stopped")
    behind: str | None = Field(description="the leader when it was dropped")


class LeftOutTask(_Model):
    task: str
    reason: str


class RaceReport(_Model):
    """A race so far or finished; `model_dump_json` is `wmo-trio race --json`."""

    schema_version: int = SCHEMA_VERSION
    settings: RaceSettings
    finished: bool = Field(description="false while it runs, and for a race interrupted "
                                        "(Ctrl-C) or killed: then it reads as the race so far")
    stop_reason: StopReason | None
    rounds: int = Field(description="rounds completed")
    leader: str | None = Field(description="the highest mean among those not dropped")
    global_evidence: float = Field(
        default=1.0, description="the e-value against every candidate being equal (to the "
        "baseline): the mean of every hypothesis's e-value, now")
    gate_open: bool | None = Field(
        default=None, description="per candidate: whether that e-value has reached 1 / alpha "
        "at some task (no verdict before; open for good once open); null with familywise")
    candidates: list[CandidateStanding]
    task_order: list[str] = Field(description="the tasks run, in the order drawn")
    left_out: list[LeftOutTask]
    trials: int = Field(description="trials run, every candidate")
    full_trials: int = Field(description="every candidate on every task, -k attempts each")
    trials_saved: int
    share: float = Field(description="trials / full_trials")
    note: str | None = None
