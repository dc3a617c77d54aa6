"""The script format of the scripted provider: the replies it plays, as data.

A script is a list of replies; a reply is text and tool calls (or an injected failure),
with optional latency, finish reason and usage. The offline policy and replayed recordings
produce the same replies, so all three sources share this format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wmo_trio.models import TokenUsage
from wmo_trio.providers._base import FinishReason, Message, ProviderConfigError
from wmo_trio.settings import validation_problem

ErrorKind = Literal[
    "rate_limit", "overloaded", "server", "connection", "timeout", "bad_request", "unexpected"
]

class ScriptedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    # An object is a well-formed call; a string is the JSON text a model sends, read as a
    # provider reads it (`parse_tool_call`): one that is not a JSON object is how a script
    # injects a malformed tool call, and a blank one is a call without arguments.
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    id: str | None = None


class ScriptedError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: ErrorKind
    message: str = "injected failure"
    retry_after: float | None = None


class ScriptedReply(BaseModel):
    """One scripted model reply, or an injected failure (`error`)."""

    model_config = ConfigDict(extra="forbid")

    text: str = ""
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    latency_s: float | None = Field(default=None, ge=0)
    usage: TokenUsage | None = None
    error: ScriptedError | None = None


def load_script(source: str | Path | Sequence[Any]) -> list[ScriptedReply]:
    """Validate a script (a list of replies, or a JSON file of one); errors say where."""
    where = "script"
    data: Any = source
    if isinstance(source, str | Path):
        where = str(source)
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except OSError as error:
            raise ProviderConfigError(f"cannot read script {where}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise ProviderConfigError(
                f"script {where} is not JSON: line {error.lineno} column {error.colno}: {error.msg}"
            ) from None
        if isinstance(data, dict) and "replies" in data:
            data = data["replies"]
    if not isinstance(data, list) or not data:
        raise ProviderConfigError(f"{where}: a script is a non-empty list of replies")
    replies = []
    for index, entry in enumerate(data):
        try:
            replies.append(ScriptedReply.model_validate(entry))
        except ValidationError as error:
            problem = validation_problem(error, whole="reply")
            raise ProviderConfigError(f"{where}: reply {index}: {problem}") from None
    return replies



def first_user_message(messages: Sequence[Message]) -> str:
    for message in messages:
        if message.role == "user":
            return message.content
    return ""

