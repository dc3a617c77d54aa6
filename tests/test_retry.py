"""wmo_trio's retry policy on its own, around a provider that fails on cue."""

from __future__ import annotations

import random
import time
from collections import deque

import pytest
from doubles import RecordingControl, when

from wmo_trio.models import TokenUsage
from wmo_trio.providers import build_provider
from wmo_trio.providers._base import (
    CallControl,
    FinishReason,
    ProviderConfig,
    ProviderConfigError,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
)
from wmo_trio.providers._retry import RetryingProvider, RetryPolicy

REQUEST = ProviderRequest(system="s", messages=[], tools=[], max_output_tokens=10)
FAST = RetryPolicy(max_attempts=5, base_delay_s=0.001, max_delay_s=0.002, retry_after_cap_s=0.002)


class Flaky:
    """A provider that plays a list of outcomes: errors to raise, or a response."""

    def __init__(self, *outcomes: ProviderError | ProviderResponse) -> None:
        self.config = ProviderConfig(kind="scripted", model="flaky")
        self.outcomes = deque(outcomes)
        self.calls = 0

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        self.calls += 1
        outcome = self.outcomes.popleft()
        if isinstance(outcome, ProviderError):
            raise outcome
        return outcome

    def close(self) -> None:
        pass


def overloaded(usage: TokenUsage | None = None, retry_after: float | None = None) -> ProviderError:
    return ProviderError("overloaded", retryable=True, status=529, usage=usage, retry_after=retry_after)


def ok(usage: TokenUsage | None = None) -> ProviderResponse:
    return ProviderResponse(text="ok", finish_reason=FinishReason.STOP,
                            usage=usage or TokenUsage(input_tokens=10, output_tokens=2, calls=1))


def test_usage_of_failed_attempts_is_added_to_the_response() -> None:
    spent = TokenUsage(input_tokens=7, calls=1)
    provider = RetryingProvider(Flaky(overloaded(spent), overloaded(spent), ok()), FAST)
    assert provider.complete(REQUEST, CallControl()).usage == TokenUsage(
        input_tokens=24, output_tokens=2, calls=3)


def test_usage_of_every_attempt_is_on_the_final_error() -> None:
    spent = TokenUsage(input_tokens=7, calls=1)
    provider = RetryingProvider(Flaky(*(overloaded(spent) for _ in range(3))),
                                RetryPolicy(max_attempts=3, base_delay_s=0.001))
    with pytest.raises(ProviderError) as caught:
        provider.complete(REQUEST, CallControl())
    assert caught.value.usage == TokenUsage(input_tokens=21, calls=3)


def test_attempts_are_bounded() -> None:
    inner = Flaky(*(overloaded() for _ in range(10)))
    with pytest.raises(ProviderError):
        RetryingProvider(inner, RetryPolicy(max_attempts=4, base_delay_s=0.001)).complete(
            REQUEST, CallControl())
    assert inner.calls == 4


def test_a_non_retryable_error_is_raised_at_once() -> None:
    inner = Flaky(ProviderError("bad request", status=400), ok())
    with pytest.raises(ProviderError, match="bad request"):
        RetryingProvider(inner, FAST).complete(REQUEST, CallControl())
    assert inner.calls == 1


def test_a_wait_past_the_episode_deadline_is_not_started() -> None:
    inner = Flaky(overloaded(), ok())
    control = RecordingControl(deadline=time.monotonic() + 0.5)
    policy = RetryPolicy(base_delay_s=30.0, max_delay_s=30.0)
    policy.rng.seed(1)  # so the jittered wait is well above the half second left
    with pytest.raises(ProviderError, match="overloaded"):
        RetryingProvider(inner, policy).complete(REQUEST, control)
    assert control.sleeps == []
    assert inner.calls == 1


def test_retry_after_is_obeyed_up_to_the_cap() -> None:
    control = RecordingControl()
    policy = RetryPolicy(retry_after_cap_s=0.01)
    RetryingProvider(Flaky(overloaded(retry_after=0.005), overloaded(retry_after=3600), ok()),
                     policy).complete(REQUEST, control)
    assert control.sleeps == [0.005, 0.01]


def test_an_interrupt_during_backoff_raises_provider_interrupted_promptly() -> None:
    spent = TokenUsage(input_tokens=3, calls=1)
    control = RecordingControl()
    provider = RetryingProvider(Flaky(overloaded(spent, retry_after=20), ok()),
                                RetryPolicy(retry_after_cap_s=20))
    when(control.sleeping, control.interrupt)  # once the 20 s backoff has begun
    started = time.monotonic()
    with pytest.raises(ProviderInterrupted) as caught:
        provider.complete(REQUEST, control)
    assert time.monotonic() - started < 15  # far from the 20 s backoff
    assert control.sleeps == [20]
    assert caught.value.usage == spent


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 6, 10])
def test_full_jitter_stays_within_zero_and_the_ceiling(attempt: int) -> None:
    policy = RetryPolicy(base_delay_s=0.5, max_delay_s=3.0, rng=random.Random(attempt))
    ceiling = min(3.0, 0.5 * 2 ** (attempt - 1))
    delays = [policy.delay_before(attempt, overloaded()) for _ in range(2000)]
    assert all(0.0 <= delay <= ceiling for delay in delays)
    # full jitter spreads over the whole range, not just near the ceiling
    assert min(delays) < ceiling * 0.1 and max(delays) > ceiling * 0.9


def test_a_very_late_attempt_waits_at_most_max_delay() -> None:
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=2.0)
    assert 0.0 <= policy.delay_before(5000, overloaded()) <= 2.0


def test_settings_are_read_and_checked() -> None:
    provider = build_provider({"kind": "scripted", "model": "offline", "retry": {
        "max_attempts": 2, "base_delay_s": 0.5, "retry_after_cap_s": 1}})
    assert isinstance(provider, RetryingProvider)
    policy = provider.policy
    assert (policy.max_attempts, policy.base_delay_s, policy.retry_after_cap_s) == (2, 0.5, 1)
    assert RetryPolicy.from_settings(None) == RetryPolicy()


@pytest.mark.parametrize("settings", [
    {"max_attemps": 3}, {"max_attempts": 0}, {"max_attempts": 1.5}, {"base_delay_s": -1},
    {"max_delay_s": float("inf")}, {"retry_after_cap_s": True}, "fast", [1, 2],
])
def test_bad_settings_are_refused(settings: object) -> None:
    with pytest.raises(ProviderConfigError, match="retry"):
        build_provider({"kind": "scripted", "model": "s", "retry": settings})
