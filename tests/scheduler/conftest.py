"""The scheduler tests' real Redis: a registry on an embedded redis-server of their own."""

from __future__ import annotations

import pytest

from pdd.servers import EmbeddedServer, free_port
from shared.registry import Registry, connect


@pytest.fixture
async def registry(tmp_path):
    port = free_port()
    server = EmbeddedServer.redis(port, "pw", tmp_path).start()
    reg = Registry(connect(f"redis://127.0.0.1:{port}", "pw"), ttl_s=3.0)
    yield reg
    await reg.r.aclose()
    server.close()
