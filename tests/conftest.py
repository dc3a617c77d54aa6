"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from anthropic_server import AnthropicServer


@pytest.fixture
def anthropic_server() -> Iterator[AnthropicServer]:
    """A loopback stand-in for the Anthropic Messages API (see tests/anthropic_server.py)."""
    with AnthropicServer() as server:
        yield server
