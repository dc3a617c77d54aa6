"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from anthropic_server import AnthropicServer

# harbor's job-end telemetry imports litellm: 3-4 s of CPU per harbor run the tests start.
os.environ.setdefault("HARBOR_TELEMETRY", "0")


@pytest.fixture
def anthropic_server() -> Iterator[AnthropicServer]:
    """A loopback stand-in for the Anthropic Messages API (see tests/anthropic_server.py)."""
    with AnthropicServer() as server:
        yield server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every real harbor trial is slow: `make test-fast` leaves them out."""
    for item in items:
        if item.get_closest_marker("harbor") is not None:
            item.add_marker(pytest.mark.slow)
