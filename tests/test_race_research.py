"""The race's ledger (rewards, left-out tasks, budget, order) and the research API's
`race` over real episodes of `open_episode_pool` (issue 37)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from support.race import candidate, research_tasks

from wmo_trio import load_harness
from wmo_trio.race import (
    Attempt,
    RaceError,
    RaceLedger,
    RaceReport,
    race,
    race_rounds,
    task_order,
)


def test_an_unscored_attempt_counts_zero_unless_the_task_has_no_reward_at_all() -> None:
    ledger = RaceLedger({"a": "A", "b": "B"}, ["t1", "t2"], alpha=0.1)
    played = ledger.next_round(2)
    assert played is not None and played.tasks == ("t1", "t2")
    ledger.record(played, {
        ("a", "t1"): [Attempt(1.0)], ("b", "t1"): [Attempt(None, "RuntimeError")],
        ("a", "t2"): [Attempt(None, "BuildError")], ("b", "t2"): [Attempt(None, "BuildError")],
    })
    report = ledger.report()
    assert report.task_order == ["t1"]
    assert [(t.task, "BuildError" in t.reason) for t in report.left_out] == [("t2", True)]
    a, b = report.candidates
    assert (a.mean_reward, b.mean_reward, b.unscored, b.errors) == (1.0, 0.0, 2, 2)
    assert ledger.next_round(2) is None and report.trials == 4


def test_the_trial_budget_shortens_and_ends_the_race() -> None:
    ledger = RaceLedger({"a": "A", "b": "B", "c": "C"}, [f"t{i}" for i in range(10)],
                        alpha=0.05, attempts=2, max_trials=15)
    played = ledger.next_round(4)
    assert played is not None and len(played.tasks) == 2  # 3 candidates x 2 attempts x 2 = 12
    ledger.record(played, {(k, t): [Attempt(0.5), Attempt(0.5)] for k in played.candidates
                           for t in played.tasks})
    assert ledger.next_round(4) is None and ledger.stop_reason == "trial budget"
    assert ledger.report().share == pytest.approx(12 / 60)


def test_the_task_order_depends_on_the_seed_not_on_the_listing() -> None:
    tasks = [f"t{i}" for i in range(20)]
    assert task_order(tasks, 3) == task_order(list(reversed(tasks)), 3)
    assert task_order(tasks, 3) != task_order(tasks, 4)


def raced_ledger(familywise: bool) -> RaceLedger:
    """A always passes, C never, B on two tasks of three: rounds of one task."""
    ledger = RaceLedger({"a": "A", "b": "B", "c": "C"}, [f"t{i:02d}" for i in range(80)],
                        alpha=0.1, familywise=familywise)
    while (played := ledger.next_round(1)) is not None:
        [task] = played.tasks
        rewards = {"a": 1.0, "b": float(int(task[1:]) % 3 != 0), "c": 0.0}
        ledger.record(played, {(key, task): [Attempt(rewards[key])]
                               for key in played.candidates})
    return ledger


def test_the_report_says_which_control_decided_and_per_candidate_drops_sooner() -> None:
    per_candidate, closed = raced_ledger(False).report(), raced_ledger(True).report()
    assert (per_candidate.settings.familywise, closed.settings.familywise) == (False, True)
    assert per_candidate.gate_open is True and closed.gate_open is None
    # C is dropped once the mean of the three e-values reaches 10 under both; B, once its
    # own reaches 10 per candidate, but only once its mean with A's (A, the leader, holds
    # the true hypothesis, its e-value below 1) does under the closure. B never beats A,
    # so its e-value only grows: the closure, rejecting it later, freezes it higher, at
    # no less than 2 x 10 less A's.
    a, b, c = per_candidate.candidates
    fa, fb, fc = closed.candidates
    assert [x.status for x in (a, b, c, fa, fb, fc)] == ["survived", "dropped", "dropped"] * 2
    assert c.stopped_round == fc.stopped_round and b.stopped_round < fb.stopped_round
    assert a.evidence < 1 and fa.evidence < 1
    assert 10 <= b.evidence < fb.evidence and fb.evidence >= 2 * 10 - 1


def test_a_race_json_from_before_the_choice_reads_as_the_closure() -> None:
    # race.json files written before `familywise` existed were all decided by the closure.
    report = raced_ledger(True).report().model_dump(mode="json")
    del report["settings"]["familywise"], report["gate_open"], report["global_evidence"]
    assert RaceReport.model_validate(report).settings.familywise is True


def test_a_race_needs_two_candidates() -> None:
    with pytest.raises(RaceError, match="at least two different candidates"):
        RaceLedger({"a": "A"}, ["t"])


async def test_the_research_race_drops_the_worse_over_real_episodes(tmp_path: Path) -> None:
    docs = [candidate(tmp_path, name, rate, answer="answer.txt")
            for name, rate in (("good", 1.0), ("poor", 0.0), ("also-poor", 0.0))]
    rounds = []
    async for report in race_rounds([load_harness(d) for d in docs],
                                    research_tasks(tmp_path / "tasks", 12),
                                    provider={"kind": "scripted", "model": "offline"},
                                    alpha=0.3, limit=6, backend="local"):
        rounds.append(report)
    final = rounds[-1]
    assert final.finished and final.stop_reason == "one candidate left"
    assert [c.status for c in final.candidates] == ["survived", "dropped", "dropped"]
    assert final.trials < final.full_trials == 36
    assert [r.rounds for r in rounds] == list(range(1, len(rounds) + 1))


async def test_a_research_race_refuses_one_document_given_twice(tmp_path: Path) -> None:
    doc = load_harness(candidate(tmp_path, "same", 1.0, answer="answer.txt"))
    with pytest.raises(RaceError, match="one doc_hash"):
        await race([doc, doc], research_tasks(tmp_path / "tasks", 2),
                   provider={"kind": "scripted", "model": "offline"})


async def test_cancelling_a_research_race_stops_its_episodes(tmp_path: Path) -> None:
    docs = [load_harness(candidate(tmp_path, n, 0.5, pause=30, answer="answer.txt"))
            for n in ("slow-a", "slow-b")]
    with trio.move_on_after(3) as scope:
        await race(docs, research_tasks(tmp_path / "tasks", 4),
                   provider={"kind": "scripted", "model": "offline"}, backend="local")
    assert scope.cancelled_caught
