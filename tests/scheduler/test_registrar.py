"""The registrar (what instances report over NATS, written to Redis), against a real
redis-server: heartbeats with a TTL, index updates in order, a lost update asks for a resync,
and requests an instance still holds but that are no longer in flight are named back to it."""

from __future__ import annotations

from services.scheduler.registrar import Registrar
from shared.messages import Heartbeat, IndexEvent, IndexUpdate, InstanceInfo, Leave


def beat(iid: str = "md-0", holding: tuple[str, ...] = ()) -> Heartbeat:
    return Heartbeat(InstanceInfo(iid, "md", "B", running=2), list(holding))


async def test_heartbeat_registers_and_the_first_asks_for_the_whole_index(registry):
    reg = Registrar(registry)
    assert (await reg.on_heartbeat(beat())).resync_index  # never heard of it
    await reg.on_index(IndexUpdate("md-0", [IndexEvent("cleared"), IndexEvent("stored", ["h1", "h2"])], seq=1))
    assert not (await reg.on_heartbeat(beat())).resync_index
    assert [i.id for i in await registry.alive()] == ["md-0"] and (await registry.alive())[0].running == 2
    assert await registry.prefix_blocks(["md-0"], ["h1", "h2", "h3"]) == {"md-0": 2}


async def test_a_gap_in_index_updates_asks_for_a_resync(registry):
    reg = Registrar(registry)
    await reg.on_index(IndexUpdate("md-0", [IndexEvent("cleared")], seq=1))
    await reg.on_heartbeat(beat())
    await reg.on_index(IndexUpdate("md-0", [IndexEvent("stored", ["h1"])], seq=3))  # seq 2 was lost
    assert (await reg.on_heartbeat(beat())).resync_index
    assert not (await reg.on_heartbeat(beat())).resync_index  # asked once


async def test_requests_no_longer_in_flight_are_named_back(registry):
    reg = Registrar(registry)
    await registry.set_request("alive", {"pipeline": "p-md"}, ttl_s=60)
    reply = await reg.on_heartbeat(beat(holding=("alive", "moved-away")))
    assert reply.forget == ["moved-away"]


async def test_leave_forgets_the_instance_at_once(registry):
    reg = Registrar(registry)
    await reg.on_heartbeat(beat())
    await reg.on_leave(Leave("md-0"))
    assert await registry.alive() == []
