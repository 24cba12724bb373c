"""Shaping on real sockets: the bandwidth cap of each direction, shared by its connections and
fair to a small message; the one-way delay; jitter that never reorders. Timing asserts are
lower bounds (a cap or a delay cannot be beaten) and ratios, so a loaded machine only slows
things down in ways the asserts allow."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.wanlink.line import CHUNK, Line
from services.wanlink.shaper import MBPS
from shared.config import WanConfig
from shared.messages import WanControl
from tests.wanlink.conftest import Sink, dial, now, read_n


def transfer_s(nbytes: int, mbps: float) -> float:
    """The least time `nbytes` can take through an idle line (its first chunk is idle credit)."""
    return (nbytes - CHUNK) / (mbps * MBPS)


async def timed_sends(trio, sends: list[tuple[str, bytes]]) -> list[float]:
    """Send each payload from its forward's dialer, all from one start once every connection is
    up (a connection accepted late would otherwise run alone for a while); seconds until each
    upstream had all of its payload, intact."""
    writers = [(await dial(trio.link, forward))[1] for forward, _ in sends]
    arrivals = [await trio.sinks[forward].arrival() for forward, _ in sends]
    start = now()
    for writer, (_, payload) in zip(writers, sends):
        writer.write(payload)
    ends = await asyncio.gather(*(a.wait(len(p)) for a, (_, p) in zip(arrivals, sends)))
    for writer, arrival, (_, payload) in zip(writers, arrivals, sends):
        assert arrival.data == payload
        writer.close()
    return [end - start for end in ends]


@pytest.mark.parametrize("how", ["reverse", "control"])
async def test_each_direction_has_its_own_cap(trio, how):
    fast, slow = 32.0, 4.0
    if how == "reverse":  # B -> A configured slower
        t = await trio(echo=False, bandwidth_mbps=fast, reverse={"bandwidth_mbps": slow})
    else:  # both start fast; b-a is slowed at run time, a-b keeps its rate
        t = await trio(echo=False, bandwidth_mbps=fast)
        state = t.link.control(WanControl(direction="b-a", bandwidth_mbps=slow))
        assert not state.error
    state = t.link.control(WanControl())
    assert (state.lines["a-b"].bandwidth_mbps, state.lines["b-a"].bandwidth_mbps) == (fast, slow)
    n = 512 * 1024
    ab, ba = await timed_sends(t, [("ab", os.urandom(n)), ("ba", os.urandom(n))])
    assert ab >= 0.9 * transfer_s(n, fast)
    assert ba >= 0.9 * transfer_s(n, slow)
    assert ba > 2 * ab  # 8x slower by the caps (a loaded host stretches the fast one): a-b is not held to b-a's rate


async def test_two_connections_in_one_direction_share_the_cap(trio):
    mbps, n = 16.0, 512 * 1024
    t = await trio(echo=False, bandwidth_mbps=mbps)
    one, two = await timed_sends(t, [("ab", os.urandom(n)), ("ab2", os.urandom(n))])
    # together they take the time of 2n at the cap; each alone at the cap would take half that
    assert min(one, two) >= 0.9 * 0.9 * transfer_s(2 * n, mbps)
    assert max(one, two) >= 0.9 * transfer_s(2 * n, mbps)
    # and they take turns chunk by chunk rather than one after the other
    assert min(one, two) > 0.75 * max(one, two)
    assert t.link.control(WanControl()).lines["a-b"].bytes == 2 * n


async def test_a_small_message_waits_about_one_chunk_behind_bulk(trio):
    t = await trio(echo=False, bandwidth_mbps=16.0)
    _, bulk_w = await dial(t.link, "ab")
    _, small_w = await dial(t.link, "ab2")
    bulk, small = await t.sinks["ab"].arrival(), await t.sinks["ab2"].arrival()
    n = 2 * 1024 * 1024
    start = now()
    bulk_w.write(os.urandom(n))  # all of it queued in the sender's socket at once
    await bulk.wait(n // 8)
    sent = now()
    small_w.write(b"ping")
    await small.wait(4)
    end = await bulk.wait(n)
    bulk_w.close()
    small_w.close()
    bulk_s, small_s = end - start, small.last_at - sent
    assert bulk_s >= 0.9 * transfer_s(n, 16.0)
    assert small.last_at < end  # it went through while the bulk transfer was still going
    # one chunk at the cap is ~1/32 of the bulk transfer; behind all the bulk data it would be ~7/8
    assert small_s < bulk_s / 6, (small_s, bulk_s)


async def test_delay_one_way_and_round_trip(make_link):
    sink = await Sink(echo=True).start()
    link = await make_link({"ab": ("A", sink.port)}, delay_ms=100.0, reverse={"delay_ms": 50.0})
    reader, writer = await dial(link, "ab")
    arrival = await sink.arrival()
    for ab_ms, ba_ms in [(100.0, 50.0), (200.0, 50.0)]:
        start = now()
        writer.write(b"x")
        await read_n(reader, 1)
        rtt = now() - start
        assert arrival.last_at - start >= 0.9 * ab_ms / 1e3  # A -> B alone
        assert rtt >= 0.9 * (ab_ms + ba_ms) / 1e3  # and back
        assert rtt < (ab_ms + ba_ms) / 1e3 + 2.0
        link.control(WanControl(direction="a-b", delay_ms=200.0))  # a-b only: the next round trip is longer
    writer.close()
    sink.close()


async def test_a_new_connection_opens_a_round_trip_later(make_link):
    """TCP's handshake: the dialer is accepted at once, so what it sends first (a TLS ClientHello)
    waits the round trip a real WAN's SYN and SYN-ACK take, then crosses one way."""
    sink = await Sink().start()
    link = await make_link({"ab": ("A", sink.port)}, delay_ms=100.0, reverse={"delay_ms": 50.0})
    start = now()
    _, writer = await dial(link, "ab")
    writer.write(b"hello")
    arrival = await sink.arrival()
    assert await arrival.wait(5) - start >= 0.9 * (0.150 + 0.100)
    writer.close()
    sink.close()


async def test_jitter_varies_the_delay_and_never_reorders(make_link):
    sink = await Sink(echo=True).start()
    link = await make_link({"ab": ("A", sink.port)}, delay_ms=30.0, jitter_ms=25.0)
    reader, writer = await dial(link, "ab")
    arrival = await sink.arrival()
    rtts = []
    for i in range(10):
        start = now()
        writer.write(b"%d" % (i % 10))
        await read_n(reader, 1)
        rtts.append(now() - start)
    assert min(rtts) >= 0.9 * 2 * 5e-3  # never less than delay - jitter each way
    assert max(rtts) - min(rtts) > 0.015, rtts  # +-25 ms each way: round trips spread
    stream = b"".join(b"%05d," % i for i in range(300))
    for i in range(0, len(stream), 6):  # small writes a little apart: each its own chunk on the line
        writer.write(stream[i : i + 6])
        await asyncio.sleep(0.001)
    echoed = await read_n(reader, len(stream))
    assert arrival.data[10:] == stream and echoed == stream
    writer.close()
    sink.close()


def test_reverse_overrides_b_to_a_and_names_a_misspelt_setting():
    lines = Line.pair(WanConfig(delay_ms=10.0, reverse={"delay_ms": 3.0, "seed": 9}), 0.0)
    assert (lines["a-b"].delay_ms, lines["b-a"].delay_ms) == (10.0, 3.0)
    with pytest.raises(ValueError, match="bandwith_mbps"):  # a config error, not a TypeError
        Line.pair(WanConfig(reverse={"bandwith_mbps": 5.0}), 0.0)
