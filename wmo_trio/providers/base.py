"""The provider interface: one structured tool-calling model call, as plain data.

Providers are synchronous: the episode loop that calls them runs in a worker thread. A call
is bounded by a `CallControl`, which the episode interrupts when it is aborted, cancelled
or out of wall-clock budget; a provider must return (or raise `ProviderInterrupted`) soon
after that, never leaving the worker blocked on a wait nobody wants any more.
"""

from __future__ import annotations

import threading
import time
from enum import StrEnum
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from wmo_trio.models import JsonObject, TokenUsage


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


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

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


class CallControl:
    """Interruption and deadline shared by every wait of one episode.

    Thread-safe. `interrupt()` is sticky: once interrupted, every later `sleep` returns at
    once, so a worker blocked in backoff or scripted latency wakes immediately.
    """

    def __init__(self, deadline: float | None = None) -> None:
        self._interrupted = threading.Event()
        self.deadline = deadline

    def interrupt(self) -> None:
        self._interrupted.set()

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def remaining(self) -> float | None:
        """Seconds until the deadline (never negative), or None without a deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def sleep(self, seconds: float) -> bool:
        """Wait up to `seconds`, bounded by the deadline. False when cut short."""
        remaining = self.remaining()
        wait = seconds if remaining is None else min(seconds, remaining)
        if self._interrupted.wait(max(0.0, wait)):
            return False
        return remaining is None or seconds <= remaining

    def wait_interrupted(self, timeout: float | None = None) -> bool:
        return self._interrupted.wait(timeout)


@runtime_checkable
class Provider(Protocol):
    """A structured tool-calling model. Implementations must be safe to call from several
    worker threads at once (one episode each)."""

    config: ProviderConfig

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        """One model call. Raises `ProviderError` on failure and `ProviderInterrupted` when
        `control` is interrupted while it waits."""
        ...

    def close(self) -> None:
        """Release the provider's resources. Idempotent."""
        ...
