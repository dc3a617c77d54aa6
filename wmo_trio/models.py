"""The plain data of an episode: actions, observations, steps, usage and the run result.

Everything here crosses a file or process boundary (traces, runner frames, recordings), so
every model round-trips exactly through JSON and carries no behaviour beyond arithmetic on
usage.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

JsonObject = dict[str, Any]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ActionKind(StrEnum):
    TOOL_CALL = "tool_call"
    MESSAGE = "message"


class Action(_Model):
    """What the agent did: a tool call (`name`, `arguments`) or a plain message (`content`)."""

    kind: ActionKind
    name: str | None = None
    arguments: JsonObject | None = None
    content: str | None = None


class Observation(_Model):
    """What came back: text for the model, whether it is an error, and side data."""

    content: str
    is_error: bool = False
    reward: float | None = None
    metadata: JsonObject = Field(default_factory=dict)


class Step(_Model):
    """One action and its observation. `started_at` (UTC) is when the action began: the
    end of the step or model reply before it, as an episode's actions run one after
    another; `duration_s` is how long it took from then until it was recorded."""

    action: Action
    observation: Observation
    started_at: datetime | None = None
    duration_s: float | None = Field(default=None, ge=0)


class StopReason(StrEnum):
    SUBMITTED = "submitted"
    MAX_TURNS = "max_turns"
    NO_ACTION = "no_action"
    ERROR = "error"
    BUDGET = "budget"
    NO_TOOL_CALL = "no_tool_call"
    OUTPUT_TRUNCATED = "output_truncated"
    UNPARSED_TOOL_CALL = "unparsed_tool_call"
    PROVIDER_ERROR = "provider_error"
    UNKNOWN_DONE_REASON = "unknown_done_reason"
    CANCELLED = "cancelled"


class TokenUsage(_Model):
    """Worker-model usage. `input_tokens` includes cached reads and cache writes."""

    input_tokens: NonNegativeInt = 0
    output_tokens: NonNegativeInt = 0
    cached_input_tokens: NonNegativeInt = 0
    cache_write_input_tokens: NonNegativeInt = 0
    calls: NonNegativeInt = 0

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cached_input_tokens=self.cached_input_tokens + other.cached_input_tokens,
            cache_write_input_tokens=self.cache_write_input_tokens
            + other.cache_write_input_tokens,
            calls=self.calls + other.calls,
        )


class RunResult(_Model):
    """The outcome of one episode; `turns` counts the recorded tool-call steps."""

    task_id: str
    steps: list[Step]
    stop_reason: StopReason
    answer: str = ""
    turns: NonNegativeInt
    worker_usage: TokenUsage | None = None


def count_tool_steps(steps: list[Step]) -> int:
    return sum(1 for step in steps if step.action.kind is ActionKind.TOOL_CALL)
