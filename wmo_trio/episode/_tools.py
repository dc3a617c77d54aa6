"""The agent's tools: their schemas, and how a command's output becomes an observation."""

from __future__ import annotations

import functools

from wmo_trio._text import valid_text
from wmo_trio.harness import ENVIRONMENT_TOOLS
from wmo_trio.models import Observation
from wmo_trio.providers._base import ToolSpec

MAX_OBSERVATION_CHARS = 10_000

_DESCRIPTIONS: dict[str, tuple[str, dict[str, str]]] = {
    "bash": (
        "Run a shell command in the task environment and return its stdout and stderr.",
        {"command": "The command, run by /bin/sh -c style shells in the working directory."},
    ),
    "read_file": (
        "Print a file of the task environment.",
        {"path": "Path of the file, absolute or relative to the working directory."},
    ),
    "write_file": (
        "Write a file in the task environment, creating parent directories. The content is "
        "written exactly as given.",
        {"path": "Path of the file, absolute or relative to the working directory.",
         "content": "The complete new content of the file."},
    ),
    "submit": (
        "Finish the task and give your final answer. Call it once, when the work is done.",
        {"answer": "Your final answer or a short summary of what you did."},
    ),
    "read_skill": (
        "Read one of the skills listed in the system prompt.",
        {"name": "The skill's name."},
    ),
}


@functools.cache
def tool_spec(name: str) -> ToolSpec:
    """The schema of a known tool (one shared, frozen instance per tool)."""
    description, arguments = _DESCRIPTIONS[name]
    return ToolSpec(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {arg: {"type": "string", "description": text}
                           for arg, text in arguments.items()},
            "required": list(arguments),
            "additionalProperties": False,
        },
    )


def tool_arguments(name: str) -> tuple[str, ...]:
    return tuple(_DESCRIPTIONS[name][1])


def is_environment_tool(name: str | None) -> bool:
    return name in ENVIRONMENT_TOOLS


def _cut_marker(cut: int) -> str:
    return (
        f"\n[... {cut} characters cut from the middle of this output: narrow the command "
        "(grep, head, tail) or page through the output (sed -n 'START,ENDp') ...]\n"
    )


def bounded_text(text: str, *, suffix: str = "", limit: int = MAX_OBSERVATION_CHARS) -> str:
    """`text + suffix` in at most `limit` characters, markers included.

    An over-long text keeps its head and tail (the head usually says what the output is, the
    tail how it ended) and says how much of the middle was cut. The suffix is always kept.
    """
    if len(text) + len(suffix) <= limit:
        return text + suffix
    room = limit - len(suffix)
    cut = len(text)
    # The marker's length depends on the number it reports; two rounds reach a fixed point
    # because the count can only shrink, and so can its digits.
    for _ in range(2):
        keep = max(0, room - len(_cut_marker(cut)))
        cut = len(text) - keep
    head = keep - keep // 2
    tail = keep // 2
    result = text[:head] + _cut_marker(cut) + (text[len(text) - tail:] if tail else "") + suffix
    assert len(result) <= limit
    return result


def command_observation(stdout: str, stderr: str, return_code: int) -> Observation:
    """The observation of a finished command: stdout then stderr, `[exit N]` on failure."""
    suffix = f"\n[exit {return_code}]" if return_code != 0 else ""
    return Observation(
        content=valid_text(bounded_text(stdout + stderr, suffix=suffix)),
        is_error=return_code != 0,
        metadata={"return_code": return_code},
    )


def failure_observation(error: BaseException) -> Observation:
    """A failure of the environment call itself: feedback for the agent, never fatal."""
    return Observation(
        content=valid_text(bounded_text(f"environment command failed: {type(error).__name__}: {error}")),
        is_error=True,
    )


def invalid_arguments(tool: str, problem: str) -> Observation:
    return Observation(content=f"invalid {tool} arguments: {problem}", is_error=True)


def unavailable(tool: str | None) -> Observation:
    return Observation(content=f"tool {tool!r} not available", is_error=True)


def decode_output(data: bytes) -> str:
    """Command output as text; bytes that are not UTF-8 become U+FFFD, never an error."""
    return data.decode("utf-8", errors="replace")


def argument_problem(tool: str, arguments: object) -> str | None:
    """What is wrong with a tool call's arguments, or None when they fit the schema.

    Every argument is a required string; `path` must also be non-empty.
    """
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    expected = tool_arguments(tool)
    for name in expected:
        if name not in arguments:
            return f"missing argument {name!r}"
        if not isinstance(arguments[name], str):
            return f"{name!r} must be a string, got {type(arguments[name]).__name__}"
    extra = sorted(set(arguments) - set(expected))
    if extra:
        return f"unexpected argument {extra[0]!r}; {tool} takes {', '.join(expected)}"
    if "path" in expected and not arguments["path"]:
        return "'path' must be a non-empty string"
    return None
