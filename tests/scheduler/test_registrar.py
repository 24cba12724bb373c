"""The registrar (what instances report over NATS, written to Redis), against a real
redis-server: heartbeats with a TTL, index updates in order, a lost update asks for a resync,
and requests an instance still holds but that are no longer in flight are named back to it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from services.scheduler.registrar import Registrar, Roster
from shared import registry as registry_module
from shared.config import config_from_dict
from shared.messages import Heartbeat, IndexEvent, IndexUpdate, InstanceInfo, Leave


def beat(iid: str = "md-0", holding: tuple[str, ...] = ()) -> Heartbeat:
    return Heartbeat(InstanceInfo(iid, "md", "B", running=2), list(holding))


async def test_heartbeat_registers_and_the_first_asks_for_the_whole_index(registry):
    reg = Registrar(registry)
    assert (await reg.on_heartbeat(beat())).resync_index  # never heard of it
    stored = [IndexEvent("cleared"), IndexEvent("stored", ["h1"], first=True), IndexEvent("stored", ["h2"])]
    await reg.on_index(IndexUpdate("md-0", stored, seq=1))
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


async def test_held_requests_are_renewed_and_a_redis_restart_forgets_none_of_them(registry):
    """A stream may outlive its record's first TTL: each heartbeat that reports it renews it.
    After Redis lost everything (a restart, here FLUSHALL), the requests held from before are
    recorded again, not dropped; one taken after with no record is named back as before."""
    reg = Registrar(registry, request_ttl_s=120)
    await registry.set_request("long", {"pipeline": "p-md"}, ttl_s=5)
    assert (await reg.on_heartbeat(beat(holding=("long",)))).forget == []
    assert await registry.r.ttl("pdd:request:long") > 100, "renewed for request_ttl_s"
    await registry.r.flushall()  # Redis restarted empty
    held_for = Heartbeat(InstanceInfo("md-0", "md", "B"), ["long", "early"], [30.0, 20.0])
    assert (await reg.on_heartbeat(held_for)).forget == []
    assert set(await registry.request_ids()) == {"long", "early"}, "recorded again"
    await registry.delete_request("early")  # it ended (the gateway removed it)
    just_taken = Heartbeat(InstanceInfo("md-0", "md", "B"), ["long", "early", "new"], [31.0, 21.0, 0.0])
    assert (await reg.on_heartbeat(just_taken)).forget == ["early", "new"]


async def test_liveness_is_the_registrar_clock_and_allows_for_the_line(registry):
    """An instance's own clock is never trusted (it may be an hour off); another site's instance
    lives a heartbeat and two line delays longer; one that hears no replies is not refreshed."""
    reg = Registrar(registry, control_dc="A", line_delay_s=0.05, heartbeat_s=1.0)
    skewed = InstanceInfo("md-0", "md", "B", updated_at=time.time() + 3600)
    await reg.on_heartbeat(Heartbeat(skewed))
    await reg.on_heartbeat(Heartbeat(InstanceInfo("rld-0", "rld", "A")))
    (md, rld) = sorted(await registry.alive(), key=lambda i: i.id)
    assert abs(md.updated_at - (time.time() - 0.05)) < 1.0
    assert await registry.r.pttl("pdd:instance:md-0") > await registry.r.pttl("pdd:instance:rld-0") + 900
    await registry.remove("md-0")
    await reg.on_heartbeat(Heartbeat(InstanceInfo("md-0", "md", "B"), missed_replies=2))
    assert [i.id for i in await registry.alive()] == ["rld-0"], "the line towards it is down: not refreshed"


async def test_updates_handled_at_once_are_applied_in_their_order(registry, monkeypatch):
    """The bus runs each update in its own task: a whole index in parts, then a removal, all
    in flight together, must reach Redis in the order they were sent."""
    monkeypatch.setattr(registry_module, "INDEX_ORDER_WAIT_S", 10.0)  # order is checked, not the shipped bound
    reg = Registrar(registry)
    parts = [IndexUpdate("md-0", [IndexEvent("cleared"), IndexEvent("stored", ["h0"])], seq=1)]
    parts += [IndexUpdate("md-0", [IndexEvent("stored", [f"h{i}"])], seq=i + 1) for i in range(1, 40)]
    parts += [IndexUpdate("md-0", [IndexEvent("removed", ["h0"])], seq=41)]
    await asyncio.gather(*(reg.on_index(p) for p in parts))
    assert await registry.r.smembers("pdd:kv:md-0") == {f"h{i}" for i in range(1, 40)}
    assert not (await reg.on_heartbeat(beat())).resync_index, "no update taken for lost"


FLEET = Roster.of(
    config_from_dict(
        {
            "instances": [
                {"id": "prefill-0", "role": "prefill", "dc": "A"},
                {"id": "md-0", "role": "md", "dc": "B", "kv_port": 7500},
            ]
        }
    )
)
MD = InstanceInfo("md-0", "md", "B", kv_host="127.0.0.1", kv_port=7500)


async def test_an_instance_reports_only_about_itself_and_only_as_the_config_lists_it(registry):
    """The subject names the sender (NATS lets md-0 publish on md-0's subjects only): a report
    about another instance, from an instance the config does not list, with another role, site
    or KV port, or with a figure out of range, is dropped and nothing of it reaches Redis."""
    reg = Registrar(registry, roster=FLEET)
    forged = [
        ("md-0", InstanceInfo("prefill-0", "prefill", "A")),  # as another instance
        ("prefill-9", InstanceInfo("prefill-9", "prefill", "A")),  # not in the config
        ("md-0", dataclasses.replace(MD, role="prefill", dc="A")),  # another role and site
        ("md-0", dataclasses.replace(MD, kv_port=6666)),  # re-addressed
        ("md-0", dataclasses.replace(MD, kv_host="203.0.113.9")),
        ("md-0", dataclasses.replace(MD, running=-5)),
        ("md-0", dataclasses.replace(MD, step_ms=float("nan"))),
    ]
    for reporter, info in forged:
        assert await reg.on_heartbeat(Heartbeat(info), reporter) is None, info
    assert await registry.alive() == []
    assert await reg.on_heartbeat(Heartbeat(MD), "md-0") is not None
    assert [i.id for i in await registry.alive()] == ["md-0"]


async def test_an_instance_can_neither_remove_nor_rewrite_the_index_of_another(registry):
    reg = Registrar(registry, roster=FLEET)
    await reg.on_heartbeat(Heartbeat(InstanceInfo("prefill-0", "prefill", "A")), "prefill-0")
    await reg.on_index(IndexUpdate("prefill-0", [IndexEvent("stored", ["h1"])], seq=1), "prefill-0")
    await reg.on_leave(Leave("prefill-0"), "md-0")
    await reg.on_index(IndexUpdate("prefill-0", [IndexEvent("cleared")], seq=2), "md-0")
    assert [i.id for i in await registry.alive()] == ["prefill-0"]
    assert await registry.r.smembers("pdd:kv:prefill-0") == {"h1"}
    await reg.on_leave(Leave("prefill-0"), "prefill-0")
    assert await registry.alive() == []


async def test_a_heartbeat_is_one_round_trip_and_reads_as_before(registry):
    """`heard` writes the row and reads the index's state in one Lua call: the row reads back
    whole, the id is listed, the epoch is set, and the resync answer is `index_state`'s."""
    info = InstanceInfo("md-0", "md", "B", running=3, kv_host="10.0.0.2", kv_port=7001, step_ms=21.5)
    assert await registry.heard(info, sampled_at=123.5, ttl_s=2.0)  # no index yet: send it whole
    (back,) = await registry.alive()
    assert back == dataclasses.replace(info, updated_at=123.5)
    assert 1000 < await registry.r.pttl("pdd:instance:md-0") <= 2000 and await registry.epoch_age() is not None
    await registry.apply_index_update(
        "md-0", IndexUpdate("md-0", [IndexEvent("cleared"), IndexEvent("stored", ["h1"])], seq=1)
    )
    assert not await registry.heard(info, ttl_s=2.0)  # numbered and alive: nothing to resend
    assert await registry.r.pttl("pdd:kv:md-0") > 20_000  # the index lives on with the heartbeats
    await registry.r.set("pdd:kv:md-0:resync", 1)
    assert await registry.heard(info, ttl_s=2.0) and not await registry.index_state("md-0")  # asked once
