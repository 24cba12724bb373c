"""The link with real nats-server and redis-server: control over NATS, byte counts in Redis,
send_kv through the link, and the `python -m services.wanlink` process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from services.wanlink import WanLink, bytes_key, state_key, total_key
from shared import subjects
from shared.bus import Bus
from shared.config import WanConfig
from shared.kv_transport import KVReceiver, KVTransferError, Transfer, send_kv
from shared.messages import Ack, WanControl
from pdd.servers import EmbeddedServer
from tests.wanlink.conftest import Upstream, open_via

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    nats, redis = EmbeddedServer("nats").start(), EmbeddedServer("redis").start()
    yield nats.url, redis.url
    nats.close()
    redis.close()


@pytest.fixture
async def clients(servers) -> AsyncIterator[tuple[Bus, Redis]]:
    bus = await Bus.connect(servers[0], "wanlink-test")
    redis = Redis.from_url(servers[1], decode_responses=True)
    yield bus, redis
    await bus.close()
    await redis.aclose()


def link_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def test_control_over_nats_and_counts_in_redis(clients, make_link, upstream):
    bus, redis = clients
    name = link_name()
    link = await make_link(bus=bus, redis=redis, name=name, bandwidth_mbps=8)  # 2 MB would take 2 s
    control = subjects.wan_control(name)

    refused = await bus.request(control, WanControl(bandwidth_mbps=0), Ack, timeout=2)
    assert not refused.ok and "bandwidth_mbps" in refused.error
    assert link.bandwidth_mbps() == 8
    ack = await bus.request(control, WanControl(bandwidth_mbps=80, delay_ms=3), Ack, timeout=2)
    assert ack.ok and ack.request_id == ""
    assert (link.bandwidth_mbps(), link.delay_ms) == (80, 3)

    payload = os.urandom(2_000_000)
    t0 = asyncio.get_running_loop().time()
    _, writer = await open_via(link, upstream, "r-redis")
    writer.write(payload)
    await upstream.wait_received(len(payload), timeout=5)
    assert asyncio.get_running_loop().time() - t0 < 1.2  # ~0.2 s at 80 Mbps (2 s at the old 8)
    # counted before it was written: complete the moment the upstream has the last byte
    assert int(await redis.hget(bytes_key(name), "r-redis")) == upstream.received == len(payload)
    assert int(await redis.get(total_key(name))) == len(payload)
    assert 0 < await redis.ttl(bytes_key(name)) <= 3600
    await asyncio.sleep(1.2)  # the state is republished at least once a second
    state = await redis.hgetall(state_key(name))
    assert float(state["bandwidth_mbps"]) == 80 and float(state["delay_ms"]) == 3
    assert int(state["total_bytes"]) == len(payload) and state["connections"] == "1"
    writer.close()


async def test_stall_and_drop_over_nats(clients, make_link, upstream):
    bus, redis = clients
    name = link_name()
    link = await make_link(bus=bus, redis=redis, name=name, bandwidth_mbps=1000)
    reader, writer = await open_via(link, upstream, "r-cut")
    assert (await bus.request(subjects.wan_control(name), WanControl(stall_s=0.5), Ack, timeout=2)).ok
    writer.write(b"x" * 1000)
    await asyncio.sleep(0.25)
    assert upstream.received == 0
    await upstream.wait_received(1000, timeout=3)
    assert (await bus.request(subjects.wan_control(name), WanControl(drop=True), Ack, timeout=2)).ok
    try:
        assert await asyncio.wait_for(reader.read(), 2) == b""
    except ConnectionResetError:
        pass
    assert link.connections == 0


async def test_send_kv_through_the_link(clients, make_link):
    _, redis = clients
    name = link_name()
    link = await make_link(redis=redis, name=name, bandwidth_mbps=200, delay_ms=5, jitter_ms=2)
    got: list[Transfer] = []

    async def commit(t: Transfer) -> str:
        got.append(t)
        return ""

    receiver = KVReceiver(commit, stall_s=5)
    port = await receiver.start()
    layers = [os.urandom(100_000 + i) for i in range(4)]
    try:
        header, done = {"num_layers": 4, "dtype": "float32"}, {"first_token": 7, "stats": {}}
        via = ("127.0.0.1", link.port)
        sent = await send_kv("127.0.0.1", port, "r-kv", "prefill-0", header, layers, done, stall_s=5, via=via)
    finally:
        await receiver.stop()
    assert got[0].layers == layers and got[0].request_id == "r-kv"
    assert sent == got[0].wire_bytes == link.forwarded_bytes("r-kv")
    assert int(await redis.hget(bytes_key(name), "r-kv")) == sent


async def test_process_entry_point(servers, tmp_path):
    up = Upstream()
    await up.start()
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "wan: {name: proc, bandwidth_mbps: 100, delay_ms: 1}\n"
        "instances: [{id: p0, role: prefill}, {id: md0, role: md}]\n"
    )
    ready = tmp_path / "port"
    env = {**os.environ, "PDD_NATS_URL": servers[0], "PDD_REDIS_URL": servers[1]}
    argv = ["-m", "services.wanlink", "--config", str(config), "--ready-file", str(ready)]
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, cwd=REPO, env=env, stderr=PIPE)
    try:
        for _ in range(200):
            if ready.exists() or proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        link = WanLink(WanConfig())
        link.port = int(ready.read_text())  # a stand-in, so open_via reaches the process's port
        _, writer = await open_via(link, up, "r-proc")
        writer.write(b"hello" * 1000)
        await up.wait_received(5000, timeout=5)
        writer.close()
        redis = Redis.from_url(servers[1], decode_responses=True)
        assert int(await redis.hget(bytes_key("proc"), "r-proc")) == 5000
        await redis.aclose()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        await up.stop()
    assert proc.returncode == 0, err
    assert b"listening on 127.0.0.1:" in err


async def _slow_transfer(make_link, redis, rid: str, receiver: KVReceiver) -> tuple[WanLink, asyncio.Task, int]:
    """2 MB through a 4 Mbps link (about 4 s) to `receiver`, started in the background."""
    link = await make_link(redis=redis, name=link_name(), bandwidth_mbps=4, delay_ms=5)
    port = await receiver.start()
    layers = [os.urandom(500_000) for _ in range(4)]
    header, done = {"num_layers": 4, "dtype": "float32"}, {"first_token": 7, "stats": {}}
    push = asyncio.create_task(send_kv("127.0.0.1", port, rid, "prefill-0", header, layers, done, stall_s=10,
                                       via=("127.0.0.1", link.port)))  # fmt: skip
    return link, push, sum(map(len, layers))


async def _stops_carrying(link: WanLink, rid: str) -> int:
    carried = link.forwarded_bytes(rid)
    await asyncio.sleep(0.5)
    assert link.forwarded_bytes(rid) == carried
    return carried


async def test_a_receiver_that_drops_the_request_cuts_the_transfer(clients, make_link):
    receiver = KVReceiver(lambda t: asyncio.sleep(0, ""), stall_s=10)
    link, push, total = await _slow_transfer(make_link, clients[1], "r-cut", receiver)
    try:
        while link.forwarded_bytes("r-cut") < 200_000:
            await asyncio.sleep(0.02)
        assert receiver.cancel("r-cut") and not receiver.cancel("r-cut")
        with pytest.raises(KVTransferError):
            await asyncio.wait_for(push, 2.0)
        assert await _stops_carrying(link, "r-cut") < total / 2
    finally:
        await receiver.stop()


async def test_a_transfer_nobody_expects_is_cut_at_its_header(clients, make_link):
    receiver = KVReceiver(lambda t: asyncio.sleep(0, ""), stall_s=10, wanted=lambda rid: False)
    link, push, total = await _slow_transfer(make_link, clients[1], "r-unwanted", receiver)
    try:
        with pytest.raises(KVTransferError):
            await asyncio.wait_for(push, 2.0)
        assert await _stops_carrying(link, "r-unwanted") < total / 2
    finally:
        await receiver.stop()


async def test_a_cancelled_sender_resets_and_the_link_stops_carrying(clients, make_link):
    receiver = KVReceiver(lambda t: asyncio.sleep(0, ""), stall_s=10)
    link, push, total = await _slow_transfer(make_link, clients[1], "r-abort", receiver)
    try:
        while link.forwarded_bytes("r-abort") < 200_000:
            await asyncio.sleep(0.02)
        push.cancel()  # prefill's abort
        await asyncio.sleep(0.3)
        assert await _stops_carrying(link, "r-abort") < total / 2
    finally:
        await receiver.stop()
