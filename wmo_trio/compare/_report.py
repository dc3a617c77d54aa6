"""A comparison for people: rich tables for a terminal, a PNG for a page."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.measure import Measurement
from rich.segment import Segments
from rich.table import Table
from rich.text import Text

from wmo_trio.compare._analysis import CandidateSummary, Key, Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# A label's parts are cut to these lengths, so that the numbers keep their columns.
NAME_CHARS = 24
KEY_CHARS = 36
LABEL_WIDTH = 20  # a label column wraps at no less than this
W_L_T = "W/L/T: tasks won, lost and tied against the baseline; n: tasks paired"


def short(key: str) -> str:
    """A candidate key as tables show it: a doc_hash's first 8 digits; another agent's key
    without its import path's modules, its middle cut when still long (its `#arguments`
    hash, which tells two apart, is kept)."""
    if len(key) == 32 and all(c in "0123456789abcdef" for c in key):
        return key[:8]
    head, colon, tail = key.partition(":")
    key = tail if colon and "/" not in head else key
    return _cut(key, KEY_CHARS, keep_end=12)


def _cut(text: str, most: int, keep_end: int = 0) -> str:
    if len(text) <= most:
        return text
    return text[: most - 1 - keep_end] + "…" + (text[-keep_end:] if keep_end else "")


class Labels:
    """How the tables, notes and plot name each candidate: short key, the document's name,
    and the model when the report holds more than one."""

    def __init__(self, report: Report) -> None:
        self._candidates = {c.key: c for c in report.candidates}
        self._show_models = len({m for c in report.candidates for m in c.models}) > 1

    def __call__(self, key: Key) -> str:
        candidate = self._candidates.get(key)
        doc_hash, model = key
        label = short(doc_hash)
        if candidate is not None and candidate.name != doc_hash:
            label += " " + _cut(candidate.name, NAME_CHARS)
        if model is not None and self._show_models:
            label += f" ({model})"
        elif candidate is not None and len(candidate.models) > 1:
            label += f" ({len(candidate.models)} models pooled)"
        return label


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
    label = Labels(report)
    table = Table(title="candidates", show_header=True)
    for column in ("candidate", "trials", "tasks", "mean", level, "pass@k", "timeouts",
                   "errors", "no reward", "tokens in/out", "agent s"):
        # Labels wrap; numbers never do, nor are they cut (see `render`).
        table.add_column(column, justify="left" if column == "candidate" else "right",
                         no_wrap=column != "candidate", overflow="fold",
                         min_width=LABEL_WIDTH if column == "candidate" else None)
    for c in report.candidates:
        table.add_row(
            label(c.key), str(c.trials), str(c.tasks), _number(c.mean_reward),
            _interval(c.ci_low, c.ci_high),
            " ".join(f"@{k} {v:.2f}" for k, v in c.pass_at_k.items()) or "-",
            str(c.timeouts), str(c.exceptions + c.episode_errors), str(c.unscored),
            f"{c.input_tokens:,} / {c.output_tokens:,}", _number(c.mean_agent_seconds, 1),
        )
    return table


def comparisons_table(report: Report) -> Table:
    level = f"{report.settings.confidence:.0%} CI"
    label = Labels(report)
    table = Table(title="against the baseline (candidate minus baseline, paired by task)",
                  show_header=True)
    for column in ("candidate", "baseline", "tasks", "mean diff", level, "p", "test",
                   "wins", "losses", "ties", "unpaired"):
        labelled = column in ("candidate", "baseline")
        table.add_column(column, justify="left" if labelled or column == "test" else "right",
                         no_wrap=not labelled, overflow="fold",
                         min_width=LABEL_WIDTH if labelled else None)
    for c in report.comparisons:
        excludes_zero = c.ci_low is not None and c.ci_high is not None and (
            c.ci_low > 0 or c.ci_high < 0)
        style = "" if not excludes_zero else ("green" if (c.mean_difference or 0) > 0 else "red")
        table.add_row(
            label(c.candidate_key), label(c.baseline_key), str(c.tasks),
            Text(_number(c.mean_difference, signed=True), style=style),
            Text(_interval(c.ci_low, c.ci_high, signed=True), style=style),
            "-" if c.p_value is None else f"{c.p_value:.3g}", c.p_method or "-",
            str(c.wins), str(c.losses), str(c.ties),
            str(len(c.only_baseline) + len(c.only_candidate)),
        )
    return table


def notes(report: Report) -> list[str]:
    """What a reader must not miss: unpaired tasks, unscored trials and why, episode
    errors, models pooled or kept apart, too little data."""
    lines = []
    label = Labels(report)
    for c in report.comparisons:
        name = label(c.candidate_key)
        if c.only_baseline:
            lines.append(f"{name}: not scored on {', '.join(c.only_baseline)} "
                         f"(baseline only); left out of the comparison")
        if c.only_candidate:
            lines.append(f"{name}: scored on {', '.join(c.only_candidate)}, which "
                         f"the baseline is not; left out of the comparison")
        if c.tasks == 1:
            lines.append(f"{name}: one paired task; no interval can be had from one")
        if c.tasks == 0:
            lines.append(f"{name}: no task in common with the baseline")
    by_document: dict[str, list[CandidateSummary]] = {}
    for candidate in report.candidates:
        by_document.setdefault(candidate.doc_hash, []).append(candidate)
        lines.extend(_candidate_notes(candidate, label(candidate.key), report))
    for doc_hash, kept_apart in by_document.items():
        if len(kept_apart) > 1 and not report.settings.pool_models:
            models = ", ".join(str(c.model) for c in kept_apart)
            lines.append(f"{short(doc_hash)}: ran with {len(kept_apart)} models ({models}), a "
                         "candidate each (--pool-models makes them one)")
    return lines


def _candidate_notes(candidate: CandidateSummary, name: str, report: Report) -> list[str]:
    lines = []
    if len(candidate.models) > 1:
        lines.append(f"{name}: models pooled into one candidate (--pool-models): "
                     f"{', '.join(candidate.models)}")
    if candidate.unscored:
        why = ", ".join(f"{kind} {n}" for kind, n in candidate.exception_types.items())
        what = "counted as 0" if report.settings.missing_as_zero else (
            "left out (--missing-as-zero counts them as 0)")
        lines.append(f"{name}: {candidate.unscored} trial(s) without a reward"
                     f"{f' ({why})' if why else ''}, {what}")
    if candidate.tasks == 0 and not report.settings.missing_as_zero:
        lines.append(f"{name}: no trial has a reward, so it is compared with nothing")
    if candidate.episode_errors:
        lines.append(f"{name}: {candidate.episode_errors} episode(s) ended in error (the "
                     "document's code or the episode raised; wmo-trio trace shows where)")
    return lines


def render(report: Report, console: Console) -> None:
    parts: list[Table | Text] = [candidates_table(report)]
    if report.comparisons:
        parts.append(comparisons_table(report))
    else:
        parts.append(Text("one candidate: nothing to compare it with"))
    parts.extend(Text(line, style="yellow") for line in notes(report))
    for part in parts:
        if isinstance(part, Table):
            _print_whole(part, console)
        else:
            console.print(part)


def _print_whole(table: Table, console: Console) -> None:
    """Print `table` never narrower than its numbers need: a narrower terminal wraps the
    lines, where rich would cut the numbers to "0.0…" and drop whole columns."""
    measured = Measurement.get(console, console.options.update_width(10_000), table)
    if measured.minimum <= console.width:
        console.print(table)
        return
    wide = console.options.update_width(measured.maximum)  # its natural width
    for line in console.render_lines(table, wide, new_lines=True):
        console.print(Segments(line), end="", soft_wrap=True)


def plot(report: Report, path: Path) -> None:
    """A PNG: each candidate's per-task rewards (left), and each candidate's mean
    difference from the baseline with its interval (right)."""
    figure_of(report).savefig(path, dpi=110)


def figure_of(report: Report) -> Figure:
    """The figure `plot` saves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = sorted({s.task for c in report.candidates for s in c.per_task})
    height = max(4.0, 0.3 * len(tasks) + 2.4, 0.7 * len(report.comparisons) + 2.4)
    figure = Figure(figsize=(14, height), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2, width_ratios=(3, 2))
    colours = {c.key: f"C{index % 10}" for index, c in enumerate(report.candidates)}
    label = Labels(report)
    _plot_rewards(left, report, tasks, colours, label)
    _plot_differences(right, report, colours, label)
    figure.legend(loc="outside lower center", ncols=min(3, len(report.candidates)),
                  fontsize="small", frameon=False)
    return figure


def _wrapped(text: str, width: int = 40) -> str:
    """A title or label that stays inside its panel, however long the names in it."""
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False))


def _plot_rewards(axes: Axes, report: Report, tasks: list[str], colours: dict[Key, str],
                  label: Labels) -> None:
    candidates = report.candidates
    baseline = report.comparisons[0].baseline_key if report.comparisons else None
    row = {task: index for index, task in enumerate(tasks)}
    spread = 0.6 / max(1, len(candidates))
    plotted = 0
    for index, candidate in enumerate(candidates):
        offset = (index - (len(candidates) - 1) / 2) * spread
        scored = [(s.mean_reward, row[s.task] + offset) for s in candidate.per_task
                  if s.mean_reward is not None]
        plotted += len(scored)
        axes.scatter([x for x, _ in scored], [y for _, y in scored],
                     s=30, label=label(candidate.key)
                     + (" (baseline)" if candidate.key == baseline else ""), zorder=3,
                     color=colours[candidate.key])
    unscored = [task for task in tasks if not any(
        s.task == task and s.mean_reward is not None for c in candidates for s in c.per_task)]
    for task in unscored:
        axes.annotate("no attempt has a reward", (0.5, row[task]), ha="center", va="center",
                      fontsize="small", color="grey")
    axes.set_yticks(range(len(tasks)), tasks, fontsize="small" if len(tasks) > 20 else None)
    axes.invert_yaxis()
    if len(tasks) > 1:
        axes.set_ylim(len(tasks) - 0.5, -0.5)
    if _unit_rewards(candidates):
        axes.set_xlim(-0.05, 1.05)
    axes.set_xlabel("mean reward over attempts")
    axes.set_title(_wrapped(f"per-task reward, {len(tasks)} task{'s' * (len(tasks) != 1)}"))
    axes.grid(axis="x", alpha=0.3)
    if plotted == 0:
        axes.text(0.5, 0.5, "no trial has a reward\n(every trial ended before its verifier;\n"
                  "--missing-as-zero counts them as 0)", transform=axes.transAxes,
                  ha="center", va="center", color="grey")


def _unit_rewards(candidates: list[CandidateSummary]) -> bool:
    return all(0 <= (s.mean_reward or 0) <= 1 for c in candidates for s in c.per_task)


def _plot_differences(axes: Axes, report: Report, colours: dict[Key, str],
                      label: Labels) -> None:
    comparisons = report.comparisons
    axes.axvline(0.0, color="grey", linewidth=1)
    if _unit_rewards(report.candidates):  # one scale for every comparison of such rewards
        axes.set_xlim(-1.1, 1.1)
        axes.set_xticks([-1.0, -0.5, 0.0, 0.5, 1.0])
    axes.set_title(_wrapped(f"difference from the baseline, "
                            f"{label(comparisons[0].baseline_key)}") if comparisons
                   else "difference from the baseline")
    axes.set_xlabel(f"mean difference, {report.settings.confidence:.0%} paired bootstrap CI\n"
                    + _wrapped(W_L_T, 48), fontsize="small")
    if not comparisons:
        axes.text(0.5, 0.5, "one candidate: nothing to compare it with",
                  transform=axes.transAxes, ha="center", va="center", color="grey")
    for index, c in enumerate(comparisons):
        if c.mean_difference is None:
            axes.annotate("no task paired with the baseline", (0.0, index), ha="center",
                          va="center", fontsize="small", color="grey")
            continue
        if c.ci_low is not None and c.ci_high is not None:
            axes.errorbar([c.mean_difference], [index],
                          xerr=[[c.mean_difference - c.ci_low], [c.ci_high - c.mean_difference]],
                          fmt="o", capsize=4, color=colours[c.candidate_key])
        else:
            axes.plot([c.mean_difference], [index], "o", color=colours[c.candidate_key])
        p = "-" if c.p_value is None else f"{c.p_value:.2g}"
        axes.annotate(f"p={p}  {c.wins}W/{c.losses}L/{c.ties}T  n={c.tasks}",
                      (c.mean_difference, index), textcoords="offset points", xytext=(0, 8),
                      ha="center", fontsize="small")
    axes.set_yticks(range(len(comparisons)),
                    [_wrapped(label(c.candidate_key), 24) for c in comparisons])
    if comparisons:
        axes.set_ylim(len(comparisons) - 0.5, -0.5)
    axes.grid(axis="x", alpha=0.3)
