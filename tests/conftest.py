"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from anthropic_server import AnthropicServer
from e2b_fake import FakeE2B, Faults

# harbor's job-end telemetry imports litellm: 3-4 s of CPU per harbor run the tests start.
os.environ.setdefault("HARBOR_TELEMETRY", "0")


@pytest.fixture
def anthropic_server() -> Iterator[AnthropicServer]:
    """A loopback stand-in for the Anthropic Messages API (see tests/anthropic_server.py)."""
    with AnthropicServer() as server:
        yield server


@pytest.fixture(scope="session")
def fake_e2b() -> Iterator[FakeE2B]:
    """The loopback E2B service (see tests/e2b_fake.py), started once."""
    with FakeE2B() as service:
        yield service


@pytest.fixture
def e2b(fake_e2b: FakeE2B, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeE2B]:
    """The fake E2B, with the SDK's variables pointing at it, its faults cleared, and a
    check that the test left no sandbox alive."""
    for name, value in fake_e2b.environment().items():
        monkeypatch.setenv(name, value)
    fake_e2b.faults = Faults()
    before = set(fake_e2b.created)
    yield fake_e2b
    fake_e2b.faults = Faults()
    leaked = [sid for sid in fake_e2b.alive() if sid not in before]
    assert leaked == [], f"sandboxes left alive: {leaked}"


# The module-scoped fixtures that run harbor jobs (or other costly work) for several tests
# to read. `make test` spreads tests over processes (pytest-xdist, `--dist loadgroup`); the
# tests that share one of these go to the same process, so it runs once, not once a process.
SHARED_FIXTURES = frozenset({
    "cache_dir", "concurrent_job", "defect_jobs", "demo_job", "example_job", "first_job",
    "hostile_job", "identical_on_16_tasks", "jobs", "observations_job", "oracle_job",
    "round_trip_job", "timeout_job",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every real harbor trial is slow: `make test-fast` leaves them out. Tests that share a
    costly module fixture run in one xdist process."""
    for item in items:
        if item.get_closest_marker("harbor") is not None:
            item.add_marker(pytest.mark.slow)
        shared = sorted(SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ())))
        if shared:
            module = item.module.__name__ if isinstance(item, pytest.Function) else item.nodeid
            item.add_marker(pytest.mark.xdist_group(f"{module}::{shared[0]}"))
