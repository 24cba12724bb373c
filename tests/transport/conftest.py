"""The KV plane's test receiver, shared by the receiver's and the connection pool's tests."""

from __future__ import annotations

import pytest

from tests.helpers import until
from tests.transport.test_kv_receiver import Rig


@pytest.fixture
async def rig():
    """`await rig(stall_s=..., ...)`: a started receiver; at the end, every connection it took
    must have ended and left nothing behind (per-peer counts, transfers being received)."""
    made: list[Rig] = []

    async def make(stall_s: float = 5.0, **kw) -> Rig:
        r = Rig(stall_s, **kw)
        await r.rx.start()
        made.append(r)
        return r

    yield make
    for r in made:
        await until(lambda r=r: not r.rx._per_peer and not r.rx._receiving, what="the receiver's connections to end")
        await r.rx.stop()
