"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    # Imported by the fixtures that use them: the fake E2B brings the e2b SDK, about a
    # second of CPU in every pytest process (xdist's controller and workers included).
    from anthropic_server import AnthropicServer
    from e2b_fake import FakeE2B

# harbor's job-end telemetry imports litellm: seconds of CPU per harbor run the tests start.
# (harbor's preflight imports it as well when `-m` is given without
# --skip-model-parsing-and-provider-mapping.)
os.environ.setdefault("HARBOR_TELEMETRY", "0")


@pytest.fixture(autouse=True)
def _servers_checked_afresh() -> None:
    """The OpenAI kind checks a server once per process for its URL: a test's loopback
    server can get the port of an earlier test's, and would inherit its model list."""
    checks = sys.modules.get("wmo_trio.providers._openai_check")
    if checks is not None:
        checks._checked_servers.clear()


@pytest.fixture
def anthropic_server() -> Iterator[AnthropicServer]:
    """A loopback stand-in for the Anthropic Messages API (see tests/anthropic_server.py)."""
    from anthropic_server import AnthropicServer

    with AnthropicServer() as server:
        yield server


@pytest.fixture(scope="session")
def fake_e2b() -> Iterator[FakeE2B]:
    """The loopback E2B service (see tests/e2b_fake.py), started once."""
    from e2b_fake import FakeE2B

    with FakeE2B() as service:
        yield service


@pytest.fixture
def e2b(fake_e2b: FakeE2B, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeE2B]:
    """The fake E2B, with the SDK's variables pointing at it, its faults cleared, and a
    check that the test left no sandbox alive."""
    from e2b_fake import Faults

    for name, value in fake_e2b.environment().items():
        monkeypatch.setenv(name, value)
    fake_e2b.faults = Faults()
    before = set(fake_e2b.created)
    yield fake_e2b
    fake_e2b.faults = Faults()
    leaked = [sid for sid in fake_e2b.alive() if sid not in before]
    assert leaked == [], f"sandboxes left alive: {leaked}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every real harbor trial is slow: `make test-fast` leaves them out."""
    for item in items:
        if item.get_closest_marker("harbor") is not None:
            item.add_marker(pytest.mark.slow)
