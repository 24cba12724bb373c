"""The link against real sockets: bandwidth cap, delay, sharing, stall, drop, ROUTE, accounting."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from shared.kv_transport import Frame, packed
from tests.wanlink.conftest import Upstream, open_via


def now() -> float:
    return asyncio.get_running_loop().time()


async def send_all(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(payload)
    await writer.drain()
    writer.write_eof()


async def test_bandwidth_cap(make_link, upstream):
    link = await make_link(bandwidth_mbps=40)  # 5 MB/s
    payload = os.urandom(2_000_000)
    t0 = now()
    _, writer = await open_via(link, upstream, "r-cap")
    await send_all(writer, payload)
    await upstream.wait_received(len(payload), timeout=5)
    elapsed = now() - t0
    assert 0.25 < elapsed < 1.5, elapsed  # ~0.4 s
    assert bytes(upstream.arrivals[0].data) == payload
    writer.close()


async def test_delay_both_ways(make_link):
    echo = Upstream(echo=True)
    await echo.start()
    link = await make_link(bandwidth_mbps=1000, delay_ms=100)
    reader, writer = await open_via(link, echo, "r-delay")
    t0 = now()
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 3) == b"ping"
    rtt = now() - t0
    assert echo.arrivals[0].first_at - t0 >= 0.09  # one way A -> B
    assert 0.19 <= rtt < 1.0, rtt  # and back B -> A
    assert link.forwarded_bytes("r-delay") == 4  # the echo back is not counted
    writer.close()
    await echo.stop()


async def test_two_connections_share_the_cap(make_link, upstream):
    link = await make_link(bandwidth_mbps=40)
    payloads = [os.urandom(1_000_000), os.urandom(1_000_000)]
    t0 = now()
    writers = [(await open_via(link, upstream, f"r-share-{i}"))[1] for i in range(2)]
    await asyncio.gather(*(send_all(w, p) for w, p in zip(writers, payloads)))
    await upstream.wait_received(2_000_000, timeout=5)
    total = now() - t0
    assert 0.3 < total < 1.5, total  # 2 MB at 5 MB/s ~ 0.4 s: one cap for both, not one each
    assert sorted(bytes(a.data) for a in upstream.arrivals) == sorted(payloads)
    assert link.forwarded_bytes("r-share-0") == link.forwarded_bytes("r-share-1") == 1_000_000
    for w in writers:
        w.close()


async def test_two_connections_take_turns(make_link):
    up = Upstream()
    await up.start()
    link = await make_link(bandwidth_mbps=40)
    writers = [(await open_via(link, up, f"r-turn-{i}"))[1] for i in range(2)]
    await asyncio.gather(*(send_all(w, os.urandom(1_000_000)) for w in writers))
    await up.wait_received(1, timeout=3)
    await asyncio.sleep(0.05)
    assert len(up.arrivals) == 2
    done_at = {}

    async def watch(i: int) -> None:
        await up.arrivals[i].eof.wait()
        done_at[i] = now()

    t0 = now()
    await asyncio.wait_for(asyncio.gather(watch(0), watch(1)), 5)
    first, last = sorted(t - t0 for t in done_at.values())
    assert first > 0.7 * last, (first, last)  # interleaved, not one after the other
    for w in writers:
        w.close()
    await up.stop()


async def test_stall_holds_then_resumes_intact(make_link, upstream):
    link = await make_link(bandwidth_mbps=1000)
    part1, part2 = os.urandom(100_000), os.urandom(8_000_000)  # more than the kernel buffers hold
    _, writer = await open_via(link, upstream, "r-stall")
    writer.write(part1)
    await upstream.wait_received(len(part1), timeout=3)
    link.stall(0.6)
    t0 = now()
    writer.write(part2)
    await asyncio.sleep(0.3)
    assert upstream.received == len(part1)  # nothing forwarded during the stall
    assert writer.transport.get_write_buffer_size() > 0  # and the sender feels it: backpressure
    await upstream.wait_received(len(part1) + len(part2), timeout=5)
    assert now() - t0 >= 0.55
    assert bytes(upstream.arrivals[0].data) == part1 + part2
    assert link.forwarded_bytes("r-stall") == len(part1) + len(part2)
    writer.close()


async def test_drop_cuts_every_connection(make_link, upstream):
    link = await make_link(bandwidth_mbps=8)  # 2 MB would take 2 s
    clients = [await open_via(link, upstream, f"r-drop-{i}") for i in range(2)]
    for _, writer in clients:
        writer.write(os.urandom(2_000_000))
    await upstream.wait_received(1, timeout=3)
    assert link.connections == 2
    assert link.drop() == 2
    for reader, _ in clients:
        try:
            assert await asyncio.wait_for(reader.read(), 2) == b""
        except ConnectionResetError:
            pass
    await asyncio.wait_for(asyncio.gather(*(a.eof.wait() for a in upstream.arrivals)), 2)
    assert upstream.received < 4_000_000
    await asyncio.sleep(0.05)
    assert link.connections == 0


async def test_route_not_forwarded_and_counts_exact(make_link, upstream):
    link = await make_link(bandwidth_mbps=400, delay_ms=5, jitter_ms=5)
    rng = random.Random(0)
    payloads = {f"r-count-{i}": os.urandom(n) for i, n in enumerate((1, 70_000, 333_333))}
    writers = []

    async def send_in_pieces(request_id: str, payload: bytes) -> None:
        _, writer = await open_via(link, upstream, request_id)
        pos = 0
        while pos < len(payload):  # many small writes with pauses: jitter must not reorder them
            step = rng.randint(1, 20_000)
            writer.write(payload[pos : pos + step])
            pos += step
            await asyncio.sleep(rng.uniform(0, 0.003))
        writer.write_eof()
        writers.append(writer)

    await asyncio.gather(*(send_in_pieces(rid, p) for rid, p in payloads.items()))
    await upstream.wait_received(sum(map(len, payloads.values())), timeout=5)
    await asyncio.wait_for(asyncio.gather(*(a.eof.wait() for a in upstream.arrivals)), 5)
    assert sorted(bytes(a.data) for a in upstream.arrivals) == sorted(payloads.values())  # no ROUTE, no reorder
    for rid, payload in payloads.items():
        assert link.forwarded_bytes(rid) == len(payload)
    assert link.total_bytes == upstream.received
    for w in writers:
        w.close()


@pytest.mark.parametrize("first_frame", ["header", "garbage", "closed-port"])
async def test_bad_route_is_refused(make_link, upstream, first_frame):
    link = await make_link()
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    if first_frame == "header":
        writer.write(packed(Frame.HEADER, {"request_id": "x"}))
    elif first_frame == "garbage":
        writer.write(b"\x00\x00\x00\x03\x01\xc1\xc1")  # a ROUTE frame whose body is not msgpack
    else:
        await upstream.stop()
        writer.write(packed(Frame.ROUTE, {"host": "127.0.0.1", "port": upstream.port, "request_id": "x"}))
    try:
        assert await asyncio.wait_for(reader.read(), 3) == b""
    except ConnectionResetError:
        pass
    assert link.connections == 0 and upstream.arrivals == []
