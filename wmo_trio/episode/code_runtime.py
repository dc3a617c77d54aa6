"""`code:runtime` documents: episodes whose loop is the document's own Python code.

A document may carry a `code:runtime` surface: a Python module defining `run(kit) -> str`.
`CodeRuntime` runs it as the episode, with the same public surface as `EpisodeRuntime`
(`run`, `abort`, `close`, `system_prompt`, `log`), so the harbor agent can use either.

**Trusted code.** `CodeRuntime` (the `local` backend) runs the program *in this process*,
in the episode's worker thread, with the full rights of the host: it can read and write
any file, open connections, and ignore the kit altogether. Use it only for code you wrote
or reviewed. Code an optimizer mutated belongs on the `e2b` backend
(`wmo_trio.backends.e2b.E2BRuntime`), which runs the same program in a sandbox with the
same kit and keeps every budget on the host.

The kit (`wmo_trio.backends.runner.Kit`; the same class on both backends):

- `kit.complete(system, messages, *, temperature=None, max_tokens=2048) -> str`: one
  plain-text model call, no tools. `messages` is a list of `{"role": "user" |
  "assistant", "content": str}`. `temperature=None` uses `param:temperature`; `max_tokens`
  is capped by `param:max-output-tokens` (and half the context window when one is set).
- `kit.execute(tool, arguments) -> Observation`: one of the document's tools.
  `bash`/`read_file`/`write_file` run in the task environment; `read_skill` answers with
  the skill; `submit` ends the episode at once as `submitted` with its `answer` (it does
  not return). A tool the document does not allow, or wrong arguments, give an error
  observation, as in the built-in loop. The `Observation` has `content`, `is_error`,
  `reward` and `metadata`.
- `kit.parse_tool_call(text) -> {"tool": str, "arguments": dict} | None`: the first JSON
  object with a string `"tool"` (and optional object `"arguments"`) in `text`, looked for
  first inside ```json fences, then anywhere; None when there is none.
- `kit.tools_text()`: the document's tools, their arguments and that call format, as text
  for a system prompt. `kit.skills_index()`: `- name: description` lines.
  `kit.read_skill(name) -> str` (KeyError for an unknown name; not a recorded step).
- Read-only attributes: `instruction`, `task_id`, `params` (`max_turns`,
  `max_output_tokens`, `temperature`, `max_env_actions`), `tools`, `system_prompt`.

`run` may also be `async def` (it is awaited with `asyncio.run`). In a sandbox, what the
program prints goes to the runner's stderr, never into its frames.

Hard budgets, counted by the host: at most `param:max-turns` model calls and
`param:max-env-actions` environment actions; the call that would exceed one ends the
episode with `budget`. Every tool call is recorded as a step when it is answered, with the
model usage, so a stopped episode keeps its transcript. `run` returning a non-empty str
ends as `submitted` with that answer; "" or None as `no_action`; an exception as `error`
with a final error step naming the exception. Cancellation, `abort()` and the wall-clock
budget are checked before every model call and every tool call, and interrupt the call in
flight, exactly as in `EpisodeRuntime`; in-process they cannot stop a program that is
computing without calling the kit (the e2b backend kills its sandbox instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from wmo_trio.backends.runner import Kit, run_program
from wmo_trio.episode.environment import Environment
from wmo_trio.episode.runtime import (
    ELIDED,
    MAX_CONSECUTIVE_UNUSABLE,
    NUDGES,
    EpisodeLog,
    RuntimeBase,
)
from wmo_trio.episode.tools import (
    argument_problem,
    invalid_arguments,
    is_environment_tool,
    tool_spec,
    unavailable,
)
from wmo_trio.harness import HarnessDoc
from wmo_trio.models import (
    Action,
    ActionKind,
    Observation,
    RunResult,
    Step,
    StopReason,
)
from wmo_trio.providers.base import (
    CallControl,
    Provider,
    ProviderError,
    ProviderRequest,
    ProviderResponse,
)

__all__ = ["CodeRuntime", "EpisodeEnded", "EpisodeServices", "episode_spec", "tools_text"]


class EpisodeEnded(BaseException):
    """The host ended the episode (submit, a budget, cancellation, a provider error).

    A BaseException on purpose: a program's `except Exception` around a kit call must not
    swallow the end of its episode. The ending is also kept by `EpisodeServices`, so a
    program that catches even this cannot change how its episode ended."""

    def __init__(self, reason: StopReason, answer: str = "") -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.answer = answer


def tools_text(doc: HarnessDoc) -> str:
    """The document's tools as text for a system prompt, with the call format that
    `Kit.parse_tool_call` reads."""
    lines = [
        "To call a tool, reply with a JSON object naming it and its arguments, for example "
        "in a ```json block:",
        '{"tool": "<tool name>", "arguments": {"<argument>": "<value>"}}',
        "Every argument is a required string. The tools:",
    ]
    for name in doc.tools:
        spec = tool_spec(name)
        properties: dict[str, Any] = spec.parameters["properties"]
        lines.append(f"- {name}({', '.join(properties)}): {spec.description}")
        lines += [f"    {arg}: {info['description']}" for arg, info in properties.items()]
    return "\n".join(lines)


def _max_output_tokens(doc: HarnessDoc, context_window: int | None) -> int:
    limit = doc.params.max_output_tokens
    if context_window is not None:
        # As in the built-in loop: the reply never claims more than half the window.
        limit = min(limit, context_window // 2)
    return limit


def episode_spec(doc: HarnessDoc, *, task_id: str, instruction: str, mode: str,
                 context_window: int | None, loop_system_prompt: str | None = None) -> dict[str, Any]:
    """Everything the portable side of an episode needs (`wmo_trio.backends.runner`): the
    kit's data for `mode="code"`, the built-in loop's for `mode="loop"`. JSON-compatible."""
    params = doc.params
    spec: dict[str, Any] = {
        "mode": mode,
        "task_id": task_id,
        "instruction": instruction,
        "params": params.model_dump(mode="json"),
        "tools": list(doc.tools),
        "context_window": context_window,
        "max_output_tokens": _max_output_tokens(doc, context_window),
    }
    if mode == "code":
        spec.update(
            system_prompt=doc.system_prompt,
            tools_text=tools_text(doc),
            skills=[s.model_dump(mode="json") for s in doc.skills],
            code=doc.runtime_code,
        )
    else:
        spec.update(
            system_prompt=loop_system_prompt if loop_system_prompt is not None else doc.system_prompt,
            tool_specs=[tool_spec(name).model_dump(mode="json") for name in doc.tools],
            nudges=dict(NUDGES),
            max_unusable=MAX_CONSECUTIVE_UNUSABLE,
            elided=ELIDED,
            unparsed=invalid_arguments("{tool}", "could not parse them ({reason})").content,
        )
    return spec


class EpisodeServices:
    """The host side of an episode whose loop runs elsewhere: a `code:runtime` program
    (in-process or in a sandbox) or the built-in loop in a sandbox.

    It answers model calls and tool calls with the semantics of `EpisodeRuntime`: checks
    the boundaries (cancellation, the wall-clock budget) before each, counts the budgets,
    records every step and the usage in `log`, and ends the episode by raising
    `EpisodeEnded`. Once ended, every later call raises the same ending again.

    `code_mode` selects the rules for programs: model requests are plain text (tools
    dropped, output capped), and going over the environment-action budget ends the episode
    instead of answering with an error observation.
    """

    def __init__(self, doc: HarnessDoc, provider: Provider, log: EpisodeLog,
                 control: CallControl, *, stopping: Callable[[], bool],
                 episode_timeout_s: float, context_window: int | None, code_mode: bool) -> None:
        self.doc = doc
        self.provider = provider
        self.log = log
        self.control = control
        self.environment: Environment | None = None
        self.model_calls = 0
        self.env_actions = 0
        self.ended: EpisodeEnded | None = None
        self._stopping = stopping
        self._episode_timeout_s = episode_timeout_s
        self._max_output = _max_output_tokens(doc, context_window)
        self._code_mode = code_mode

    def end(self, reason: StopReason, answer: str = "") -> NoReturn:
        if self.ended is None:
            self.ended = EpisodeEnded(reason, answer)
        raise EpisodeEnded(self.ended.reason, self.ended.answer)

    def record_error(self, text: str, **metadata: Any) -> None:
        """Record a step that says why the episode is ending (or what went wrong)."""
        self.log.record(Action(kind=ActionKind.MESSAGE, content=""),
                        Observation(content=text, is_error=True, metadata=metadata))

    def boundary(self) -> None:
        """End the episode if it was cancelled or its wall-clock budget ran out."""
        if self.ended is not None:
            self.end(self.ended.reason)
        if self._stopping():
            self.end(StopReason.CANCELLED)
        if self.control.remaining() == 0.0:
            self.record_error(f"episode stopped: its wall-clock budget of {self._episode_timeout_s:g} s "
                       "ran out")
            self.end(StopReason.BUDGET)

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        self.boundary()
        limit = self.doc.params.max_turns
        if self.model_calls >= limit:
            self.record_error(f"episode stopped: all {limit} model calls of param:max-turns are used")
            self.end(StopReason.BUDGET)
        self.model_calls += 1
        if self._code_mode:
            temperature = request.temperature
            request = request.model_copy(update={
                "tools": [],
                "max_output_tokens": min(request.max_output_tokens, self._max_output),
                "temperature": self.doc.params.temperature if temperature is None else temperature,
            })
        try:
            response = self.provider.complete(request, self.control)
        except Exception as error:
            self.log.add_usage(error.usage if isinstance(error, ProviderError) else None)
            self.boundary()  # an interrupted call is a cancellation or the budget
            kind = "provider error" if isinstance(error, ProviderError) else "provider failed"
            self.record_error(f"{kind}: {type(error).__name__}: {error}",
                       status=getattr(error, "status", None))
            self.end(StopReason.PROVIDER_ERROR)
        self.log.begin_reply(response.text, response.usage)
        return response

    def execute(self, action: Action, parse_error: str | None = None) -> Observation:
        """Answer one tool call and record it. `action.arguments` None is a call whose
        arguments could not be parsed (`parse_error` says why)."""
        self.boundary()
        observation = self._answer(action, parse_error)
        self.log.record(action, observation)
        return observation

    def _answer(self, action: Action, parse_error: str | None) -> Observation:
        name, arguments = action.name, action.arguments
        if arguments is None:
            return invalid_arguments(str(name), f"could not parse them ({parse_error or 'unknown'})")
        if name not in self.doc.tools:
            return unavailable(name)
        if name == "submit":
            problem = argument_problem("submit", arguments)
            if problem is not None:
                return invalid_arguments("submit", problem)
            self.log.record(action, Observation(content="submitted"))
            self.end(StopReason.SUBMITTED, arguments["answer"])
        if name == "read_skill":
            problem = argument_problem("read_skill", arguments)
            if problem is not None:
                return invalid_arguments("read_skill", problem)
            for skill in self.doc.skills:
                if skill.name == arguments["name"]:
                    return Observation(content=skill.content)
            names = ", ".join(s.name for s in self.doc.skills)
            return Observation(content=f"unknown skill {arguments['name']!r}; skills: {names}",
                               is_error=True)
        assert is_environment_tool(name)
        limit = self.doc.params.max_env_actions
        if self.env_actions >= limit:
            if self._code_mode:
                self.log.record(action, Observation(
                    content=f"episode stopped: all {limit} environment actions of "
                    "param:max-env-actions are used", is_error=True))
                self.end(StopReason.BUDGET)
            return Observation(
                content=f"environment action budget exhausted: all {limit} environment "
                "actions are used and no more will run. Call submit with your answer.",
                is_error=True,
            )
        self.env_actions += 1
        assert self.environment is not None, "execute() before the environment was set"
        try:
            return self.environment.execute(action)
        except Exception as error:
            # An environment that raises instead of answering is a defect of the run.
            self.log.record(action, Observation(
                content=f"environment raised {type(error).__name__}: {error}", is_error=True))
            self.end(StopReason.ERROR)


class _LocalChannel:
    """The kit's channel when the program runs in this process: straight to the services."""

    def __init__(self, services: EpisodeServices) -> None:
        self._services = services

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        response = self._services.complete(ProviderRequest.model_validate(request))
        return response.model_dump(mode="json")

    def execute(self, tool: str, arguments: dict[str, Any] | None, content: str | None,
                parse_error: str | None) -> dict[str, Any]:
        action = Action(kind=ActionKind.TOOL_CALL, name=tool, arguments=arguments, content=content)
        return self._services.execute(action, parse_error).model_dump(mode="json")


class CodeRuntime(RuntimeBase):
    """Runs one episode of a `code:runtime` document in this process. See the module
    docstring: the program is trusted code.

    `run()` returns a `RunResult` for every ending and raises only on a defect of
    wmo_trio itself. `abort()` and `close()` may be called from any thread; `close()` is
    idempotent.
    """

    def __init__(self, doc: HarnessDoc, provider: Provider, **kwargs: Any) -> None:
        if doc.runtime_code is None:
            raise ValueError(f"document {doc.name!r} has no code:runtime surface; "
                             "run it with EpisodeRuntime")
        super().__init__(doc, provider, **kwargs)

    def system_prompt(self) -> str:
        """The document's prompt (what `kit.system_prompt` gives the program)."""
        return self.doc.system_prompt

    def run(self, task_id: str, instruction: str, environment: Environment) -> RunResult:
        with self._episode(environment):
            services = EpisodeServices(
                self.doc, self.provider, self.log, self._control, stopping=self._stopping,
                episode_timeout_s=self.episode_timeout_s, context_window=self.context_window,
                code_mode=True,
            )
            services.environment = environment
            spec = episode_spec(self.doc, task_id=task_id, instruction=instruction, mode="code",
                                context_window=self.context_window)
            source = self.doc.runtime_code
            assert source is not None
            try:
                services.boundary()
                outcome = run_program(source, Kit(_LocalChannel(services), spec))
                # An ending the program caught and ignored still stands; then a stop that
                # arrived while it computed its answer wins, as after the loop's last turn.
                if services.ended is not None:
                    services.end(services.ended.reason)
                services.boundary()
                if outcome["step"] is not None:
                    step = Step.model_validate(outcome["step"])
                    self.log.record(step.action, step.observation)
                reason, answer = StopReason(outcome["stop_reason"]), outcome["answer"]
            except EpisodeEnded as ended:
                reason, answer = ended.reason, ended.answer
        return self._result(task_id, reason, answer)
