"""`code:runtime` documents on the local backend: `LocalExecution` runs the program and its kit in-process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from doubles import Spy, when
from support.programs import AGENT, INSTRUCTION, SOLVE, code_doc

from wmo_trio.episode import DirectoryShell, LocalExecution
from wmo_trio.episode._services import tools_text
from wmo_trio.episode.portable import parse_tool_call
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import ActionKind, RunResult, StopReason


def run_code(doc: HarnessDoc, script: list[dict[str, Any]], workdir: Path,
             **settings: Any) -> tuple[RunResult, Spy]:
    """The episode of `doc`; `settings` are the episode's (`EpisodeSettings`)."""
    provider = Spy(script)
    runtime = LocalExecution(doc, provider, settings)
    result = runtime.run("task", INSTRUCTION, DirectoryShell(workdir, command_timeout_sec=30))
    return result, provider


# -- solving a task --------------------------------------------------------------------


def test_a_program_solves_the_task_through_the_kit(tmp_path: Path) -> None:
    result, provider = run_code(code_doc(AGENT), SOLVE, tmp_path)
    assert result.stop_reason is StopReason.SUBMITTED
    assert result.answer == "wrote out/greeting.txt"
    assert (tmp_path / "out" / "greeting.txt").read_text() == "hi\n"
    assert [(s.action.name, s.observation.content) for s in result.steps] == [
        ("write_file", "wrote out/greeting.txt"), ("read_file", "hi\n"), ("submit", "submitted")]
    assert result.turns == 3
    assert result.worker_usage is not None and result.worker_usage.calls == 3 == len(provider.requests)


def test_model_calls_are_plain_text_within_the_documents_limits(tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.complete("sys", [{"role": "user", "content": "a"}])
        kit.complete("sys", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                             {"role": "user", "content": "c"}], temperature=0.0, max_tokens=50)
        return "ok"
    """
    doc = code_doc(source, max_output_tokens=100)
    result, provider = run_code(doc, [{"text": "x"}, {"text": "y"}], tmp_path)
    assert returned(result) == "ok"
    first, second = provider.requests
    assert first.tools == [] and first.system == "sys"
    assert first.max_output_tokens == 100  # the kit's 2048 capped by param:max-output-tokens
    assert first.temperature == doc.params.temperature
    assert second.max_output_tokens == 50 and second.temperature == 0.0
    assert [(m.role, m.content) for m in second.messages] == [("user", "a"), ("assistant", "b"),
                                                               ("user", "c")]


def test_the_context_window_caps_a_programs_output_tokens(tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.complete("s", [{"role": "user", "content": "a"}], max_tokens=4000)
    """
    _, provider = run_code(code_doc(source), [{"text": "x"}], tmp_path, context_window=2048)
    assert provider.requests[0].max_output_tokens == 1024


def returned(result: RunResult) -> str:
    """What a program returned: not an answer (it did not submit), but the text of the
    step that ends its trace."""
    assert result.stop_reason is StopReason.NO_ACTION and result.answer == ""
    last = result.steps[-1]
    assert last.action.kind is ActionKind.MESSAGE and last.observation.is_error
    assert "returned without calling submit" in last.observation.content
    return last.action.content or ""


def test_a_program_that_returns_without_submitting_has_not_submitted(tmp_path: Path) -> None:
    """The example program of docs/documents.md, given a reply with no tool call, returned the reply:
    the episode read `submitted` with 0 turns and the model's excuse as its answer."""
    source = """
    def run(kit):
        reply = kit.complete("s", [{"role": "user", "content": kit.instruction}])
        return reply.strip()
    """
    result, _ = run_code(code_doc(source), [{"text": "I wanted to call write_file."}], tmp_path)
    assert (result.stop_reason, result.answer, result.turns) == (StopReason.NO_ACTION, "", 0)
    assert returned(result) == "I wanted to call write_file."


@pytest.mark.parametrize("value", ['""', "None", "'   '[:0]"])
def test_returning_no_answer_is_no_action(tmp_path: Path, value: str) -> None:
    result, _ = run_code(code_doc(f"def run(kit):\n    return {value}\n"), [{"text": "x"}], tmp_path)
    assert result.stop_reason is StopReason.NO_ACTION
    assert result.answer == "" and result.steps == []


def test_an_async_run_is_awaited(tmp_path: Path) -> None:
    result, _ = run_code(code_doc("async def run(kit):\n    return 'from a coroutine'\n"),
                         [{"text": "x"}], tmp_path)
    assert returned(result) == "from a coroutine"


# -- failures of the program ---------------------------------------------------------------


def test_an_exception_ends_with_error_and_keeps_the_partial_transcript(tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.execute("bash", {"command": "echo before"})
        raise ValueError("the program gave up")
    """
    result, _ = run_code(code_doc(source), [{"text": "x"}], tmp_path)
    assert result.stop_reason is StopReason.ERROR
    bash, error = result.steps
    assert (bash.action.name, bash.observation.content) == ("bash", "before\n")
    assert error.action.kind is ActionKind.MESSAGE and error.observation.is_error
    assert error.observation.content == "code:runtime raised ValueError: the program gave up"
    assert error.observation.metadata["exception_type"] == "ValueError"
    assert 'raise ValueError("the program gave up")' in error.observation.metadata["traceback"]


@pytest.mark.parametrize("source, message", [
    ("def run(kit):\n    return 42\n", "code:runtime raised TypeError: run(kit) returned int"),
    ("def run(kit):\n    import sys\n    sys.exit(3)\n", "code:runtime raised SystemExit: 3"),
    ("def run(kit):\n    kit.complete('s', [{'role': 'system', 'content': 'x'}])\n",
     "code:runtime raised ValueError: messages[0]['role'] must be 'user' or 'assistant'"),
    ("def run(kit):\n    kit.execute('bash', {'command': object()})\n",
     "code:runtime raised TypeError: Object of type object is not JSON serializable"),
    # every check of the kit's two calls, each naming what was wrong
    ("def run(kit):\n    kit.complete(b's', [])\n",
     "code:runtime raised TypeError: system must be a string"),
    ("def run(kit):\n    kit.complete('s', 'hello')\n",
     "code:runtime raised TypeError: messages must be a list"),
    ("def run(kit):\n    kit.complete('s', ['hello'])\n",
     "code:runtime raised TypeError: messages[0] must be a dict"),
    ("def run(kit):\n    kit.complete('s', [{'role': 'user', 'content': 5}])\n",
     "code:runtime raised TypeError: messages[0]['content'] must be a string"),
    ("def run(kit):\n    kit.complete('s', [], temperature=True)\n",
     "code:runtime raised TypeError: temperature must be a number or None"),
    ("def run(kit):\n    kit.complete('s', [], max_tokens=0)\n",
     "code:runtime raised ValueError: max_tokens must be an integer >= 1"),
    ("def run(kit):\n    kit.execute(None)\n",
     "code:runtime raised TypeError: tool must be a string"),
    ("def run(kit):\n    kit.execute('bash', [('command', 'ls')])\n",
     "code:runtime raised TypeError: arguments must be a dict"),
])
def test_a_misused_kit_or_a_wrong_result_is_an_error(tmp_path: Path, source: str, message: str) -> None:
    result, provider = run_code(code_doc(source), [{"text": "x"}], tmp_path)
    assert result.stop_reason is StopReason.ERROR
    assert result.steps[-1].observation.content.startswith(message)
    assert provider.requests == []


# -- budgets and the host's authority ---------------------------------------------------------


def test_a_model_call_beyond_max_turns_ends_with_budget(tmp_path: Path) -> None:
    source = """
    def run(kit):
        while True:
            kit.complete("s", [{"role": "user", "content": "again"}])
    """
    result, provider = run_code(code_doc(source, max_turns=2), [{"text": "x"}] * 5, tmp_path)
    assert result.stop_reason is StopReason.BUDGET
    assert len(provider.requests) == 2
    assert result.worker_usage is not None and result.worker_usage.calls == 2
    assert result.steps[-1].observation.content == (
        "episode stopped: all 2 model calls of param:max-turns are used")


def test_an_environment_action_beyond_max_env_actions_ends_with_budget(tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.execute("bash", {"command": "touch one"})
        try:
            kit.execute("bash", {"command": "touch two"})
        except Exception:
            pass  # the end of the episode is not an Exception the program can swallow
        return "never"
    """
    result, _ = run_code(code_doc(source, max_env_actions=1), [{"text": "x"}], tmp_path)
    assert result.stop_reason is StopReason.BUDGET
    assert (tmp_path / "one").exists() and not (tmp_path / "two").exists()
    assert [s.action.name for s in result.steps] == ["bash", "bash"]
    assert result.steps[-1].observation.content == (
        "episode stopped: all 1 environment actions of param:max-env-actions are used")


def test_submit_ends_the_episode_even_when_the_program_swallows_everything(tmp_path: Path) -> None:
    source = """
    def run(kit):
        try:
            kit.execute("submit", {"answer": "the real answer"})
        except BaseException:
            pass
        kit.execute("bash", {"command": "touch after-submit"})
        return "another answer"
    """
    result, _ = run_code(code_doc(source), [{"text": "x"}], tmp_path)
    assert (result.stop_reason, result.answer) == (StopReason.SUBMITTED, "the real answer")
    assert not (tmp_path / "after-submit").exists()
    assert [s.action.name for s in result.steps] == ["submit"]


def test_tools_outside_the_policy_and_bad_arguments_are_observations(tmp_path: Path) -> None:
    source = """
    def run(kit):
        seen = [kit.execute("bash", {"command": "true"}),
                kit.execute("write_file", {"path": ""}),
                kit.execute("dance", {})]
        return " | ".join(f"{o.is_error}:{o.content}" for o in seen)
    """
    doc = code_doc(source, policy="read_file\nwrite_file\nsubmit")
    result, _ = run_code(doc, [{"text": "x"}], tmp_path)
    assert returned(result) == ("True:tool 'bash' not available | "
                             "True:invalid write_file arguments: missing argument 'content' | "
                             "True:tool 'dance' not available")
    assert result.turns == 3  # every call is recorded


def test_skills_and_tools_are_described_to_the_program(tmp_path: Path) -> None:
    source = """
    def run(kit):
        try:
            kit.read_skill("missing")
        except KeyError as error:
            missing = str(error)
        observed = kit.execute("read_skill", {"name": "notes"}).content
        return "\\n=====\\n".join([kit.skills_index(), kit.read_skill("notes"), observed, missing,
                                 kit.tools_text(), ",".join(kit.tools), kit.task_id])
    """
    doc = code_doc(source, skill="Write everything down.")
    result, _ = run_code(doc, [{"text": "x"}], tmp_path)
    index, skill, observed, missing, tools, names, task_id = returned(result).split("\n=====\n")
    assert index == "- notes: How to take notes"
    assert skill == observed == doc.skills[0].content
    assert "unknown skill 'missing'; skills: notes" in missing
    assert tools == tools_text(doc) and "- write_file(path, content):" in tools
    assert names == "bash,read_file,write_file,submit,read_skill"
    assert task_id == "task"


def test_the_kit_is_read_only(tmp_path: Path) -> None:
    source = """
    def run(kit):
        for attempt in (lambda: setattr(kit, "instruction", "x"),
                        lambda: kit.params.__setitem__("max_turns", 99)):
            try:
                attempt()
            except (AttributeError, TypeError):
                continue
            return "changed"
        return "read-only"
    """
    result, _ = run_code(code_doc(source), [{"text": "x"}], tmp_path)
    assert returned(result) == "read-only"


# -- stopping from outside -----------------------------------------------------------------


def test_should_cancel_stops_the_program_at_its_next_kit_call(tmp_path: Path) -> None:
    env_calls: list[int] = []
    source = """
    def run(kit):
        kit.complete("s", [{"role": "user", "content": "go"}])
        kit.execute("bash", {"command": "echo 1"})
        kit.execute("bash", {"command": "touch not-run"})
        return "finished"
    """
    doc = code_doc(source)
    runtime = LocalExecution(doc, Spy([{"text": "x"}]), should_cancel=lambda: len(env_calls) >= 1)
    environment = DirectoryShell(tmp_path, command_timeout_sec=30)
    original = environment.execute

    def counting_execute(action: Any) -> Any:
        env_calls.append(1)
        return original(action)

    environment.execute = counting_execute  # type: ignore[method-assign]
    result = runtime.run("task", INSTRUCTION, environment)
    assert result.stop_reason is StopReason.CANCELLED
    assert [s.action.name for s in result.steps] == ["bash"]
    assert not (tmp_path / "not-run").exists()
    assert result.worker_usage is not None and result.worker_usage.calls == 1


def test_abort_interrupts_a_model_call_in_flight(tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.complete("s", [{"role": "user", "content": "think long"}])
        return "never"
    """
    provider = Spy([{"text": "x"}], latency_s=30)
    runtime = LocalExecution(code_doc(source), provider)
    when(provider.calling, runtime.abort)
    started = time.monotonic()
    result = runtime.run("task", INSTRUCTION, DirectoryShell(tmp_path, command_timeout_sec=30))
    assert time.monotonic() - started < 5
    assert result.stop_reason is StopReason.CANCELLED


def test_the_wall_clock_budget_interrupts_the_program(tmp_path: Path) -> None:
    source = """
    def run(kit):
        kit.execute("bash", {"command": "echo quick"})
        kit.execute("bash", {"command": "sleep 30"})
        return "never"
    """
    started = time.monotonic()
    result, _ = run_code(code_doc(source), [{"text": "x"}], tmp_path, episode_timeout_sec=0.7)
    assert time.monotonic() - started < 5
    assert result.stop_reason is StopReason.BUDGET
    assert result.steps[0].observation.content == "quick\n"
    assert result.steps[-1].observation.content == (
        "episode stopped: its wall-clock budget of 0.7 s ran out")


def test_a_code_runtime_runs_once(tmp_path: Path) -> None:
    runtime = LocalExecution(code_doc("def run(kit):\n    return 'a'\n"), Spy([{"text": "x"}]))
    runtime.run("task", INSTRUCTION, DirectoryShell(tmp_path))
    with pytest.raises(RuntimeError, match="single episode"):
        runtime.run("task", INSTRUCTION, DirectoryShell(tmp_path))
    runtime.close()
    runtime.close()


# -- parse_tool_call ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ('```json\n{"tool": "bash", "arguments": {"command": "ls"}}\n```',
     {"tool": "bash", "arguments": {"command": "ls"}}),
    ('I will look.\n```\n{"tool": "read_file", "arguments": {"path": "a"}}\n```\nDone.',
     {"tool": "read_file", "arguments": {"path": "a"}}),
    ('Calling {"tool": "submit", "arguments": {"answer": "42"}} now', {"tool": "submit",
                                                                      "arguments": {"answer": "42"}}),
    ('{"tool": "submit"}', {"tool": "submit", "arguments": {}}),
    ('```python\n{"tool": "bash"}\n```\n{"tool": "submit"}', {"tool": "bash", "arguments": {}}),
    ('first {"not": "a call"} then {"tool": "bash", "arguments": {"command": "x"}}',
     {"tool": "bash", "arguments": {"command": "x"}}),
    ("no call here", None),
    ('{"tool": "bash", "arguments": "ls"}', None),
    ('{"tool": 3}', None),
    ('```json\n{"tool": "bash", \n```', None),
])
def test_parse_tool_call_reads_json_objects_with_a_tool(text: str, expected: Any) -> None:
    assert parse_tool_call(text) == expected
