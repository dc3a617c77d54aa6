"""A comparison for people: rich tables for a terminal, a PNG for a page."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from wmo_trio.compare._analysis import CandidateSummary, Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def short(key: str) -> str:
    """A candidate key as tables show it: a doc_hash's first 8 digits, other keys whole."""
    return key[:8] if len(key) == 32 and all(c in "0123456789abcdef" for c in key) else key


def _label(key: str, names: dict[str, str]) -> str:
    name = names.get(key, key)
    return key if name == key else f"{short(key)} {name}"


def _number(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _interval(low: float | None, high: float | None, signed: bool = False) -> str:
    if low is None or high is None:
        return "-"
    return f"[{_number(low, signed=signed)}, {_number(high, signed=signed)}]"


def candidates_table(report: Report) -> Table:
    level = f"{report.settings.confidence:.0%} CI"
    table = Table(title="candidates", show_header=True)
    for column in ("candidate", "trials", "tasks", "mean", level, "pass@k", "timeouts",
                   "errors", "no reward", "tokens in/out", "agent s"):
        table.add_column(column, justify="left" if column == "candidate" else "right",
                         no_wrap=column != "pass@k")
    for c in report.candidates:
        table.add_row(
            _label(c.doc_hash, {c.doc_hash: c.name}),
            str(c.trials), str(c.tasks), _number(c.mean_reward),
            _interval(c.ci_low, c.ci_high),
            " ".join(f"@{k} {v:.2f}" for k, v in c.pass_at_k.items()) or "-",
            str(c.timeouts), str(c.exceptions), str(c.unscored),
            f"{c.input_tokens:,} / {c.output_tokens:,}", _number(c.mean_agent_seconds, 1),
        )
    return table


def comparisons_table(report: Report) -> Table:
    level = f"{report.settings.confidence:.0%} CI"
    table = Table(title="against the baseline (candidate minus baseline, paired by task)",
                  show_header=True)
    for column in ("candidate", "baseline", "tasks", "mean diff", level, "p", "test",
                   "wins", "losses", "ties", "unpaired"):
        table.add_column(column, justify="left" if column in ("candidate", "baseline", "test")
                         else "right", no_wrap=True)
    names = {c.doc_hash: c.name for c in report.candidates}
    for c in report.comparisons:
        excludes_zero = c.ci_low is not None and c.ci_high is not None and (
            c.ci_low > 0 or c.ci_high < 0)
        style = "" if not excludes_zero else ("green" if (c.mean_difference or 0) > 0 else "red")
        table.add_row(
            _label(c.candidate, names), short(c.baseline), str(c.tasks),
            Text(_number(c.mean_difference, signed=True), style=style),
            Text(_interval(c.ci_low, c.ci_high, signed=True), style=style),
            "-" if c.p_value is None else f"{c.p_value:.3g}", c.p_method or "-",
            str(c.wins), str(c.losses), str(c.ties),
            str(len(c.only_baseline) + len(c.only_candidate)),
        )
    return table


def notes(report: Report) -> list[str]:
    """What a reader must not miss: unpaired tasks, unscored trials, too little data."""
    lines = []
    names = {c.doc_hash: c for c in report.candidates}
    for c in report.comparisons:
        if c.only_baseline:
            lines.append(f"{short(c.candidate)}: not scored on {', '.join(c.only_baseline)} "
                         f"(baseline only); left out of the comparison")
        if c.only_candidate:
            lines.append(f"{short(c.candidate)}: scored on {', '.join(c.only_candidate)}, which "
                         f"the baseline is not; left out of the comparison")
        if c.tasks == 1:
            lines.append(f"{short(c.candidate)}: one paired task; no interval can be had from one")
        if c.tasks == 0:
            lines.append(f"{short(c.candidate)}: no task in common with the baseline")
    for key, candidate in names.items():
        if candidate.unscored:
            what = "counted as 0" if report.settings.missing_as_zero else (
                "left out (--missing-as-zero counts them as 0)")
            lines.append(f"{short(key)}: {candidate.unscored} trial(s) without a reward, {what}")
    return lines


def render(report: Report, console: Console) -> None:
    parts: list[Table | Text] = [candidates_table(report)]
    if report.comparisons:
        parts.append(comparisons_table(report))
    else:
        parts.append(Text("one candidate: nothing to compare it with"))
    parts.extend(Text(line, style="yellow") for line in notes(report))
    console.print(Group(*parts))


def plot(report: Report, path: Path) -> None:
    """A PNG: each candidate's per-task rewards (left), and each candidate's mean
    difference from the baseline with its interval (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = sorted({s.task for c in report.candidates for s in c.per_task})
    height = max(3.0, 0.35 * len(tasks) + 1.6, 0.6 * len(report.comparisons) + 1.6)
    figure = Figure(figsize=(12, height), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2, width_ratios=(3, 2))
    colours = {c.doc_hash: f"C{index % 10}" for index, c in enumerate(report.candidates)}
    _plot_rewards(left, report, tasks, colours)
    _plot_differences(right, report, colours)
    figure.legend(loc="outside lower center", ncols=min(3, len(report.candidates)),
                  fontsize="small", frameon=False)
    figure.savefig(path, dpi=110)


def _plot_rewards(axes: Axes, report: Report, tasks: list[str], colours: dict[str, str]) -> None:
    candidates = report.candidates
    baseline = report.comparisons[0].baseline if report.comparisons else None
    row = {task: index for index, task in enumerate(tasks)}
    spread = 0.6 / max(1, len(candidates))
    for index, candidate in enumerate(candidates):
        offset = (index - (len(candidates) - 1) / 2) * spread
        scored = [(s.mean_reward, row[s.task] + offset) for s in candidate.per_task
                  if s.mean_reward is not None]
        axes.scatter([x for x, _ in scored], [y for _, y in scored],
                     s=36, label=_label(candidate.doc_hash, {candidate.doc_hash: candidate.name})
                     + (" (baseline)" if candidate.doc_hash == baseline else ""), zorder=3,
                     color=colours[candidate.doc_hash])
    axes.set_yticks(range(len(tasks)), tasks)
    axes.invert_yaxis()
    if _unit_rewards(candidates):
        axes.set_xlim(-0.05, 1.05)
    axes.set_xlabel("mean reward over attempts")
    axes.set_title("per-task reward")
    axes.grid(axis="x", alpha=0.3)


def _unit_rewards(candidates: list[CandidateSummary]) -> bool:
    return all(0 <= (s.mean_reward or 0) <= 1 for c in candidates for s in c.per_task)


def _plot_differences(axes: Axes, report: Report, colours: dict[str, str]) -> None:
    comparisons = report.comparisons
    axes.axvline(0.0, color="grey", linewidth=1)
    if _unit_rewards(report.candidates):  # one scale for every comparison of such rewards
        axes.set_xlim(-1.1, 1.1)
    axes.set_title(f"difference from baseline {short(report.comparisons[0].baseline)}"
                   if comparisons else "one candidate: nothing to compare")
    axes.set_xlabel(f"mean difference, {report.settings.confidence:.0%} paired bootstrap CI")
    names = {c.doc_hash: c.name for c in report.candidates}
    for index, c in enumerate(comparisons):
        if c.mean_difference is None:
            continue
        if c.ci_low is not None and c.ci_high is not None:
            axes.errorbar([c.mean_difference], [index],
                          xerr=[[c.mean_difference - c.ci_low], [c.ci_high - c.mean_difference]],
                          fmt="o", capsize=4, color=colours[c.candidate])
        else:
            axes.plot([c.mean_difference], [index], "o", color=colours[c.candidate])
        p = "-" if c.p_value is None else f"{c.p_value:.2g}"
        axes.annotate(f"p={p}  {c.wins}W/{c.losses}L/{c.ties}T  n={c.tasks}",
                      (c.mean_difference, index), textcoords="offset points", xytext=(0, 8),
                      ha="center", fontsize="small")
    axes.set_yticks(range(len(comparisons)),
                    [_label(c.candidate, names) for c in comparisons])
    if comparisons:
        axes.set_ylim(len(comparisons) - 0.5, -0.5)
    axes.grid(axis="x", alpha=0.3)
