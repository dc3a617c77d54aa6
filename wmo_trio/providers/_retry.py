"""wmo_trio's retry policy, wrapped around every provider.

The SDKs' own retries are turned off (the anthropic SDK obeys `retry-after` without a cap:
a 3600 s header sleeps an hour), so this is the only place that decides to try again:

- retried: errors the provider marks retryable (HTTP 408, 409, 429, 500, 502, 503, 504,
  529, connection errors and timeouts); never 400, 401, 403, 404, 413, 422;
- exponential backoff with full jitter, or the server's `retry-after`, capped;
- bounded by the attempt count and by the episode's remaining wall-clock budget;
- every wait is a `CallControl.sleep`, so an aborted or cancelled episode stops waiting at
  once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Self

from wmo_trio.models import TokenUsage
from wmo_trio.providers._base import (
    CallControl,
    ClosesOnExit,
    Provider,
    ProviderError,
    ProviderInterrupted,
    ProviderRequest,
    ProviderResponse,
    RetrySettings,
)

RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    retry_after_cap_s: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @classmethod
    def from_settings(cls, settings: RetrySettings | None) -> Self:
        """The policy of a provider config's `retry` setting (checked by its model)."""
        return cls(**(settings or RetrySettings()).model_dump())

    def delay_before(self, attempt: int, error: ProviderError) -> float:
        """Seconds to wait before attempt number `attempt + 1` (attempts count from 1)."""
        if error.retry_after is not None:
            return min(max(0.0, error.retry_after), self.retry_after_cap_s)
        # The exponent is capped so that a large attempt number cannot overflow a float.
        ceiling = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(attempt - 1, 64))
        return self.rng.uniform(0.0, ceiling)


class RetryingProvider(ClosesOnExit):
    """A provider that retries its inner provider's retryable failures under a policy."""

    def __init__(self, inner: Provider, policy: RetryPolicy) -> None:
        self.inner = inner
        self.policy = policy
        self.config = inner.config

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        spent = TokenUsage()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self.inner.complete(request, control)
            except ProviderInterrupted as error:
                error.usage = spent + (error.usage or TokenUsage())
                raise
            except ProviderError as error:
                spent = spent + (error.usage or TokenUsage())
                error.usage = spent
                if not error.retryable or attempt >= self.policy.max_attempts:
                    raise
                delay = self.policy.delay_before(attempt, error)
                remaining = control.remaining()
                if remaining is not None and delay >= remaining:
                    # The episode would be out of budget before the next attempt.
                    raise
                if not control.sleep(delay):
                    raise ProviderInterrupted(
                        f"retry wait interrupted after attempt {attempt}: {error}", usage=spent
                    ) from error
                continue
            if spent != TokenUsage():
                response = response.model_copy(update={"usage": response.usage + spent})
            return response

    def prepare(self) -> None:
        self.inner.prepare()

    def close(self) -> None:
        self.inner.close()
