"""`wmo-trio trace`: an episode's trace, step by step, for a terminal or a machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from wmo_trio.cli._run import BadInput
from wmo_trio.models import ActionKind, Step
from wmo_trio.trace import TRACE_FILENAME, PartialTrace, Trace, parse_trace


def find_traces(path: Path) -> list[Path]:
    """The `wmo-run.json` files of a trace file, a trial directory or a job directory."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise BadInput(f"{path} does not exist; pass a wmo-run.json, a trial directory or a "
                       "job directory")
    for candidate in (path / TRACE_FILENAME, path / "agent" / TRACE_FILENAME):
        if candidate.is_file():
            return [candidate]
    found = sorted(path.glob(f"*/agent/{TRACE_FILENAME}"))
    if not found:
        raise BadInput(f"no {TRACE_FILENAME} under {path}; is it a job or trial directory of "
                       "a wmo_trio run?")
    return found


def load(path: Path) -> Trace:
    try:
        return parse_trace(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise BadInput(f"{path} is not a wmo_trio trace: {error}") from None


def shorten(text: str, limit: int) -> str:
    flat = text.replace("\n", "⏎ ")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def describe_action(step: Step) -> str:
    action = step.action
    if action.kind is ActionKind.MESSAGE:
        return f"(message) {action.content or ''}"
    arguments = ", ".join(f"{k}={v!r}" for k, v in (action.arguments or {}).items())
    return f"{action.name}({arguments})"


def render(trace: Trace, source: Path, console: Console, width: int = 100) -> None:
    table = Table(title=str(source), show_lines=False, expand=False)
    table.add_column("#", justify="right")
    table.add_column("action", overflow="fold", max_width=width // 2)
    table.add_column("observation", overflow="fold", max_width=width // 2)
    for number, step in enumerate(trace.steps, start=1):
        observation = Text(shorten(step.observation.content, 160),
                           style="red" if step.observation.is_error else "")
        table.add_row(str(number), shorten(describe_action(step), 160), observation)
    console.print(table)
    usage = trace.worker_usage
    console.print(
        f"stop reason: [bold]{trace.stop_reason}[/bold]   turns: {trace.turns}   "
        f"answer: {trace.answer!r}"
        + (f"   partial: {trace.error or 'yes'}" if isinstance(trace, PartialTrace) else "")
    )
    if usage is not None:
        console.print(f"usage: {usage.input_tokens:,} input ({usage.cached_input_tokens:,} cached)"
                      f", {usage.output_tokens:,} output, {usage.calls} calls")


def as_json(traces: list[tuple[Path, Trace]]) -> str:
    payload: list[dict[str, Any]] = [
        {"path": str(path), "trace": trace.model_dump(mode="json")} for path, trace in traces
    ]
    return json.dumps(payload if len(payload) != 1 else payload[0], indent=2, ensure_ascii=False)
