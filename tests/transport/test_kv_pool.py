"""Standing KV connections (`KVConnections`) on real loopback sockets under mutual TLS, and through
the emulated line: pushes to one decoder reuse one connection (one TCP + TLS handshake in all) and
each lands whole; a connection the receiver closed, reset or that the line cut between pushes is
found dead and the push goes whole on one fresh dial, landing exactly once; concurrent pushes go
on separate connections and never share a stream; the pool is bounded, expires idle connections
and closes them all on `close`, each end quiet on the receiver (no refusal); the receiver reads
transfer after transfer on a connection and vets each one."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdd.certs import make_secrets
from services.wanlink import Forward, WanLink
from shared.config import WanConfig, config_from_dict
from shared.kv_send import EarlyConnection, Endpoint, KVConnections, alive, send_kv
from shared.kv_transport import KVTransferError, TransferAck, reset
from shared.messages import WanControl
from shared.security import Secrets
from tests.helpers import until
from tests.transport.test_kv_receiver import KV, Peer, Rig, layers, layers_of, push, transfer_bytes

STALL_S = 5.0


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Secrets:
    cfg = config_from_dict(
        {"instances": [{"id": "prefill-0", "role": "prefill", "dc": "A"}, {"id": "md-0", "role": "md", "dc": "B"}]}
    )
    return Secrets(make_secrets(cfg, tmp_path_factory.mktemp("kv") / "secrets"))


class Side:
    """md-0's receiver (mutual TLS, expecting req-1 .. req-9 with their secret), counting the
    connections it accepts, and prefill-0's pool of connections to it."""

    def __init__(self, secrets: Secrets, **rx) -> None:
        self.rig = Rig(STALL_S, tls=secrets.kv_server_context("md-0"), **rx)
        self.rx = self.rig.rx
        self.accepted = 0
        serve = self.rx._serve

        async def counted(reader, writer) -> None:
            self.accepted += 1
            await serve(reader, writer)

        self.rx._serve = counted
        self.tls = secrets.kv_client_context("prefill-0")
        self.pool: KVConnections | None = None
        self.ep: Endpoint | None = None

    async def start(self, **pool) -> Side:
        await self.rx.start()
        self.ep = Endpoint("127.0.0.1", self.rx.port, "md-0")
        self.pool = KVConnections(STALL_S, self.tls, **pool)
        return self

    def count(self, how: str) -> int:
        return self.pool.counts[("md-0", how)]

    @property
    def open(self) -> int:
        return sum(self.rx._per_peer.values())

    @property
    def idle(self) -> int:
        return sum(len(v) for v in self.rx._idle.values())

    def handled(self) -> list[tuple[str, list[bytes]]]:
        return [(t.request_id, layers_of(t)) for t in self.rig.handled]


@pytest.fixture
async def side(secrets):
    made: list[Side] = []

    async def make(rx: dict | None = None, **pool) -> Side:
        s = await Side(secrets, **(rx or {})).start(**pool)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.pool.close()
        await until(lambda s=s: not s.rx._per_peer and not s.rx._receiving, what="every connection to end")
        await s.rx.stop()


def distinct(rid: str, n: int = KV.num_layers) -> list[bytes]:
    """Layers no other request's push carries: a byte of another's in them would show."""
    return [(rid.encode() + bytes([i]) * len(layers()[0]))[: len(layers()[0])] for i in range(n)]


async def test_pushes_to_one_decoder_reuse_one_connection(side, refusals):
    s = await side()
    for rid in ("req-1", "req-2", "req-3"):
        await s.pool.send(s.ep, push(rid, data=distinct(rid)))
    assert s.handled() == [(rid, distinct(rid)) for rid in ("req-1", "req-2", "req-3")]
    assert (s.count("dialed"), s.count("reused"), s.count("stale")) == (1, 2, 0)
    assert s.accepted == 1 and s.rx.transfers == 3  # one handshake; three transfers on it
    assert s.pool.idle(s.ep) == 1 and s.idle == 1  # it stands, both ends, for the next push
    assert s.rx.refused == 0 and refusals() == []


async def test_without_a_pool_each_push_dials_its_own(side):
    """The old way, still `send_kv`: a connection per push, closed after its ACK (quietly)."""
    s = await side()
    for rid in ("req-1", "req-2"):
        await send_kv("127.0.0.1", s.rx.port, push(rid), STALL_S, tls=s.tls, server_name="md-0")
    assert s.accepted == 2 and len(s.rig.handled) == 2
    await until(lambda: not s.open, what="both connections to end")
    assert s.rx.refused == 0


async def test_a_connection_the_receiver_closed_between_pushes_is_found_and_dialed_again(side, refusals):
    s = await side(rx={"idle_s": 0.2})  # the receiver waits 0.2 s for a next transfer, not 120
    await s.pool.send(s.ep, push("req-1"))
    [entry] = s.pool._idle[s.ep]
    await until(lambda: not alive(entry.conn), what="the sender to see its standing connection closed")
    await s.pool.send(s.ep, push("req-2", data=distinct("req-2")))
    assert s.handled() == [("req-1", layers()), ("req-2", distinct("req-2"))]
    assert (s.count("dialed"), s.count("reused"), s.count("stale")) == (2, 0, 1) and s.accepted == 2
    assert s.rx.refused == 0 and refusals() == []  # the idle close is no refusal


async def test_a_push_on_a_connection_that_died_unseen_goes_whole_on_one_fresh_dial(side, refusals):
    """The receiver resets the standing connection and the push starts before the sender saw it
    (no turn of the loop between): it fails on the dead connection, which the push does not take
    for delivered, and goes whole on a fresh dial; the receiver handles it exactly once."""
    s = await side()
    await s.pool.send(s.ep, push("req-1"))
    await until(lambda: s.idle == 1, what="the receiver to wait for a next transfer")
    [writer] = next(iter(s.rx._idle.values()))
    reset(writer)  # and at once, before the sender's loop could notice:
    assert alive(s.pool._idle[s.ep][0].conn)
    await s.pool.send(s.ep, push("req-2", data=distinct("req-2")))
    assert s.handled() == [("req-1", layers()), ("req-2", distinct("req-2"))]
    assert (s.count("dialed"), s.count("reused"), s.count("stale")) == (2, 1, 1) and s.accepted == 2
    assert s.rx.refused == 0


async def test_a_stall_or_a_refusal_on_a_standing_connection_is_no_redial(side, refusals):
    """Only a connection that is gone earns the fresh dial: the receiver's refusal (an ACK saying
    no) is the push's failure, and the connection, at a transfer's boundary, stands on."""
    s = await side()
    await s.pool.send(s.ep, push("req-1"))
    s.rig.answer = "no free KV blocks"
    with pytest.raises(KVTransferError, match="receiver refused the KV: no free KV blocks"):
        await s.pool.send(s.ep, push("req-2"))
    s.rig.answer = ""
    await s.pool.send(s.ep, push("req-3"))
    assert (s.count("dialed"), s.count("reused"), s.count("stale")) == (1, 2, 0) and s.accepted == 1
    assert [rid for rid, _ in s.handled()] == ["req-1", "req-2", "req-3"] and refusals() == []


async def test_each_transfer_on_a_standing_connection_is_vetted(side, refusals):
    """The second transfer on a connection carries a guessed secret: refused like a first one
    (the connection is cut), and the next push dials again and lands."""
    s = await side()
    await s.pool.send(s.ep, push("req-1"))
    with pytest.raises(KVTransferError):
        await s.pool.send(s.ep, push("req-2", "guessed"))
    # refused twice: on the standing connection (cut: the pool cannot tell that from a dead one, so
    # it dials once more), then on the fresh one, which is the push's failure
    assert refusals() == ["KV transfer of req-2 from 127.0.0.1 refused: wrong transfer secret for req-2"] * 2
    await s.pool.send(s.ep, push("req-3"))
    assert [rid for rid, _ in s.handled()] == ["req-1", "req-3"] and s.rig.vetted.count("req-2") == 2
    assert (s.count("dialed"), s.count("reused"), s.count("stale")) == (3, 1, 1)


async def test_a_raw_peer_sends_two_transfers_on_one_connection(rig, refusals):
    r = await rig(stall_s=STALL_S)
    peer = await Peer.dial(r.rx.port)
    for rid in ("req-1", "req-2"):
        await peer.send(transfer_bytes(rid))
        assert await peer.ack() == TransferAck()
    assert [t.request_id for t in r.handled] == ["req-1", "req-2"] and r.rx.refused == 0
    peer.writer.close()  # cleanly, between transfers: not a refusal
    await until(lambda: not r.rx._per_peer, what="the receiver to let the connection go")
    assert r.rx.refused == 0 and refusals() == []


async def test_concurrent_pushes_go_on_separate_connections_and_never_interleave(side, refusals):
    s = await side()
    big = dataclasses.replace(KV, end=512)  # 128 KiB layers: each push is many TCP segments
    size = big.layer_bytes
    data = {f"req-{i}": [bytes([i * 16 + j]) * size for j in range(big.num_layers)] for i in range(1, 5)}
    await asyncio.gather(*(s.pool.send(s.ep, push(rid, kv=big, data=d)) for rid, d in data.items()))
    assert sorted(s.handled()) == sorted(data.items())  # each whole, none with another's bytes
    assert s.count("dialed") == 4 and s.accepted == 4 and s.pool.idle(s.ep) == 4
    # again at once: the four standing connections carry them, one push each
    again = {f"req-{i}": [bytes([i * 16 + j + 8]) * size for j in range(big.num_layers)] for i in range(5, 9)}
    await asyncio.gather(*(s.pool.send(s.ep, push(rid, kv=big, data=d)) for rid, d in again.items()))
    assert sorted(s.handled()[4:]) == sorted(again.items())
    assert (s.count("dialed"), s.count("reused")) == (4, 4) and s.accepted == 4 and s.rx.transfers == 8
    assert s.rx.refused == 0 and refusals() == []


async def test_the_pool_keeps_a_few_idle_expires_them_and_closes_them_all(side, refusals):
    s = await side(max_idle=2, idle_s=0.5)
    await asyncio.gather(*(s.pool.send(s.ep, push(f"req-{i}")) for i in range(1, 5)))
    assert s.count("dialed") == 4 and s.pool.idle(s.ep) == 2  # two closed at once: past max_idle
    await until(lambda: s.open == 2, what="the receiver to see the two extra ones closed")
    await until(lambda: not s.pool.idle(), what="the idle ones to expire")
    await until(lambda: not s.open, what="the receiver to see them closed")
    await s.pool.send(s.ep, push("req-5"))
    assert s.count("dialed") == 5 and s.open == 1
    await s.pool.close()
    await until(lambda: not s.open, what="close to end the standing one")
    assert s.rx.refused == 0 and refusals() == []


async def test_a_receiver_at_its_cap_makes_room_by_closing_an_idle_connection(side, refusals):
    s = await side(rx={"max_per_peer": 2})
    await asyncio.gather(s.pool.send(s.ep, push("req-1")), s.pool.send(s.ep, push("req-2")))
    await until(lambda: s.idle == 2, what="both to stand idle on the receiver")
    other = KVConnections(STALL_S, s.tls)  # another sender from the same address: a third connection
    await other.send(s.ep, push("req-3"))
    assert s.rx.refused == 0 and refusals() == []
    await until(lambda: sum(not alive(e.conn) for e in s.pool._idle[s.ep]) == 1, what="one idle closed")
    await s.pool.send(s.ep, push("req-4"))  # the live one: no dial
    assert (s.count("dialed"), s.count("reused")) == (2, 1) and len(s.rig.handled) == 4
    await other.close()


async def test_an_early_connection_takes_an_idle_one_and_gives_it_back_unused(side):
    s = await side()
    await s.pool.send(s.ep, push("req-1"))
    early = EarlyConnection(s.ep.host, s.ep.port, STALL_S, s.tls, "md-0", pool=s.pool)
    assert early.reused and s.pool.idle() == 0 and s.count("reused") == 1
    conn = await early.take()
    await s.pool.send(s.ep, push("req-2"), conn, reused=early.reused)
    assert (s.count("dialed"), s.count("reused")) == (1, 1) and s.accepted == 1 and s.pool.idle() == 1
    unused = EarlyConnection(s.ep.host, s.ep.port, STALL_S, s.tls, "md-0", pool=s.pool)
    assert unused.reused and s.pool.idle() == 0
    unused.close()  # the request ended without a push: back to the pool, not closed
    await until(lambda: unused.settled, what="the early connection to settle")
    assert unused.outcome == "unused" and s.pool.idle() == 1 and s.open == 1


async def test_a_burst_past_the_receivers_cap_waits_for_connections_and_lands_whole(side, refusals):
    """Nine pushes at once to a decoder that takes 4 connections from this address: without the
    pool's bound the 5th..9th are refused (then retried into the same cap, and failed); with it at
    most 3 are in use at once, the rest wait their turn, and all nine land, none refused."""
    s = await side(rx={"max_per_peer": 4}, max_busy=3, max_idle=1)
    most = 0
    serve = s.rx._serve

    async def watched(reader, writer) -> None:
        nonlocal most
        most = max(most, s.open)
        await serve(reader, writer)

    s.rx._serve = watched
    rids = [f"req-{i}" for i in range(1, 10)]
    await asyncio.gather(*(s.pool.send(s.ep, push(rid, data=distinct(rid))) for rid in rids))
    assert sorted(s.handled()) == sorted((rid, distinct(rid)) for rid in rids)
    assert s.rx.refused == 0 and refusals() == [] and most <= 4
    assert s.pool.busy(s.ep) == 0  # every one let go


async def test_an_early_connection_is_not_readied_when_every_one_is_in_use(side):
    """At the bound an early connection dials nothing (`busy`): its push waits for a free one."""
    s = await side(max_busy=1)
    assert s.pool.try_hold(s.ep)  # a push holds the only one
    early = EarlyConnection(s.ep.host, s.ep.port, STALL_S, s.tls, "md-0", pool=s.pool)
    assert await early.take() is None and early.outcome == "busy" and s.accepted == 0
    waiting = asyncio.ensure_future(s.pool.send(s.ep, push("req-1")))
    await asyncio.sleep(0)
    assert not waiting.done() and s.pool.busy(s.ep) == 1
    s.pool.let_go(s.ep)  # the first push ended: the waiting one goes
    await waiting
    assert s.handled()[0][0] == "req-1" and s.pool.busy(s.ep) == 0
    unused = EarlyConnection(s.ep.host, s.ep.port, STALL_S, s.tls, "md-0", pool=s.pool)
    assert s.pool.busy(s.ep) == 1  # it holds one for its push ...
    unused.close()
    await until(lambda: unused.settled, what="the early connection to settle")
    assert s.pool.busy(s.ep) == 0  # ... and lets it go unused


async def test_an_early_connection_closed_while_its_dial_swallows_the_cancel_is_still_let_go(side):
    """Python 3.11's wait_for returns a dial that completes as it is cancelled, and the cancel is
    lost: a connection closed meanwhile must still be let go at once, not held until its deadline."""
    s = await side()
    dial = s.pool.dial

    async def swallowing(ep):
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # as wait_for does when the connection is made with the cancel
        return await dial(ep)

    s.pool.dial = swallowing
    # held for 30 s if the close were lost: let go within 10 s (a mutual-TLS dial on a loaded host) is "at once"
    early = EarlyConnection(s.ep.host, s.ep.port, 60.0, s.tls, "md-0", pool=s.pool)
    await asyncio.sleep(0)  # its dial under way
    early.close()
    await until(lambda: early.settled and s.pool.busy(s.ep) == 0, timeout=10.0, what="the connection let go")
    assert early.outcome == "unused"
    await until(lambda: not s.rx._per_peer, what="md-0 to see the connection closed")


# --- through the emulated line -------------------------------------------------------------------


async def _line(rx_port: int, delay_ms: float) -> WanLink:
    link = WanLink(WanConfig(delay_ms=delay_ms, jitter_ms=0.0), [Forward("md-0", "A", ("127.0.0.1", rx_port))])
    await link.start()
    return link


async def test_across_the_line_a_reused_push_pays_no_handshake(side, refusals):
    """20 ms each way: a dialed push pays TCP's round trip and TLS's before its first byte, a
    reused one pays none; the line accepted one connection for three pushes."""
    s = await side()
    link = await _line(s.rx.port, delay_ms=20.0)
    try:
        ep = Endpoint("127.0.0.1", link.ports["md-0"], "md-0")
        took = []
        for rid in ("req-1", "req-2", "req-3"):
            t0 = time.perf_counter()
            await s.pool.send(ep, push(rid))
            took.append((time.perf_counter() - t0) * 1000)
        assert link.control(WanControl()).accepted == {"md-0": 1}
        assert (s.count("dialed"), s.count("reused")) == (1, 2)
        print(f"\npush over a 20 ms line: dialed {took[0]:.0f} ms, reused {took[1]:.0f} and {took[2]:.0f} ms")
        # the line's delay was in force: the dialed push paid TCP's, TLS's and its own round trips
        # (3 x 40 ms, on any machine), each reused one its own (40 ms); how much sooner the reused
        # ones came is printed, not asserted (a loaded host took 92 ms for one in a full run)
        assert took[0] > 115 and min(took[1:]) > 35, took
    finally:
        await link.stop()


async def test_a_connection_the_line_dropped_is_dialed_again(side, refusals):
    s = await side()
    link = await _line(s.rx.port, delay_ms=5.0)
    try:
        ep = Endpoint("127.0.0.1", link.ports["md-0"], "md-0")
        await s.pool.send(ep, push("req-1"))
        assert link.control(WanControl(drop=True)).accepted == {"md-0": 1}  # the line's `drop`: both ends reset
        await s.pool.send(ep, push("req-2", data=distinct("req-2")))
        assert s.handled() == [("req-1", layers()), ("req-2", distinct("req-2"))]
        assert link.control(WanControl()).accepted == {"md-0": 2}
        assert (s.count("dialed"), s.count("stale")) == (2, 1)
        assert s.rx.refused == 0 and refusals() == []
    finally:
        await s.pool.close()
        await link.stop()
