"""Fixtures of the gateway's unit tests."""

from __future__ import annotations

import pytest

from tests.fakes import InMemoryNats


@pytest.fixture
async def nats():
    """An in-memory NATS for a gateway under test; its handlers' tasks are cancelled after."""
    server = InMemoryNats()
    yield server
    for task in list(server.tasks):
        task.cancel()
