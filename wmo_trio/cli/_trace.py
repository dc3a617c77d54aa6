"""`wmo-trio trace`: an episode's trace, step by step, for a terminal or a machine.

Everything shown comes from a trial (the model's text, commands, observations): it is
printed as plain text with control characters made visible, so nothing in it can drive the
terminal, and files are read with a size bound, never through a link a search found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pydantic
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from wmo_trio._files import read_bounded
from wmo_trio.cli._run import BadInput
from wmo_trio.cli._text import visible
from wmo_trio.models import ActionKind, Step
from wmo_trio.settings import validation_problem
from wmo_trio.trace import TRACE_FILENAME, PartialTrace, Trace, parse_trace

MAX_TRACE_BYTES = 64 * 2**20
MAX_RESULT_BYTES = 4 * 2**20
# A job directory holds trials; a jobs directory holds jobs: traces lie one or two levels down.
_SEARCHES = (f"*/agent/{TRACE_FILENAME}", f"*/*/agent/{TRACE_FILENAME}")


@dataclass
class TrialOutcome:
    """What harbor's result.json beside a trace says of its trial."""

    reward: float | None
    exception: str | None


@dataclass
class Found:
    path: Path
    trace: Trace
    outcome: TrialOutcome | None
    note: str | None = None


def _trial_outcome(trace_path: Path) -> TrialOutcome | None:
    """The reward and exception harbor recorded for the trial a trace belongs to
    (`<trial>/agent/wmo-run.json` beside `<trial>/result.json`), if it is one."""
    result_path = trace_path.parent.parent / "result.json"
    try:
        data = json.loads(read_bounded(result_path, MAX_RESULT_BYTES, follow=False))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    rewards = (data.get("verifier_result") or {}).get("rewards") or {}
    reward = rewards.get("reward") if isinstance(rewards, dict) else None
    exception = (data.get("exception_info") or {}).get("exception_type")
    return TrialOutcome(reward if isinstance(reward, int | float) else None,
                        str(exception) if exception else None)


def _what_else(data: object) -> tuple[str, Path] | None:
    """For harbor's own JSON files: what the file is, and where its trial's trace lies
    relative to the file's directory."""
    if not isinstance(data, dict):
        return None
    if str(data.get("schema_version", "")).startswith("ATIF"):
        return "harbor's ATIF trajectory", Path(TRACE_FILENAME)
    if "trial_name" in data and "task_name" in data:
        return "harbor's trial result", Path("agent") / TRACE_FILENAME
    if "n_total_trials" in data:
        return "harbor's job result", Path(".")
    return None


def load(path: Path, *, follow: bool = True) -> Trace:
    """The trace in `path`. Raises `BadInput` with one line saying what is wrong."""
    try:
        return parse_trace(read_bounded(path, MAX_TRACE_BYTES, follow=follow))
    except pydantic.ValidationError as error:
        raise BadInput(f"{path} is not a wmo_trio trace ({TRACE_FILENAME}): "
                       f"{validation_problem(error, whole='the document', most=1)}") from None
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise BadInput(f"{path} is not a wmo_trio trace ({TRACE_FILENAME}): {reason}") from None


def _one_file(path: Path) -> list[Found]:
    try:
        data = json.loads(read_bounded(path, MAX_TRACE_BYTES, follow=True))
    except (OSError, ValueError):
        data = None
    other = _what_else(data)
    if other is None:
        trace = load(path)
        return [Found(path, trace, _trial_outcome(path))]
    what, beside = other
    target = path.parent / beside
    note = f"{path} is {what}; showing the trace{'s' if beside == Path('.') else ''} of its " \
           f"{'job' if beside == Path('.') else 'trial'}"
    try:
        found = find(target) if beside == Path(".") else _one_file_or_none(target)
    except BadInput:
        found = []
    if not found:
        raise BadInput(f"{path} is {what}, not a wmo_trio trace, and no {TRACE_FILENAME} lies "
                       "beside it; pass a trial or job directory of a wmo_trio run")
    found[0].note = note
    return found


def _one_file_or_none(path: Path) -> list[Found]:
    if not path.is_file() or path.is_symlink():
        return []
    return [Found(path, load(path, follow=False), _trial_outcome(path))]


def _no_link_below(root: Path, path: Path) -> bool:
    """Whether nothing from `root` down to `path` is a link: a trial may leave one where
    its trace, or its agent directory, should be, and it is never followed."""
    return not any(part.is_symlink() for part in (path, *path.parents)
                   if part.is_relative_to(root) and part != root)


def find(path: Path, problems: list[str] | None = None) -> list[Found]:
    """The traces of a trace file (or another of harbor's files of a trial), a trial
    directory, a job directory or a directory of jobs, each with its trial's outcome. In a
    search over many, a trace that cannot be read is described in `problems` and skipped."""
    problems = [] if problems is None else problems
    if path.is_file():
        return _one_file(path)
    if not path.is_dir():
        raise BadInput(f"{path} does not exist; pass a {TRACE_FILENAME}, a trial directory, "
                       "a job directory or a directory of jobs")
    for candidate in (path / TRACE_FILENAME, path / "agent" / TRACE_FILENAME):
        if candidate.is_symlink():
            raise BadInput(f"{candidate} is a link, which a trial may have made: not followed")
        if candidate.is_file():
            return [Found(candidate, load(candidate, follow=False), _trial_outcome(candidate))]
    for pattern in _SEARCHES:
        paths = sorted(p for p in path.glob(pattern) if _no_link_below(path, p) and p.is_file())
        if paths:
            found: list[Found] = []
            for trace_path in paths:
                # One unreadable trace among many is reported, not the end of the listing.
                try:
                    found.append(Found(trace_path, load(trace_path, follow=False),
                                       _trial_outcome(trace_path)))
                except BadInput as error:
                    problems.append(str(error))
            if found:
                return found
            raise BadInput(problems.pop(0) + (f" (and {len(problems)} more traces like it)"
                                              if problems else ""))
    raise BadInput(f"no {TRACE_FILENAME} in {path} or the two levels below it; is it a trial, "
                   "a job or a directory of jobs of a wmo_trio run?")


# -- rendering -------------------------------------------------------------------------------

def clip(text: str, lines: int, chars: int) -> str:
    """At most `lines` lines and `chars` characters of `text`, saying what was left out."""
    kept = text.splitlines()[:lines]
    short = "\n".join(kept)
    if len(short) > chars:
        short = short[:chars]
    if len(short) < len(text.rstrip("\n")):
        short += f" … [{len(text) - len(short):,} more characters]"
    return short


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


@dataclass
class Limits:
    text_lines: int = 6
    text_chars: int = 600
    command_lines: int = 12
    command_chars: int = 1500
    output_lines: int = 8
    output_chars: int = 800


FULL = Limits(*(10**9 for _ in range(6)))


def describe_action(step: Step, limits: Limits) -> str:
    """The action as it was sent: a command as the shell got it, a file's path and content."""
    action = step.action
    arguments = action.arguments or {}
    name = action.name or "?"
    if action.kind is ActionKind.MESSAGE:
        return ""
    if name == "bash" and isinstance(arguments.get("command"), str):
        return "$ " + clip(arguments["command"], limits.command_lines, limits.command_chars)
    if name in ("read_file", "read_skill") and len(arguments) == 1:
        return f"{name} {next(iter(arguments.values()))}"
    if name == "write_file" and isinstance(arguments.get("content"), str):
        content = arguments["content"]
        return (f"write_file {arguments.get('path')} ({_plural(len(content), 'character')})\n"
                + clip(content, limits.command_lines, limits.command_chars))
    if name == "submit" and len(arguments) == 1:
        return f"submit {next(iter(arguments.values()))}"
    shown = ", ".join(f"{key}={value}" if isinstance(value, str) else f"{key}={json.dumps(value)}"
                      for key, value in arguments.items())
    return f"{name}({shown})"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines() or [""])


def _stamp(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).strftime(
            "%Y-%m-%d %H:%M:%S %Z").strip()
    except ValueError:
        return None


def identity_line(trace: Trace) -> str | None:
    """Which trial the trace is, from the fields traces carry (older traces have fewer)."""
    fields = [("trial", getattr(trace, "trial_name", None)),
              ("task", getattr(trace, "task_name", None)),
              ("model", getattr(trace, "model", None)),
              ("doc", getattr(trace, "doc_hash", None))]
    parts = [f"{label} {value}" for label, value in fields if value]
    started, ended = getattr(trace, "started_at", None), getattr(trace, "ended_at", None)
    if _stamp(started):
        parts.append(f"started {_stamp(started)}")
    if isinstance(started, str) and isinstance(ended, str):
        try:
            seconds = (datetime.fromisoformat(ended.replace("Z", "+00:00"))
                       - datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds()
            parts.append(f"{seconds:.1f} s")
        except ValueError:
            pass
    if not parts:
        task_id = getattr(trace, "task_id", None)
        return f"task id {task_id}" if task_id else None
    return " · ".join(parts)


def _no_steps(trace: Trace) -> str:
    usage = trace.worker_usage
    calls = f"after {_plural(usage.calls, 'model call')}" if usage and usage.calls else \
        "before any model call"
    return (f"no steps recorded: the episode ended ({trace.stop_reason}) {calls}, without "
            "calling a tool (a code:runtime program's own model calls are not steps; its "
            "tool calls are)")


def render(found: Found, console: Console, limits: Limits | None = None) -> None:
    """The trace as text for a person: the trial, each step (the model's text, the action as
    sent, the observation), how it ended, the trial's reward and the usage."""
    limits = limits or Limits()
    trace = found.trace
    console.print(Rule(Text(visible(str(found.path))), align="left"))
    identity = identity_line(trace)
    if identity:
        console.print(Text(visible(identity), style="dim"))
    if not trace.steps:
        console.print(Text(_no_steps(trace), style="yellow"))
    for number, step in enumerate(trace.steps, start=1):
        duration = getattr(step, "duration_s", None)
        head = Text(f"{number:>3} ", style="bold")
        if isinstance(duration, int | float):
            head.append(f"({duration:.2f} s) ", style="dim")
        said = step.action.content or ""
        if said.strip():
            head.append(visible(clip(said.strip(), limits.text_lines, limits.text_chars)).replace(
                "\n", "\n    "), style="italic")
        console.print(head, soft_wrap=True)
        action = describe_action(step, limits)
        if action:
            # Unwrapped: a command copied from the screen is the command that ran.
            console.print(Text(_indent(visible(action), "    "), style="cyan"), soft_wrap=True)
        observation = clip(step.observation.content, limits.output_lines, limits.output_chars)
        console.print(Text(_indent(visible(observation), "    │ "),
                           style="red" if step.observation.is_error else ""), soft_wrap=True)
    summary = Text(f"stop reason: {trace.stop_reason}", style="bold")
    summary.append(f"   turns: {trace.turns}   answer: {visible(repr(trace.answer))}")
    if isinstance(trace, PartialTrace):
        summary.append(f"   partial: {visible(trace.error) if trace.error else 'yes'}")
    console.print(summary)
    if found.outcome is not None:
        reward = "none" if found.outcome.reward is None else f"{found.outcome.reward:g}"
        line = f"reward: {reward}" + (f"   exception: {found.outcome.exception}"
                                      if found.outcome.exception else "")
        console.print(Text(line, style="bold"))
    usage = trace.worker_usage
    if usage is not None:
        console.print(f"usage: {usage.input_tokens:,} input ({usage.cached_input_tokens:,} "
                      f"cached), {usage.output_tokens:,} output, {_plural(usage.calls, 'call')}",
                      highlight=False)
    console.print()


def as_json(found: list[Found]) -> str:
    payload: list[dict[str, Any]] = [
        {"path": str(one.path), "trace": one.trace.model_dump(mode="json"),
         "reward": None if one.outcome is None else one.outcome.reward,
         "exception": None if one.outcome is None else one.outcome.exception}
        for one in found
    ]
    return json.dumps(payload if len(payload) != 1 else payload[0], indent=2, ensure_ascii=False)
