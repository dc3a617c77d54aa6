"""The turn limit (`param:max-turns`): counted by the host's services alone, for the built-in
loop and a document's program, in-process and in a sandbox (issue 16.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from doubles import Spy, make_doc

from wmo_trio.control import CallControl
from wmo_trio.episode import DirectoryShell
from wmo_trio.episode._log import EpisodeLog
from wmo_trio.episode._services import EpisodeEnded, EpisodeServices, episode_spec
from wmo_trio.episode.portable import run_loop
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import StopReason
from wmo_trio.providers import ProviderRequest

BASH = {"tool_calls": [{"name": "bash", "arguments": {"command": "true"}}]}


def services(doc: HarnessDoc, script: list[dict[str, Any]], tmp_path: Path) -> EpisodeServices:
    return EpisodeServices(doc, Spy(script), EpisodeLog(), CallControl(),
                           DirectoryShell(tmp_path, command_timeout_sec=30),
                           stopping=lambda: False, episode_timeout_sec=60, context_window=None)


def request() -> ProviderRequest:
    return ProviderRequest(system="s", messages=[], tools=[], max_output_tokens=100)


class HostGrantingTurns:
    """A host, as the loop sees it through its channel, that grants `turns` turns: the
    loop is told how many are left, whatever the document's parameter says."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.calls = 0

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {"text": "", "tool_calls": [{"id": f"c{self.calls}", "name": "bash",
                                            "arguments": {"command": "true"}}],
                "turns_left": self.turns - self.calls}

    def execute(self, tool: str, arguments: Any, content: Any, parse_error: Any) -> dict[str, Any]:
        return {"content": "", "is_error": False}

    def step(self, action: dict[str, Any], observation: dict[str, Any]) -> None:
        pass


def test_the_loop_ends_when_the_host_says_no_turns_are_left() -> None:
    spec = episode_spec(make_doc(max_turns=20), task_id="t", instruction="go", context_window=None)
    host = HostGrantingTurns(2)
    assert run_loop(spec, host) == "max_turns"
    assert host.calls == 2


def test_the_host_counts_turns_and_says_how_many_are_left(tmp_path: Path) -> None:
    host = services(make_doc(max_turns=2), [BASH] * 3, tmp_path)
    assert host.turns_left() == 2
    assert host.completion(request())["turns_left"] == 1
    assert host.completion(request())["turns_left"] == 0


@pytest.mark.parametrize(("code", "ending"), [(False, StopReason.MAX_TURNS),
                                              (True, StopReason.BUDGET)])
def test_a_model_call_past_the_limit_ends_the_episode(tmp_path: Path, code: bool,
                                                      ending: StopReason) -> None:
    doc = make_doc(max_turns=1)
    if code:
        doc = doc.with_surfaces({"id": "code:runtime", "kind": "code",
                                 "content": "def run(kit):\n    return ''\n"})
    host = services(doc, [BASH] * 2, tmp_path)
    host.complete(request())
    with pytest.raises(EpisodeEnded) as ended:
        host.complete(request())
    assert ended.value.reason is ending
    assert host.log.steps()[-1].observation.content == (
        "episode stopped: all 1 model calls of param:max-turns are used")


def test_the_loop_may_end_with_max_turns_only_when_its_turns_are_used(tmp_path: Path) -> None:
    host = services(make_doc(max_turns=2), [BASH] * 2, tmp_path)
    host.complete(request())
    assert host.finish("max_turns") == (StopReason.UNKNOWN_DONE_REASON, "")
    assert host.log.steps()[-1].observation.content == (
        "the episode's program ended with the reason 'max_turns' with 1 of its turns left")
    used = services(make_doc(max_turns=1), [BASH], tmp_path)
    used.complete(request())
    assert used.finish("max_turns") == (StopReason.MAX_TURNS, "")


def test_a_fresh_attempt_counts_its_turns_from_the_first(tmp_path: Path) -> None:
    host = services(make_doc(max_turns=2), [BASH] * 4, tmp_path)
    host.complete(request())
    host.complete(request())
    host.begin_attempt()
    assert host.turns_left() == 2
    assert host.completion(request())["turns_left"] == 1
