"""`wmo-trio race`: several candidates on the same tasks in rounds, the worse dropped as
soon as the paired evidence shows it (docs/race.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from wmo_trio.cli._run import (
    AGENT_IMPORT_PATH,
    BadInput,
    RunOptions,
    agent_kwargs,
    build_job_config,
    running_on,
)

if TYPE_CHECKING:
    from wmo_trio.cluster import ClusterOptions
    from wmo_trio.race import RaceReport
    from wmo_trio.race._harbor import HarborRace, RaceProgress


def build_race(options: RunOptions, harnesses: list[Path], *, baseline: Path | None,
               alpha: float, max_trials: int | None, seed: int,
               familywise: bool = False) -> HarborRace:
    """Every option and document judged, then the race's harbor job configuration, one
    agent per candidate (the baseline first). Raises `BadInput` before anything runs."""
    from wmo_trio.harness import HarnessError, load_harness
    from wmo_trio.race._harbor import HarborRace

    if not 0 < alpha < 1:
        raise BadInput(f"--alpha {alpha}: give a level in (0, 1), e.g. 0.05")
    if max_trials is not None and max_trials < 1:
        raise BadInput("--max-trials must be at least 1")
    files = ([baseline] if baseline is not None else []) + harnesses
    keys: list[str] = []
    names: list[str] = []
    seen: dict[str, Path] = {}
    for file in files:
        try:
            doc = load_harness(file)
        except HarnessError as error:
            raise BadInput(str(error)) from None
        if doc.doc_hash in seen:
            if file == baseline or seen[doc.doc_hash] == baseline:
                continue  # the baseline named again among the candidates
            raise BadInput(f"{seen[doc.doc_hash]} and {file} are one candidate (doc_hash "
                           f"{doc.doc_hash[:8]}): give each candidate once")
        seen[doc.doc_hash] = file
        keys.append(doc.doc_hash)
        names.append(file.stem)
    if len(keys) < 2:
        raise BadInput("a race needs at least two different candidates (--harness, repeated); "
                       "to evaluate one, use wmo-trio run")
    kwargs = [agent_kwargs(dataclasses.replace(options, harness=seen[key])) for key in keys]
    config = build_job_config(dataclasses.replace(options, harness=seen[keys[0]]))
    from harbor.models.trial.config import AgentConfig

    config.agents = [AgentConfig(import_path=AGENT_IMPORT_PATH, model_name=options.model,
                                 kwargs=one, skip_model_parsing=True) for one in kwargs]
    return HarborRace(config=config, keys=keys, names=names, alpha=alpha, seed=seed,
                      max_trials=max_trials, baseline=keys[0] if baseline else None,
                      familywise=familywise)


async def run_with_display(race: HarborRace, console: Console | None,
                           cluster: ClusterOptions | None = None) -> RaceReport:
    """Run the race on the trio host, with a live display unless `console` is None; with
    `cluster` (`--workers`/`--ray-address`), every round's trials on the workers of one
    `TrialFleet` opened for the whole race (each candidate's agent and the environment
    loaded on every worker before the first round: a `ClusterError` otherwise).

    Ctrl-C (SIGINT, or SIGTERM) stops it as it stops `wmo-trio run`: the round in flight
    is cancelled, its trials stopped and waited for (on their workers, their directories
    written here), the job directory left reading as the race so far and the workers and
    an embedded Ray stopped, then `KeyboardInterrupt` propagates; a second Ctrl-C while
    that cleanup runs leaves at once (`leave_now`)."""
    import trio
    from rich.live import Live

    from wmo_trio.cli._interrupt import cancelled_on_interrupt, leave_now
    from wmo_trio.harbor._job import harbor_progress_hidden
    from wmo_trio.harbor._trials import open_trial_runner
    from wmo_trio.race._harbor import RaceProgress, run_race

    progress = RaceProgress()
    if cluster is not None:
        progress.stage = "starting the workers (Ray), each loading the candidates' agent"
    report: RaceReport | None = None

    async def show() -> None:
        if console is None:
            return
        with Live(render_progress(progress), console=console, refresh_per_second=4,
                  transient=True) as live:
            while True:
                live.update(render_progress(progress))
                await trio.sleep(0.25)

    with harbor_progress_hidden():
        async with cancelled_on_interrupt(lambda: None,
                                          lambda: leave_now(race.job_dir)) as interrupt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(show)
                async with open_trial_runner(race.config, cluster) as runner:
                    report = await run_race(race, runner=runner, progress=progress)
                nursery.cancel_scope.cancel()
    if interrupt.received or report is None:
        raise KeyboardInterrupt
    return report


def _number(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def standings_table(report: RaceReport, title: str) -> Table:
    reference = report.settings.baseline or report.leader
    against = "baseline" if report.settings.baseline else "leader"
    table = Table(title=title, show_header=True)
    for column in ("candidate", "status", "tasks", "trials", "mean", f"diff vs {against}",
                   "interval", "evidence", "stopped", "errors"):
        table.add_column(column, justify="left" if column in ("candidate", "status")
                         else "right", no_wrap=column != "candidate")
    for c in report.candidates:
        style = {"dropped": "red", "worse": "red", "better": "green"}.get(c.status, "")
        label = f"{c.key[:8]} {c.name}" + (" (leader)" if c.key == reference else "")
        interval = ("-" if c.ci_low is None or c.ci_high is None
                    else f"[{c.ci_low:+.2f}, {c.ci_high:+.2f}]")
        table.add_row(label, Text(c.status, style=style), str(c.tasks), str(c.trials),
                      _number(c.mean_reward), _number(c.difference, signed=True), interval,
                      f"{c.evidence:.3g}", "-" if c.stopped_round is None
                      else f"round {c.stopped_round}", str(c.errors))
    return table


def render_progress(progress: RaceProgress) -> Group:
    ledger = progress.ledger
    if ledger is None:
        return Group(Text(progress.stage + " …", style="dim"))
    report = ledger.report()
    phases: dict[str, int] = {}
    for phase in progress.running.values():
        phases[phase] = phases.get(phase, 0) + 1
    line = (f"{progress.stage}: {progress.round_done}/{progress.round_trials} trials done"
            + (" (now: " + ", ".join(f"{n} {p}" for p, n in phases.items()) + ")"
               if phases else "")
            + running_on(progress.running, progress.workers)
            + f"; {report.trials} of the full {report.full_trials} run so far")
    lines = [Text(line, style="dim")]
    if report.gate_open is False:
        lines.append(Text(control_line(report), style="dim"))
    return Group(standings_table(report, "wmo-trio race"), *lines)


def control_line(report: RaceReport) -> str:
    """Which error the race controls (docs/race.md, "The multiplicity"), and, per
    candidate, whether the evidence against all candidates being equal allows verdicts."""
    alpha = report.settings.alpha
    if report.settings.familywise:
        return (f"control: family-wise, every verdict right together with probability at "
                f"least {1 - alpha:.0%}")
    line = "control: per candidate, " + (
        "each one not better (not worse) than the baseline called better (worse)"
        if report.settings.baseline else "each one among the best dropped") + (
        f" with probability at most {alpha:.0%}")
    if not report.gate_open:
        line += (f"; no verdict before the evidence against all being equal reaches "
                 f"{1 / alpha:.3g} (now {report.global_evidence:.3g})")
    return line


def summary_lines(report: RaceReport) -> list[str]:
    """The race in a few lines: who survived, how far each ran, what it saved, and the
    interval of each survivor's difference with the leader."""
    lines = [f"stopped: {report.stop_reason} after {report.rounds} round"
             f"{'' if report.rounds == 1 else 's'}", control_line(report)]
    kept = [c for c in report.candidates if c.status in ("survived", "running", "better",
                                                         "undecided", "baseline")]
    lines.append("survived: " + (", ".join(f"{c.name} ({c.status})" for c in kept) or "none"))
    lines.append("tasks run: " + ", ".join(f"{c.name} {c.tasks}" for c in report.candidates))
    lines.append(f"trials: {report.trials} of the full evaluation's {report.full_trials} "
                 f"({report.share:.0%}); saved {report.trials_saved}")
    for c in kept:
        if c.ci_low is not None and c.ci_high is not None:
            lines.append(f"{c.name} minus {'baseline' if report.settings.baseline else 'leader'}"
                         f": {c.difference:+.3f}, interval [{c.ci_low:+.3f}, {c.ci_high:+.3f}] "
                         f"(anytime-valid, simultaneous at {1 - report.settings.alpha:.0%})")
    for task in report.left_out:
        lines.append(f"left out: {task.task}: {task.reason}")
    if report.note:
        lines.append(report.note)
    return lines
