"""The provider interface: one structured tool-calling model call, as plain data.

Providers are called synchronously, from the episode's worker thread, and wait only
through the episode's `CallControl` (`wmo_trio.control`): an async SDK call goes to the
trio run with `control.run_async`, a backoff with `control.sleep`. The episode interrupts
the control when it is aborted, cancelled or out of wall-clock budget; the provider then
raises `ProviderInterrupted`, never leaving the worker blocked on a wait nobody wants.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from typing import Any, Literal, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from wmo_trio._text import valid_json, valid_text
from wmo_trio.control import CallControl as CallControl
from wmo_trio.models import JsonObject, TokenUsage
from wmo_trio.settings import NonEmptyText, NonNegativeSeconds, PositiveInt, Settings

# The interface `wmo_trio.providers` shows; the helpers below it are its providers' own.
__all__ = ["CallControl", "FinishReason", "Message", "OwnedProvider", "Provider", "ProviderConfig",
           "ProviderConfigError", "ProviderError", "ProviderInterrupted", "ProviderRequest",
           "ProviderResponse", "ProviderSettings", "ToolCall", "ToolSpec"]


class FinishReason(StrEnum):
    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"


class ToolCall(BaseModel):
    """A tool call proposed by the model.

    `arguments` is None when the model's arguments could not be parsed into a JSON object;
    `raw_arguments` then keeps what it sent and `parse_error` says why.
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    arguments: JsonObject | None
    raw_arguments: str | None = None
    parse_error: str | None = None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def loads_json(text: str | bytes) -> Any:
    """Strict JSON: Python's parser also takes NaN and Infinity, which no API sends and
    which could never be sent back (request bodies are encoded with NaN refused)."""
    return json.loads(text, parse_constant=_not_json)


def parse_tool_call(call_id: str, name: str, arguments: object) -> ToolCall:
    """The tool call a model made, from its arguments as they came: a JSON text (the Chat
    Completions wire format, a script's or a recording's unparsed call) or an object (the
    Messages API, some servers). Every provider and a replay read them here, so a replayed
    call parses as it did live.

    Blank or missing arguments are a call without any. Arguments that do not parse into a
    JSON object (invalid or too deeply nested JSON, a list, a number) give a call without
    arguments whose `parse_error` says why; the episode answers it with an observation
    the model can recover from. Lone surrogates become U+FFFD (`wmo_trio._text`).
    """
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return ToolCall(id=call_id, name=name, arguments={})
    if isinstance(arguments, dict):
        try:
            return ToolCall(id=call_id, name=name, arguments=valid_json(arguments))
        except RecursionError:  # deeper than Python walks, though JSON's parser took it
            return _unparsed(call_id, name, _as_text(arguments), "invalid JSON: nested too deeply")
    if not isinstance(arguments, str):
        return _unparsed(call_id, name, _as_text(arguments), "arguments are not a JSON object")
    text = valid_text(arguments)
    try:
        parsed = valid_json(loads_json(text))
    except json.JSONDecodeError as error:
        return _unparsed(call_id, name, text, f"invalid JSON: {error.msg}")
    except ValueError as error:
        return _unparsed(call_id, name, text, f"invalid JSON: {error}")
    except RecursionError:
        return _unparsed(call_id, name, text, "invalid JSON: nested too deeply")
    if not isinstance(parsed, dict):
        return _unparsed(call_id, name, text, "arguments are not a JSON object")
    return ToolCall(id=call_id, name=name, arguments=parsed, raw_arguments=text)


def _unparsed(call_id: str, name: str, raw: str, problem: str) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=None, raw_arguments=raw, parse_error=problem)


def _as_text(arguments: object) -> str:
    """Decoded arguments as the JSON text a replay parses again."""
    try:
        return valid_text(json.dumps(arguments))
    except (TypeError, ValueError, RecursionError):
        return valid_text(repr(arguments))


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    parameters: JsonObject


class Message(BaseModel):
    """A conversation message. Assistant messages may carry tool calls; `tool` messages
    answer one tool call each."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    is_error: bool = False


class ProviderRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    system: str
    messages: list[Message]
    tools: list[ToolSpec]
    max_output_tokens: int = Field(ge=1)
    temperature: float | None = None


class ProviderResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    usage: TokenUsage = Field(default_factory=TokenUsage)


class ProviderConfig(BaseModel):
    """`kind` selects the provider, `model` the model; every other key is a setting of
    that provider (for example `base_url`, `api_key_env`, `script`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: str
    model: str

    @field_validator("kind", "model")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty string")
        return value

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def model_name(self) -> str:
        """The name harbor knows this model by: `<kind>/<model>`."""
        return f"{self.kind}/{self.model}"


class ProviderConfigError(ValueError):
    """A provider configuration cannot work (unknown kind, missing key, bad setting)."""


def api_key_from_environment(kind: str, variable: str, *, instead: str = "") -> str:
    """The API key of a provider of `kind`, every kind's way: the environment variable
    `variable`, without surrounding whitespace (a key pasted with its line break); a
    `ProviderConfigError` naming the variable when it is unset or blank, before any
    request. `instead` adds what else a user of `kind` may do."""
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ProviderConfigError(
            f"{kind} provider: no API key; set the environment variable {variable} (or "
            f"point the api_key_env setting at the variable that holds it{instead})")
    return key


class RetrySettings(Settings):
    """The `retry` setting: wmo_trio's retry policy (`wmo_trio.providers._retry`)."""

    max_attempts: PositiveInt = 6
    base_delay_s: NonNegativeSeconds = 1.0
    max_delay_s: NonNegativeSeconds = 30.0
    retry_after_cap_s: NonNegativeSeconds = 60.0


class ProviderSettings(Settings):
    """Settings every provider kind accepts; `build_provider` applies them around the
    provider. Each kind's settings model extends this one."""

    retry: RetrySettings | None = None
    record: NonEmptyText | None = Field(
        default=None, description="the path of a JSONL file every call is appended to")

    @classmethod
    def of(cls, config: ProviderConfig) -> Any:
        """`config`'s settings, checked; a `ProviderConfigError` naming the bad ones."""
        try:
            return cls.parse(config.settings, where=f"{config.kind} provider: ")
        except ValueError as error:
            raise ProviderConfigError(str(error)) from None


class ProviderError(Exception):
    """A model call failed.

    `retryable` tells the retry policy whether another attempt may succeed;
    `retry_after` is the server's requested wait in seconds, when it sent one;
    `usage` is the usage spent so far in this call, attempts included.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        status: int | None = None,
        retry_after: float | None = None,
        usage: TokenUsage | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.usage = usage


class ProviderInterrupted(ProviderError):
    """The call was abandoned because its episode was interrupted."""


@runtime_checkable
class Provider(Protocol):
    """A structured tool-calling model. Implementations must be safe to call from several
    worker threads at once (one episode each)."""

    config: ProviderConfig

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        """One model call. Raises `ProviderError` on failure and `ProviderInterrupted` when
        `control` is interrupted while it waits."""
        ...

    def prepare(self) -> None:
        """Do now, in this (worker) thread, what the first call would otherwise do, such
        as importing an SDK: harbor's agent calls it in its setup, before the burst."""
        ...

    def close(self) -> None:
        """Release the provider's resources. Idempotent."""
        ...


class OwnedProvider(Provider, Protocol):
    """A provider its holder owns: `with build_provider(config) as provider:` closes it
    when the block ends, as `with httpx.Client()` does."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc_info: object) -> None: ...


class ClosesOnExit:
    """What makes a provider class an `OwnedProvider`: `with provider:` calls its
    (idempotent) `close()` when the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
