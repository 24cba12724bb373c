"""A prefix index too large for one NATS message (its payload limit is 1 MiB, about 42k block
hashes) goes in numbered parts, through a real nats-server configured as the launcher does, to
the real registrar and Redis, which apply the parts in order: the whole set arrives, no gap."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import MaxPayloadError

from services.scheduler.registrar import Registrar
from shared import subjects
from shared.bus import Bus
from shared.config import config_from_dict
from shared.instance import INDEX_HASHES_PER_UPDATE, InstanceService, index_parts
from shared.messages import Heartbeat, IndexEvent, IndexUpdate, InstanceInfo
from tests.helpers import until
from tests.scheduler import conftest as scheduler_fixtures
from tests.wanlink.conftest import cluster

registry = scheduler_fixtures.registry  # a real redis-server of the test's own
BLOCKS = 60_000  # a cache of ~1M tokens at 16 per block


class CacheOf:
    """The engine worker's `call`, over an engine whose radix cache holds `hashes`."""

    def __init__(self, hashes: list[str]) -> None:
        self.hashes = hashes

    def cache_events(self, full: bool) -> list[IndexEvent]:
        if not full:
            return []
        return [
            IndexEvent("cleared"),
            IndexEvent("stored", self.hashes[:1], first=True),
            IndexEvent("stored", self.hashes[1:]),
        ]

    async def call(self, fn):
        return fn(self)


async def test_a_whole_index_over_the_payload_limit_arrives_in_parts(nats_a, secrets, registry):
    url, _ = nats_a
    scheduler = await Bus.connect(url, "scheduler-index", "scheduler", secrets)
    instance = await Bus.connect(url, "prefill-0", "prefill-0", secrets)
    try:
        registrar = Registrar(registry)
        await registrar.serve(scheduler)
        hashes = [f"{i:024x}" for i in range(BLOCKS)]
        with pytest.raises(MaxPayloadError):  # what one message would do
            await instance.publish(
                subjects.index("prefill-0"), IndexUpdate("prefill-0", CacheOf(hashes).cache_events(True), 1)
            )

        cfg = config_from_dict(cluster())
        svc = InstanceService(cfg, cfg.instance("prefill-0"))
        svc.bus, svc.worker = instance, CacheOf(hashes)
        await svc.report_index()
        assert svc._index_seq == -(-BLOCKS // INDEX_HASHES_PER_UPDATE) > 1

        async def arrived() -> bool:
            return await registry.r.scard("pdd:kv:prefill-0") == BLOCKS

        await until(arrived, timeout=30, what="every hash in Redis")
        assert await registry.prefix_blocks(["prefill-0"], hashes[:100]) == {"prefill-0": 100}
        reply = await registrar.on_heartbeat(Heartbeat(InstanceInfo("prefill-0", "prefill", "A")))
        assert not reply.resync_index, "the parts came in order, none missing"
    finally:
        await instance.close()
        await scheduler.close()


def test_parts_keep_the_order_and_the_bound():
    events = [
        IndexEvent("cleared"),
        IndexEvent("stored", [f"f{i}" for i in range(12)], first=True),
        IndexEvent("stored", [f"s{i}" for i in range(25)]),
        IndexEvent("removed", ["s3", "s4"]),
        IndexEvent("removed", ["f1"], first=True),
        IndexEvent("stored", [f"t{i}" for i in range(7)]),
    ]
    parts = index_parts(events, limit=10)
    assert all(sum(len(e.hashes) for e in p) <= 10 for p in parts)
    assert parts[0][0].kind == "cleared" and all(p[0].kind != "cleared" for p in parts[1:])
    flat = [(e.kind, e.first, h) for p in parts for e in p for h in e.hashes]
    assert flat == [(e.kind, e.first, h) for e in events for h in e.hashes]  # a first block stays marked
    assert index_parts([IndexEvent("stored", ["a"])]) == [[IndexEvent("stored", ["a"])]]
    assert index_parts([]) == []


class IdleEngine:
    """An engine whose cache changes when the test says so; counts the index loop's peeks."""

    def __init__(self) -> None:
        self.changed, self.peeks, self.calls = False, 0, 0

    @property
    def has_cache_events(self) -> bool:
        self.peeks += 1
        return self.changed

    def cache_events(self, full: bool) -> list[IndexEvent]:
        events = [IndexEvent("cleared")] if full else []
        if self.changed:
            self.changed = False
            events.append(IndexEvent("stored", ["h1"]))
        return events

    async def call(self, fn):
        self.calls += 1
        return fn(self)


class Published(list):
    async def publish(self, subject: str, msg) -> None:
        self.append(msg)


async def test_an_idle_instance_reports_nothing_and_calls_no_engine():
    """The index loop looks every 0.1 s; it calls the engine's thread only when the cache changed
    (or the registrar asked for all of it): an idle cluster's instances each made ten calls a
    second to their engine thread, for nothing."""
    cfg = config_from_dict(cluster())
    svc = InstanceService(cfg, cfg.instance("prefill-0"))
    engine = IdleEngine()
    engine.engine = engine  # the worker's engine, peeked at without a call
    svc.bus, svc.worker = Published(), engine
    task = asyncio.create_task(svc._index_loop())
    try:
        await until(lambda: engine.peeks >= 5, timeout=30, what="five looks at an idle cache")
        assert engine.calls == 1 and [e.kind for m in svc.bus for e in m.events] == ["cleared"]  # the first, whole
        engine.changed = True
        await until(lambda: len(svc.bus) == 2, timeout=30, what="the change reported")
        assert svc.bus[-1].events == [IndexEvent("stored", ["h1"])] and engine.calls == 2
    finally:
        task.cancel()
