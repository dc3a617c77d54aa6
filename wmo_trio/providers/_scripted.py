"""The scripted provider: deterministic, offline model replies.

It answers from one of three sources, chosen by its settings:

- `script`: a list of replies (inline, or a JSON file holding a list or `{"replies": [...]}`;
  the format is `wmo_trio.providers._script`);
- `replay`: a JSONL recording written by `RecordingProvider` (see `recording.py`);
- neither: the built-in offline policy, which knows the bundled example tasks.

The reply for a call is chosen from the request alone (the number of assistant messages
so far picks the script entry), so one provider can serve many concurrent episodes and
every episode sees the same replies in the same order.

Usage is an *estimate* unless a reply sets it: about one token per four characters of
request and reply, computed deterministically so that traces and tests are reproducible.
It is not a tokenizer count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from pydantic import Field

from wmo_trio._file_cache import parse_file_once
from wmo_trio.models import TokenUsage
from wmo_trio.providers._base import (
    CallControl,
    ClosesOnExit,
    FinishReason,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
    ProviderSettings,
    ToolCall,
    parse_tool_call,
)
from wmo_trio.providers._offline_policy import offline_policy
from wmo_trio.providers._recording import load_replay
from wmo_trio.providers._script import ScriptedError, ScriptedReply, load_script
from wmo_trio.settings import NonNegativeSeconds

# The scripted kind's model without a script or a replay: the built-in policy.
OFFLINE = "offline"

# status and whether the retry policy may try again, per injected error kind
_ERROR_KINDS: dict[str, tuple[int | None, bool]] = {
    "rate_limit": (429, True),
    "overloaded": (529, True),
    "server": (500, True),
    "connection": (None, True),
    "timeout": (408, True),
    "bad_request": (400, False),
}


class ScriptedFailure(RuntimeError):
    """An injected failure of a kind no provider is expected to raise."""


class ScriptedSettings(ProviderSettings):
    """Settings of the `scripted` kind."""

    script: list[Any] | str | None = Field(
        default=None, description="a list of replies, or the path of a JSON file of them")
    replay: str | None = Field(default=None, description="the path of a JSONL recording")
    latency_s: NonNegativeSeconds = 0.0


def _call_chars(call: ToolCall) -> int:
    arguments = call.raw_arguments
    if arguments is None:
        arguments = json.dumps(call.arguments, separators=(",", ":"))
    return len(call.name) + len(arguments)


def estimated_usage(request: ProviderRequest, reply_text: str,
                    calls: Sequence[ToolCall]) -> TokenUsage:
    """About one token per four characters of what the model reads and writes."""
    prompt = len(request.system) + sum(
        len(m.content) + sum(_call_chars(c) for c in m.tool_calls) for m in request.messages
    ) + sum(len(t.name) + len(t.description) + len(str(t.parameters)) for t in request.tools)
    output = len(reply_text) + sum(_call_chars(c) for c in calls)
    return TokenUsage(input_tokens=math.ceil(prompt / 4), output_tokens=math.ceil(output / 4),
                      calls=1)


class ScriptedProvider(ClosesOnExit):
    """Plays scripted replies; see the module docstring for the sources and the usage estimate.

    Settings (`ScriptedSettings`): `script` (list or path), `replay` (path), `latency_s`
    (the latency of every call without one of its own, seconds).
    """

    def __init__(
        self,
        config: ProviderConfig,
        *,
        script: list[ScriptedReply] | None = None,
        answer: Callable[[ProviderRequest], ScriptedReply] | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.config = config
        self._script = script
        self._answer = answer
        self._latency_s = latency_s

    @classmethod
    def from_config(cls, config: ProviderConfig) -> Self:
        settings: ScriptedSettings = ScriptedSettings.of(config)
        latency = settings.latency_s
        if settings.script is not None and settings.replay is not None:
            raise ProviderConfigError("scripted provider: give either script or replay, not both")
        if isinstance(settings.script, str):
            script = parse_file_once(Path(settings.script), load_script)
            return cls(config, script=script, latency_s=latency)
        if settings.script is not None:
            return cls(config, script=load_script(settings.script), latency_s=latency)
        if settings.replay is not None:
            answer = parse_file_once(Path(settings.replay), load_replay)
            return cls(config, answer=answer, latency_s=latency)
        if config.model != OFFLINE:
            # It would play the offline policy under another name, and the trace say so.
            raise ProviderConfigError(
                f"scripted model {config.model!r} does not exist: the scripted kind's model is "
                f"{OFFLINE!r} (scripted/{OFFLINE}, the policy that knows the bundled example "
                "tasks); another name is a label for a script or a replay setting's replies")
        return cls(config, answer=offline_policy, latency_s=latency)

    def _reply_for(self, request: ProviderRequest, turn: int) -> ScriptedReply:
        if self._answer is not None:
            return self._answer(request)
        assert self._script is not None
        if turn >= len(self._script):
            raise ProviderError(
                f"scripted provider: the script has {len(self._script)} replies and call "
                f"{turn + 1} asked for another"
            )
        return self._script[turn]

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        reply = self._reply_for(request, turn)
        latency = self._latency_s if reply.latency_s is None else reply.latency_s
        if latency > 0 and not control.sleep(latency):
            raise ProviderInterrupted("scripted provider: the call was interrupted")
        if control.interrupted:
            raise ProviderInterrupted("scripted provider: the call was interrupted")
        if reply.error is not None:
            _raise_injected(reply.error)
        calls = [parse_tool_call(c.id or f"call_{turn}_{i}", c.name, c.arguments)
                 for i, c in enumerate(reply.tool_calls)]
        finish = reply.finish_reason or (FinishReason.TOOL_CALLS if calls else FinishReason.STOP)
        usage = reply.usage or estimated_usage(request, reply.text, calls)
        return ProviderResponse(text=reply.text, tool_calls=calls, finish_reason=finish, usage=usage)

    def prepare(self) -> None:
        pass  # nothing to load: everything was read when it was built

    def close(self) -> None:
        pass


def _raise_injected(error: ScriptedError) -> None:
    if error.kind == "unexpected":
        raise ScriptedFailure(error.message)
    status, retryable = _ERROR_KINDS[error.kind]
    raise ProviderError(
        f"{error.kind}: {error.message}",
        retryable=retryable,
        status=status,
        retry_after=error.retry_after,
    )
