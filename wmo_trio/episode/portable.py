"""The portable half of an episode: the programs that drive it, and the kit they use.

An episode is a *program* asking a *host* for model calls and tool calls. The program is
either the built-in tool-calling loop (`run_loop`) or a document's `code:runtime` module
(`run_program`, which hands it a `Kit`); the host (`wmo_trio.episode.services`) answers
every call, counts the budgets, records the steps and may end the episode at any call.
The same program runs in both places an episode can run:

- in-process (`wmo_trio.episode.runtime.EpisodeRuntime`), its channel the host's end
  itself (`wmo_trio.episode.channel.ProgramChannel`);
- in an E2B sandbox (`wmo_trio.backends.e2b`), which uploads this very file and starts it
  as `python3 -I portable.py EPISODE_JSON`; the channel is then JSON frames on the
  process's stdin and stdout (`HostChannel`);
- in a bubblewrap sandbox on this machine (`wmo_trio.backends._sandbox`), started as
  `python3 -I -S portable.py -` before its episode is known: the spec then arrives as the
  host's first frame, `{"type": "episode", "spec": ...}`, so a runner can wait ready.

So everything here is plain Python 3.8+ with nothing but the standard library, and every
value crossing the channel is JSON-shaped. Nothing a program does to this module (it runs
in the same interpreter) lets it past the host's checks, which all happen on the host.

Started as a script, the runner reads the episode spec, moves its frame streams off file
descriptors 0 and 1 (so a program's `print` or a child process writes to stderr, never
into the frame stream), says hello, runs the episode's program and reports how it ended.
"""

from __future__ import annotations

import json
import linecache
import os
import re
import sys
import types

# Not `typing.TYPE_CHECKING`: importing typing is a fifth of a sandboxed runner's start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import IO, Any

PROTOCOL = 2
CODE_FILENAME = "code:runtime"
_MAX_ERROR_TEXT = 2000
_MAX_RETURNED_TEXT = 10_000
_MAX_TRACEBACK = 4000


class HostGone(BaseException):
    """The host stopped answering (it closes the channel only when the episode is over).

    A BaseException, like the host's own end-of-episode signal, so that a program's
    `except Exception` cannot swallow the end of its episode."""


class ProtocolError(BaseException):
    """The host answered something the runner cannot use."""


# -- what the kit hands out ------------------------------------------------------------------


class Observation:
    """What a tool call returned: `content` (text for the model), `is_error`, `reward` and
    `metadata` (for example `return_code`)."""

    __slots__ = ("content", "is_error", "metadata", "reward")

    def __init__(self, content: str, is_error: bool = False, reward: float | None = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        self.content = content
        self.is_error = is_error
        self.reward = reward
        self.metadata = dict(metadata or {})

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Observation:
        return cls(str(data["content"]), bool(data.get("is_error", False)), data.get("reward"),
                   data.get("metadata") or {})

    def __repr__(self) -> str:
        return f"Observation(content={self.content!r}, is_error={self.is_error!r})"


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\n(.*?)```", re.S)


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The first tool call written in `text`, as `{"tool": name, "arguments": {...}}`.

    A tool call is a JSON object with a string `"tool"` and, optionally, an object
    `"arguments"` (missing means `{}`). It may stand in a fenced code block (```json or
    plain ```), which is looked at first, or anywhere in the text. Anything else (no such
    object, invalid JSON, `arguments` that is not an object) gives None.
    """
    if not isinstance(text, str):
        return None
    candidates = [match.group(2) for match in _FENCE.finditer(text)
                  if match.group(1).lower() in ("", "json")]
    candidates.append(text)
    decoder = json.JSONDecoder()
    for candidate in candidates:
        for start in (m.start() for m in re.finditer(r"\{", candidate)):
            try:
                value, _ = decoder.raw_decode(candidate, start)
            except ValueError:
                continue
            call = _as_tool_call(value)
            if call is not None:
                return call
    return None


def _as_tool_call(value: object) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("tool"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return {"tool": value["tool"], "arguments": arguments}


class Kit:
    """What `run(kit)` receives; docs/documents.md documents it for document authors.

    `channel` is the host (see `run_episode`); every call goes through it.
    """

    def __init__(self, channel: Any, spec: Mapping[str, Any]) -> None:
        self._channel = channel
        self._instruction = str(spec["instruction"])
        self._task_id = str(spec["task_id"])
        self._params = types.MappingProxyType(dict(spec["params"]))
        self._tools = tuple(spec["tools"])
        self._system_prompt = str(spec["system_prompt"])
        self._tools_text = str(spec["tools_text"])
        self._skills = [(str(s["name"]), str(s["description"]), str(s["content"]))
                        for s in spec["skills"]]

    @property
    def instruction(self) -> str:
        """The task instruction."""
        return self._instruction

    @property
    def task_id(self) -> str:
        return self._task_id

    @property
    def params(self) -> Mapping[str, Any]:
        """The document's parameters: max_turns, max_output_tokens, temperature,
        max_env_actions (read-only)."""
        return self._params

    @property
    def tools(self) -> tuple[str, ...]:
        """The names of the tools the document allows, in policy order."""
        return self._tools

    @property
    def system_prompt(self) -> str:
        """The document's prompt surfaces, joined by a blank line."""
        return self._system_prompt

    def complete(self, system: str, messages: Sequence[Mapping[str, str]], *,
                 temperature: float | None = None, max_tokens: int = 2048) -> str:
        """One plain-text model call (no tools); returns the reply's text.

        `messages` is a list of `{"role": "user" | "assistant", "content": str}`.
        `temperature=None` uses the document's `param:temperature`; `max_tokens` is capped
        by `param:max-output-tokens` (and half the context window when one is set).
        """
        if not isinstance(system, str):
            raise TypeError("system must be a string")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
            raise TypeError("messages must be a list of {'role', 'content'} dicts")
        checked = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TypeError(f"messages[{index}] must be a dict with 'role' and 'content'")
            role, content = message.get("role"), message.get("content")
            if role not in ("user", "assistant"):
                raise ValueError(f"messages[{index}]['role'] must be 'user' or 'assistant', "
                                 f"got {role!r}")
            if not isinstance(content, str):
                raise TypeError(f"messages[{index}]['content'] must be a string")
            checked.append({"role": role, "content": content})
        if temperature is not None and (isinstance(temperature, bool)
                                        or not isinstance(temperature, (int, float))):
            raise TypeError("temperature must be a number or None")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        response = self._channel.complete({
            "system": system, "messages": checked, "tools": [],
            "max_output_tokens": max_tokens,
            "temperature": None if temperature is None else float(temperature),
        })
        return str(response.get("text", ""))

    def execute(self, tool: str, arguments: Mapping[str, Any] | None = None) -> Observation:
        """Call one of the document's tools and return its observation.

        Environment tools (`bash`, `read_file`, `write_file`) run in the task environment
        and count against `param:max-env-actions`. `read_skill` answers with the skill.
        `submit` ends the episode at once with its `answer`: it does not return.
        """
        if not isinstance(tool, str):
            raise TypeError("tool must be a string")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise TypeError("arguments must be a dict")
        # Arguments cross to the host as JSON on every backend, so they are JSON here too.
        plain = json.loads(json.dumps(arguments))
        return Observation.from_json(self._channel.execute(tool, plain, None, None))

    @staticmethod
    def parse_tool_call(text: str) -> dict[str, Any] | None:
        """See `parse_tool_call`."""
        return parse_tool_call(text)

    def tools_text(self) -> str:
        """A description of the document's tools and of the call format `parse_tool_call`
        reads, ready for a system prompt."""
        return self._tools_text

    def skills_index(self) -> str:
        """One line per skill, `- name: description`; "" when the document has none."""
        return "\n".join(f"- {name}: {description}" if description else f"- {name}"
                         for name, description, _ in self._skills)

    def read_skill(self, name: str) -> str:
        """A skill's full text. Raises KeyError for an unknown name."""
        for skill_name, _, content in self._skills:
            if skill_name == name:
                return content
        known = ", ".join(s[0] for s in self._skills) or "none"
        raise KeyError(f"unknown skill {name!r}; skills: {known}")


# -- running a document's code ---------------------------------------------------------------


def run_program(source: str, kit: Kit) -> dict[str, Any]:
    """Run `source` (a module defining `run(kit)`) and say how the episode ended.

    Returns `{"stop_reason", "answer", "step"}`. A program that returns has not submitted
    (only `kit.execute("submit", ...)` does, and the host ends the episode there): its end
    is `no_action`, and a non-empty string it returned is recorded as a final step, so the
    trace keeps it. An exception (or a return value other than a str or None) is `error`,
    with `step` the error step to record. The host's own end of the episode (and
    `HostGone`) propagate: they are not the program's outcome.
    """
    linecache.cache[CODE_FILENAME] = (len(source), None, source.splitlines(True), CODE_FILENAME)
    namespace: dict[str, Any] = {"__name__": "harness_runtime", "__file__": CODE_FILENAME}
    try:
        exec(compile(source, CODE_FILENAME, "exec"), namespace)
        run = namespace.get("run")
        if not callable(run):
            raise TypeError("code:runtime does not define a callable 'run'")
        result = run(kit)
        if isinstance(result, types.CoroutineType):
            import asyncio  # only here: its import is most of a runner's start

            result = asyncio.run(result)
        if result is not None and not isinstance(result, str):
            raise TypeError(f"run(kit) returned {type(result).__name__}; it must return "
                            "the answer as a str (or None or '' for no answer)")
    except (Exception, SystemExit) as error:
        return {"stop_reason": "error", "answer": "", "step": error_step(error)}
    if not result:
        return {"stop_reason": "no_action", "answer": "", "step": None}
    return {"stop_reason": "no_action", "answer": "", "step": returned_step(result)}


def returned_step(text: str) -> dict[str, Any]:
    """The step that records what a program returned instead of submitting."""
    if len(text) > _MAX_RETURNED_TEXT:
        text = text[:_MAX_RETURNED_TEXT] + " [...]"
    return {
        "action": {"kind": "message", "name": None, "arguments": None, "content": text},
        "observation": {
            "content": "code:runtime returned without calling submit, so nothing was "
                       "submitted; its return value is the text of this step (a program "
                       "submits with kit.execute('submit', {'answer': ...}))",
            "is_error": True, "reward": None, "metadata": {},
        },
    }


def error_step(error: BaseException) -> dict[str, Any]:
    """The step that records a program's exception: type and message, and a traceback."""
    import traceback

    message = str(error)
    if len(message) > _MAX_ERROR_TEXT:
        message = message[:_MAX_ERROR_TEXT] + " [...]"
    frames = error.__traceback__
    if frames is not None and frames.tb_next is not None:
        frames = frames.tb_next  # the first frame is run_program itself
    trace = "".join(traceback.format_exception(type(error), error, frames))
    return {
        "action": {"kind": "message", "name": None, "arguments": None, "content": ""},
        "observation": {
            "content": f"code:runtime raised {type(error).__name__}: {message}",
            "is_error": True, "reward": None,
            "metadata": {"exception_type": type(error).__name__,
                         "traceback": trace[-_MAX_TRACEBACK:]},
        },
    }


# -- the built-in loop -----------------------------------------------------------------------


def _message(role: str, content: str, tool_calls: Sequence[Any] = (),
             tool_call_id: str | None = None, is_error: bool = False) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": list(tool_calls),
            "tool_call_id": tool_call_id, "is_error": is_error}


def fit_context(system: str, messages: list[dict[str, Any]], max_output: int,
                window: int | None, elided: str) -> list[dict[str, Any]]:
    """The messages to send: with a context window, the oldest tool outputs are elided
    while the request would overflow it (estimated at four characters a token).
    `messages` is updated in place, so an elided output stays elided."""
    if window is None:
        return list(messages)

    def estimate() -> int:
        chars = len(system) + sum(
            len(m["content"]) + sum(len(str(c["arguments"] or c.get("raw_arguments")))
                                    for c in m["tool_calls"])
            for m in messages)
        return chars // 4 + max_output

    for index, message in enumerate(messages):
        if estimate() <= window:
            break
        if message["role"] == "tool" and message["content"] != elided:
            messages[index] = dict(message, content=elided)
    return list(messages)


def _unusable_kind(response: Mapping[str, Any]) -> str:
    if response.get("tool_calls"):
        return "unparsed_tool_call"
    if response.get("finish_reason") == "length":
        return "output_truncated"
    return "no_tool_call"


def run_loop(spec: Mapping[str, Any], channel: Any) -> str:
    """The built-in episode loop; returns the stop reason it ends with by itself.

    Each turn is one model call with the document's tools; every tool call of the reply is
    answered by the host in order (submit included, which ends the episode there). A reply
    without a usable tool call gets a corrective nudge, and the third in a row ends the
    episode. The host keeps the turn limit: each response says how many turns are left,
    and after the last one the loop ends (`max_turns`, or how that last reply was unusable).
    """
    params = spec["params"]
    max_output = int(spec["max_output_tokens"])
    system = spec["system_prompt"]
    nudges, max_unusable = spec["nudges"], int(spec["max_unusable"])
    messages = [_message("user", spec["instruction"])]
    streak = 0
    last_unusable: str | None = None
    while True:
        response = channel.complete({
            "system": system,
            "messages": fit_context(system, messages, max_output, spec["context_window"],
                                    spec["elided"]),
            "tools": spec["tool_specs"],
            "max_output_tokens": max_output,
            "temperature": params["temperature"],
        })
        last_turn = response.get("turns_left") == 0
        text, calls = response.get("text", ""), response.get("tool_calls", [])
        messages.append(_message("assistant", text, calls))
        if not any(call.get("arguments") is not None for call in calls):
            streak += 1
            last_unusable = _unusable_kind(response)
            for call in calls:  # every tool call needs its answer
                reason = call.get("parse_error") or "unknown"
                messages.append(_message("tool", spec["unparsed"].replace("{tool}", call["name"])
                                         .replace("{reason}", reason),
                                         tool_call_id=call["id"], is_error=True))
            action = {"kind": "message", "content": text}
            if streak >= max_unusable:
                channel.step(action, {"content": f"episode ended: {streak} consecutive replies "
                                      "without a usable tool call", "is_error": True})
                return last_unusable
            if last_turn:
                channel.step(action, {"content": "episode ended: no turns left", "is_error": True})
                break
            nudge = nudges[last_unusable]
            channel.step(action, {"content": nudge, "is_error": True})
            messages.append(_message("user", nudge))
            continue
        streak, last_unusable = 0, None
        for position, call in enumerate(calls):
            # The reply's text goes with its first action, so the transcript keeps it.
            observation = channel.execute(call["name"], call.get("arguments"),
                                          text if position == 0 and text else None,
                                          call.get("parse_error"))
            messages.append(_message("tool", observation["content"], tool_call_id=call["id"],
                                     is_error=bool(observation.get("is_error"))))
        if last_turn:
            break
    if last_unusable in ("unparsed_tool_call", "output_truncated"):
        return last_unusable
    return "max_turns"


def run_episode(spec: Mapping[str, Any], channel: Any) -> dict[str, Any]:
    """Run the episode's program over `channel` and say how it ended by itself:
    `{"stop_reason", "answer", "step"}` (see `run_program`; the built-in loop never has a
    final step). An ending the host decides (submit, a budget, cancellation, a provider
    error) is raised by the channel and propagates.

    `channel` answers, with JSON-shaped dicts: `complete(request) -> response` (with the
    host's `turns_left`),
    `execute(tool, arguments, content, parse_error) -> observation` and `step(action,
    observation)` (a message step to record, such as a nudge).
    """
    if spec["mode"] == "code":
        return run_program(spec["code"], Kit(channel, spec))
    return {"stop_reason": run_loop(spec, channel), "answer": "", "step": None}


# -- the channel to the host, in a sandbox ---------------------------------------------------


class HostChannel:
    """Frames to the host on `frames`, one JSON object a line; its replies on `replies`.

    One request is outstanding at a time, so a reply is always the answer to the last
    request: its `id` must match."""

    def __init__(self, frames: IO[bytes], replies: IO[bytes]) -> None:
        self._frames = frames
        self._replies = replies
        self._next_id = 0

    def send(self, frame: Mapping[str, Any]) -> None:
        self._frames.write(json.dumps(frame).encode("ascii") + b"\n")
        self._frames.flush()

    def _request(self, frame: dict[str, Any], answer: str) -> dict[str, Any]:
        self._next_id += 1
        frame["id"] = self._next_id
        self.send(frame)
        line = self._replies.readline()
        if not line:
            raise HostGone("the host closed the channel")
        reply = json.loads(line)
        if not isinstance(reply, dict) or reply.get("type") != answer \
                or reply.get("id") != self._next_id:
            raise ProtocolError(f"expected a {answer!r} reply to request {self._next_id}, "
                                f"got {line[:200]!r}")
        return reply

    def episode(self) -> dict[str, Any]:
        """The episode's spec, the host's first frame when the runner started before it."""
        line = self._replies.readline()
        if not line:
            raise HostGone("the host closed the channel before it sent the episode")
        frame = json.loads(line)
        if not isinstance(frame, dict) or frame.get("type") != "episode" \
                or not isinstance(frame.get("spec"), dict):
            raise ProtocolError(f"expected the episode frame, got {line[:200]!r}")
        spec: dict[str, Any] = frame["spec"]
        return spec

    def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        reply = self._request({"type": "complete", "request": dict(request)}, "completion")
        response: dict[str, Any] = reply["response"]
        return response

    def execute(self, tool: str, arguments: Mapping[str, Any] | None, content: str | None,
                parse_error: str | None) -> dict[str, Any]:
        reply = self._request({"type": "execute", "tool": tool,
                               "arguments": None if arguments is None else dict(arguments),
                               "content": content, "parse_error": parse_error}, "observation")
        observation: dict[str, Any] = reply["observation"]
        return observation

    def step(self, action: Mapping[str, Any], observation: Mapping[str, Any]) -> None:
        self.send({"type": "step", "step": {"action": dict(action),
                                             "observation": dict(observation)}})


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: portable.py EPISODE_JSON|-\n")
        return 2
    # Keep the frame streams on private descriptors and point 0 and 1 elsewhere, so that
    # nothing the program prints or runs can corrupt (or read) the frames.
    frames = os.fdopen(os.dup(1), "wb")
    replies = os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    sys.stdin = open(os.devnull, encoding="utf-8")
    channel = HostChannel(frames, replies)
    channel.send({"type": "hello", "protocol": PROTOCOL,
                  "python": ".".join(map(str, sys.version_info[:3]))})
    try:
        if argv[1] == "-":
            spec = channel.episode()
        else:
            with open(argv[1], encoding="utf-8") as file:
                spec = json.load(file)
        outcome = run_episode(spec, channel)
    except HostGone:
        return 0
    if outcome["step"] is not None:
        channel.send({"type": "step", "step": outcome["step"]})
    channel.send({"type": "done", "stop_reason": outcome["stop_reason"], "answer": outcome["answer"]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
