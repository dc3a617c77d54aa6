"""The scripted provider's built-in offline policy.

A small rule-based "model" that makes real tool calls, so the demo and the tests exercise a
real episode (real commands in a real environment, a real verifier) without an API key.
It recognises the shapes of the bundled example tasks from their instructions; on anything
else it looks around once and gives up, which the verifier scores as a failure.

The policy is a pure function of the request: the number of assistant messages so far is
the position in the plan. That keeps it deterministic across concurrent episodes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from wmo_trio.providers._base import ProviderRequest
from wmo_trio.providers._script import ScriptedReply, ScriptedToolCall, first_user_message

Plan = list[tuple[str, str, dict[str, str]]]  # (thought, tool, arguments)

_CALC_OPS = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
_CALC_MAIN = (
    "import sys\n\nfrom {pkg}.ops import add, mul\n\n"
    "op, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
    'print({{"add": add, "mul": mul}}[op](a, b))\n'
)


def _file_with_line(match: re.Match[str]) -> Plan:
    path, line = match.group("path"), match.group("line")
    return [
        ("I will write the file with the requested line.", "write_file",
         {"path": path, "content": line + "\n"}),
        ("Let me check the file.", "read_file", {"path": path}),
        ("The file is in place.", "submit", {"answer": f"wrote {path}"}),
    ]


def _python_package(match: re.Match[str]) -> Plan:
    pkg, root = match.group("pkg"), match.group("root").rstrip("/")
    base = f"{root}/{pkg}"
    return [
        ("Create the package marker.", "write_file", {"path": f"{base}/__init__.py", "content": ""}),
        ("Write the operations.", "write_file", {"path": f"{base}/ops.py", "content": _CALC_OPS}),
        ("Write the command line.", "write_file",
         {"path": f"{base}/__main__.py", "content": _CALC_MAIN.format(pkg=pkg)}),
        ("Try both commands.", "bash",
         {"command": f"cd {root} && python3 -m {pkg} add 2 3 && python3 -m {pkg} mul 4 5"}),
        ("Both commands print the right values.", "submit", {"answer": f"package {pkg} created"}),
    ]


def _hash_prefix_search(match: re.Match[str]) -> Plan:
    # A plain brute-force search: correct, and slow on purpose (see the task's timeout).
    prefix, target, out = match.group("salt"), match.group("zeros"), match.group("out")
    program = (
        "import hashlib, itertools\n"
        "for n in itertools.count(1):\n"
        f"    if hashlib.sha256(({prefix!r} + str(n)).encode()).hexdigest().startswith({target!r}):\n"
        f"        open({out!r}, 'w').write(f'{{n}}\\n')\n"
        "        break\n"
    )
    return [
        ("Search for n by brute force.", "bash",
         {"command": "python3 -c " + _shell_quote(program)}),
        ("Check the result.", "read_file", {"path": out}),
        ("Found it.", "submit", {"answer": f"see {out}"}),
    ]


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


_RECIPES: list[tuple[re.Pattern[str], Callable[[re.Match[str]], Plan]]] = [
    (re.compile(r"Create the file `(?P<path>[^`]+)` whose whole content is the line "
                r"`(?P<line>[^`]+)`"), _file_with_line),
    (re.compile(r"Python package named `(?P<pkg>\w+)` in `(?P<root>[^`]+)`"), _python_package),
    (re.compile(r"string\s+`(?P<salt>[^`<]*)<n>`.*?starts with `(?P<zeros>[0-9a-f]+)`.*?"
                r"to `(?P<out>[^`]+)`", re.S), _hash_prefix_search),
]

_UNKNOWN: Plan = [
    ("Let me look around.", "bash", {"command": "pwd && ls -la"}),
    ("I have no plan for this task.", "submit",
     {"answer": "the offline policy has no recipe for this task"}),
]


def plan_for(instruction: str) -> Plan:
    for pattern, recipe in _RECIPES:
        match = pattern.search(instruction)
        if match:
            return recipe(match)
    return _UNKNOWN


def offline_policy(request: ProviderRequest) -> ScriptedReply:
    plan = plan_for(first_user_message(request.messages))
    turn = sum(1 for m in request.messages if m.role == "assistant")
    thought, tool, arguments = plan[min(turn, len(plan) - 1)]
    if not request.tools:
        # A plain-text call (a code:runtime program's `kit.complete`): the call is written
        # in the text, in the format the kit's `tools_text` asks for and `parse_tool_call` reads.
        call = json.dumps({"tool": tool, "arguments": arguments}, indent=1)
        return ScriptedReply(text=f"{thought}\n\n```json\n{call}\n```")
    if tool not in {t.name for t in request.tools}:
        # The document took this tool away: say so in plain text, which the episode
        # treats as a reply without a tool call.
        return ScriptedReply(text=f"I wanted to call {tool}, but it is not available.")
    return ScriptedReply(
        text=thought,
        tool_calls=[ScriptedToolCall(name=tool, arguments=dict(arguments))],
    )
