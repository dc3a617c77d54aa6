"""Episode programs for the backends' tests: the documented text-protocol agent as a
`code:runtime` document, the scripted replies that solve its task, and one episode run on
a named backend."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wmo_trio.backends import build_execution
from wmo_trio.episode import DirectoryShell
from wmo_trio.harness import HarnessDoc, parse_harness
from wmo_trio.models import RunResult

# The program docs/documents.md shows: a text-protocol agent over the kit.
AGENT = """
def run(kit):
    system = kit.system_prompt + "\\n\\n" + kit.tools_text()
    messages = [{"role": "user", "content": kit.instruction}]
    for _ in range(kit.params["max_turns"]):
        reply = kit.complete(system, messages)
        messages.append({"role": "assistant", "content": reply})
        call = kit.parse_tool_call(reply)
        if call is None:
            return reply.strip()
        observation = kit.execute(call["tool"], call["arguments"])  # submit does not return
        messages.append({"role": "user", "content": observation.content})
    return ""
"""


INSTRUCTION = "Create the file `out/greeting.txt` whose whole content is the line `hi`"


def text_call(tool: str, **arguments: str) -> dict[str, Any]:
    """A scripted model reply that writes a tool call as text, in a json fence."""
    return {"text": f"Next step.\n```json\n{json.dumps({'tool': tool, 'arguments': arguments})}\n```"}


SOLVE = [text_call("write_file", path="out/greeting.txt", content="hi\n"),
         text_call("read_file", path="out/greeting.txt"),
         text_call("submit", answer="wrote out/greeting.txt")]


def code_doc(source: str, *, policy: str | None = None, skill: str | None = None,
             **params: int) -> HarnessDoc:
    surfaces: list[dict[str, Any]] = [
        {"id": "prompt:core", "kind": "prompt", "content": "You are a careful agent."},
        {"id": "code:runtime", "kind": "code", "content": textwrap.dedent(source)},
    ]
    if policy is not None:
        surfaces.append({"id": "tool_policy:main", "kind": "tool_policy", "content": policy})
    if skill is not None:
        surfaces.append({"id": "skill:notes", "kind": "skill",
                         "content": f"---\nname: notes\ndescription: How to take notes\n---\n{skill}"})
    for name, value in params.items():
        surfaces.append({"id": f"param:{name.replace('_', '-')}", "kind": "param", "content": str(value)})
    return parse_harness({"name": "code", "surfaces": surfaces})


def run_on(backend: str, doc: HarnessDoc, provider: Any, workdir: Path, *,
           should_cancel: Callable[[], bool] | None = None,
           backend_settings: dict[str, Any] | None = None, **settings: Any) -> RunResult:
    """The episode of `doc` on `backend`; `settings` are the episode's (`EpisodeSettings`)."""
    with build_execution(doc, provider, settings, backend=backend, backend_settings=backend_settings,
                       should_cancel=should_cancel) as runtime:
        return runtime.run("task", INSTRUCTION, DirectoryShell(workdir, command_timeout_sec=30))


def call(tool: str, **arguments: str) -> dict[str, Any]:
    return {"name": tool, "arguments": arguments}


def reply(*calls: dict[str, Any], text: str = "") -> dict[str, Any]:
    return {"text": text, "tool_calls": list(calls)}

