"""The KV plane's receiver on real loopback sockets, without a cluster: what it refuses (a header
length past MAX_HEADER, a header the vet refuses, a layer frame of the wrong size, truncated frames,
one connection too many from a peer, a peer that stops), that each refusal is logged once with the
peer's address and reaches no handler, and that a slow sender that keeps making progress is no stall.
Malformed frames are written by hand on a raw connection, as tests/cluster/test_fuzz.py does."""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct

import msgpack
import pytest

from pdd.certs import make_secrets
from shared.config import config_from_dict
from shared.kv_transport import (
    CONTROL_BODY_S,
    MAX_CONTROL,
    MAX_HEADER,
    Frame,
    KVPush,
    KVReceiver,
    KVTransferError,
    Transfer,
    Verdict,
    frame,
    packed,
    read_frame,
    send_kv,
)
from shared.runtime.kv_wire import layer_bytes
from shared.security import Secrets
from tests.helpers import until

KV = {"start": 0, "end": 8, "kv_heads": 2, "head_dim": 16, "dtype": "float32", "num_layers": 3}
LAYER = layer_bytes(8, 2, 16, "float32", "native")  # 2048: K and V of 8 tokens
TOKEN = "minted-for-req-1"
DONE = {"first_token": 7, "stats": {"n": 1}}


class Rig:
    """A receiver that expects the transfers `expect` names, each with its token (as a decoder
    expects those the scheduler dispatched), and records what its vet and handler saw."""

    def __init__(self, stall_s: float, **kw) -> None:
        self.expect = {f"req-{i}": TOKEN for i in range(1, 10)}
        self.have: set[str] = set()  # already committed: HAVE_IT
        self.vetted: list[str] = []
        self.handled: list[Transfer] = []
        self.rx = KVReceiver(self.handler, stall_s, vet=self.vet, **kw)

    def vet(self, t: Transfer) -> tuple[Verdict, str]:
        self.vetted.append(t.request_id)
        if t.request_id not in self.expect:
            return Verdict.REFUSE, f"no decode task for {t.request_id!r} here"
        if not hmac.compare_digest(t.token, self.expect[t.request_id]):
            return Verdict.REFUSE, f"wrong transfer token for {t.request_id}"
        return (Verdict.HAVE_IT, "") if t.request_id in self.have else (Verdict.RECEIVE, "")

    async def handler(self, t: Transfer) -> str:
        self.handled.append(t)
        return ""


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


@pytest.fixture
def refusals(caplog):
    """The receiver's refusal log lines so far."""
    caplog.set_level(logging.WARNING, logger="shared.kv_transport")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "shared.kv_transport"]


def header(request_id: str = "req-1", token: str = TOKEN, **kv) -> bytes:
    return packed(
        Frame.HEADER, {"request_id": request_id, "sender": "prefill-0", "token": token, "wan": True, "kv": {**KV, **kv}}
    )


def layers(n: int = KV["num_layers"], size: int = LAYER) -> list[bytes]:
    return [bytes([i + 1]) * size for i in range(n)]


def transfer_bytes(request_id: str = "req-1") -> bytes:
    return header(request_id) + b"".join(frame(Frame.LAYER, d) for d in layers()) + packed(Frame.DONE, DONE)


def push(request_id: str = "req-1", token: str = TOKEN, kv: dict | None = None, data: list[bytes] | None = None):
    return KVPush(request_id, "prefill-0", token, kv or KV, layers() if data is None else data, DONE, wan=True)


class Peer:
    """A raw connection to the receiver, from `host` (any of 127/8 is this machine)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def dial(cls, port: int, host: str = "127.0.0.1") -> Peer:
        return cls(*await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0)))

    async def send(self, data: bytes) -> float:
        """Writes `data`; returns when it was written."""
        self.writer.write(data)
        await self.writer.drain()
        return asyncio.get_running_loop().time()

    async def ack(self, timeout: float = 5.0) -> dict:
        return msgpack.unpackb(await read_frame(self.reader, timeout, Frame.ACK, MAX_CONTROL))

    async def cut(self, timeout: float = 5.0) -> float:
        """Until the receiver closes the connection without an answer: returns when it did."""
        try:
            data = await asyncio.wait_for(self.reader.read(), timeout)
        except ConnectionResetError:
            data = b""
        assert data == b"", f"the receiver answered {data!r}"
        return asyncio.get_running_loop().time()

    def close(self) -> None:
        self.writer.transport.abort()


# --- what is refused, and how ----------------------------------------------------------------


async def test_a_valid_transfer_arrives_whole_and_is_acked(rig, refusals):
    r = await rig()
    sent = await send_kv("127.0.0.1", r.rx.port, push(), stall_s=5.0)
    [t] = r.handled
    assert (t.request_id, t.sender, t.token, t.via_wan, t.kv) == ("req-1", "prefill-0", TOKEN, True, KV)
    assert t.layers == layers() and t.done == DONE and t.wire_bytes == sent
    assert r.vetted == ["req-1"] and r.rx.refused == 0 and refusals() == []


@pytest.mark.parametrize("size", [MAX_HEADER + 1, 2**31])
async def test_a_header_length_past_max_header_is_refused_before_its_body_is_read(rig, refusals, size):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(struct.pack(">IB", size + 1, Frame.HEADER))  # the prefix, and no body at all
    assert await peer.cut() - sent < 2.0  # at once, not after waiting for a body (or a stall)
    assert refusals() == [
        f"KV transfer from 127.0.0.1 refused: HEADER frame of {size} bytes; at most {MAX_HEADER} allowed"
    ]
    assert r.vetted == [] and r.handled == [] and r.rx.refused == 1
    peer.close()


async def test_a_header_of_exactly_max_header_is_read(rig):
    r = await rig()
    head = {"request_id": "req-1", "sender": "prefill-0", "token": TOKEN, "wan": True, "kv": {**KV, "pad": "x" * 300}}
    pad = 300 + MAX_HEADER - len(msgpack.packb(head, use_bin_type=True))
    kv = {**KV, "pad": "x" * pad}
    assert len(msgpack.packb({**head, "kv": kv}, use_bin_type=True)) == MAX_HEADER
    await send_kv("127.0.0.1", r.rx.port, push(kv=kv), stall_s=5.0)
    assert [t.request_id for t in r.handled] == ["req-1"]


@pytest.mark.parametrize(
    ("rid", "token", "why"),
    [
        ("req-1", "guessed", "of req-1 from 127.0.0.1 refused: wrong transfer token for req-1"),
        ("req-1", "", "of req-1 from 127.0.0.1 refused: wrong transfer token for req-1"),
        ("req-99", TOKEN, "of req-99 from 127.0.0.1 refused: no decode task for 'req-99' here"),
    ],
)
async def test_a_header_the_vet_refuses_is_cut_before_any_kv_is_read(rig, refusals, rid, token, why):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(header(rid, token))  # the header alone: the layers would follow
    assert await peer.cut() - sent < 2.0  # refused on the header, not after waiting for layers
    assert refusals() == [f"KV transfer {why}"]
    assert r.vetted == [rid] and r.handled == [] and r.rx.refused == 1
    peer.close()
    with pytest.raises(KVTransferError):  # the sender of a whole push learns it failed
        await send_kv("127.0.0.1", r.rx.port, push(rid, token), stall_s=5.0)
    assert r.handled == [] and r.rx.refused == 2 and len(refusals()) == 2


@pytest.mark.parametrize(
    ("which", "size"), [(0, LAYER - 1), (0, LAYER + 1), (0, 0), (0, 2**31), (2, LAYER - 1), (2, 2 * LAYER)]
)
async def test_a_layer_frame_of_any_other_than_its_planned_size_is_refused_on_its_prefix(rig, refusals, which, size):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    good = b"".join(frame(Frame.LAYER, d) for d in layers(which))
    sent = await peer.send(header() + good + struct.pack(">IB", size + 1, Frame.LAYER))  # and no body
    assert await peer.cut() - sent < 2.0
    assert refusals() == [
        f"KV transfer of req-1 from 127.0.0.1 refused: LAYER frame of {size} bytes; exactly {LAYER} allowed"
    ]
    assert r.handled == [] and r.rx.refused == 1
    peer.close()


async def test_a_push_with_a_short_layer_fails_on_both_sides(rig, refusals):
    r = await rig()
    data = layers()
    data[1] = data[1][:-4]
    with pytest.raises(KVTransferError):
        await send_kv("127.0.0.1", r.rx.port, push(data=data), stall_s=5.0)
    assert r.handled == [] and r.rx.refused == 1 and "LAYER frame of 2044 bytes" in refusals()[0]


LAYERS = b"".join(frame(Frame.LAYER, d) for d in layers())
MALFORMED = {
    "a layer first": (frame(Frame.LAYER, b"\0" * LAYER), "expected a HEADER frame, got type 3"),
    "an unknown frame type": (struct.pack(">IB", 5, 9) + b"\0" * 4, "expected a HEADER frame, got type 9"),
    "a header that is not msgpack": (frame(Frame.HEADER, b"\xc1\xc1"), "HEADER is not msgpack"),
    "a header that is not a map": (packed(Frame.HEADER, [1, 2, 3]), "HEADER is not a map"),
    "a request id that is no string": (
        packed(Frame.HEADER, {"request_id": 5, "kv": KV}),
        "HEADER lacks request_id, sender, token or kv",
    ),
    "a header without kv": (
        packed(Frame.HEADER, {"request_id": "req-1", "token": TOKEN}),
        "HEADER lacks request_id, sender, token or kv",
    ),
    "an unknown dtype": (header(dtype="float99"), "bad KV header"),
    "a negative token range": (header(start=16), "bad KV header"),
    "a token range of 2^40": (header(end=2**40), "bad KV header"),
    "a DONE that is not msgpack": (header() + LAYERS + frame(Frame.DONE, b"\xc1"), "DONE is not msgpack"),
    "a DONE past MAX_CONTROL": (header() + LAYERS + packed(Frame.DONE, {"x": "y" * MAX_CONTROL}), "DONE frame of"),
    "a fourth layer": (header() + LAYERS + frame(Frame.LAYER, layers(1)[0]), "expected a DONE frame, got type 3"),
}


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_frames_are_refused(rig, refusals, case):
    payload, why = MALFORMED[case]
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(payload)
    assert await peer.cut() - sent < 2.0
    [line] = refusals()
    assert "from 127.0.0.1 refused: " in line and why in line
    assert r.handled == [] and r.rx.refused == 1
    peer.close()


async def test_a_header_without_num_layers_is_refused_like_any_bad_header_when_nothing_vets(rig, refusals):
    """A receiver without a vet (benchmarks/handoff_micro.py) still refuses, logs and counts it."""
    r = await rig(stall_s=5.0)
    r.rx.vet = None
    without = packed(
        Frame.HEADER,
        {
            "request_id": "req-1",
            "sender": "prefill-0",
            "token": TOKEN,
            "kv": {k: v for k, v in KV.items() if k != "num_layers"},
        },
    )
    for head in (without, header(num_layers=None), header(num_layers="three")):
        peer = await Peer.dial(r.rx.port)
        sent = await peer.send(head)
        assert await peer.cut() - sent < 2.0
        peer.close()
    assert r.handled == [] and r.rx.refused == 3
    assert all("refused: bad KV header" in line for line in refusals()) and len(refusals()) == 3


WHOLE = transfer_bytes()
CUTS = {  # where the sender's stream ends (it closes its side) before the transfer is whole
    "mid length prefix": 2,
    "mid header": len(header()) - 3,
    "after the header": len(header()),
    "mid layer": len(header()) + 5 + LAYER // 2,
    "before DONE": len(header()) + 3 * (5 + LAYER),
    "mid DONE": len(WHOLE) - 2,
}


@pytest.mark.parametrize("cut", CUTS)
async def test_a_truncated_transfer_is_refused(rig, refusals, cut):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    peer.writer.write(WHOLE[: CUTS[cut]])
    peer.writer.write_eof()
    sent = asyncio.get_running_loop().time()
    assert await peer.cut() - sent < 2.0
    of = "" if cut in ("mid length prefix", "mid header") else "of req-1 "  # the header read, or not yet
    assert refusals() == [f"KV transfer {of}from 127.0.0.1 refused: KV connection closed mid-transfer"]
    assert r.handled == [] and r.rx.refused == 1
    peer.close()


async def test_a_retried_push_of_a_committed_transfer_is_acked_and_not_handled_again(rig, refusals):
    r = await rig()
    r.have.add("req-1")  # the first attempt landed and its ACK was lost: the sender pushes it all again
    big = {**KV, "end": 1024}
    data = layers(size=layer_bytes(1024, 2, 16, "float32", "native"))
    for _ in range(3):
        assert await send_kv("127.0.0.1", r.rx.port, push(kv=big, data=data), stall_s=5.0) > 3 * len(data[0])
    assert r.handled == [] and r.vetted == ["req-1"] * 3 and r.rx.refused == 0 and refusals() == []
    with pytest.raises(KVTransferError):  # what it sends is still checked frame by frame
        await send_kv("127.0.0.1", r.rx.port, push(kv=big, data=[d[:-1] for d in data]), stall_s=5.0)
    assert r.handled == [] and r.rx.refused == 1 and "LAYER frame of" in refusals()[0]


# --- connections per peer ---------------------------------------------------------------------


async def test_one_connection_past_max_per_peer_is_refused_while_the_others_proceed(rig, refusals):
    r = await rig(stall_s=5.0, max_per_peer=2)
    half = header("req-1") + frame(Frame.LAYER, layers(1)[0])[: LAYER // 2]
    first, second = await Peer.dial(r.rx.port), await Peer.dial(r.rx.port)
    await first.send(half)
    await second.send(header("req-2") + half[len(header()) :])
    await until(lambda: r.vetted == ["req-1", "req-2"], what="both transfers to be under way")
    extra = await Peer.dial(r.rx.port)
    sent = await extra.send(transfer_bytes("req-3"))
    assert await extra.cut() - sent < 2.0
    assert refusals() == ["KV transfer from 127.0.0.1 refused: more than 2 connections from 127.0.0.1"]
    other = await Peer.dial(r.rx.port, host="127.0.0.2")  # another peer has its own allowance
    await other.send(transfer_bytes("req-4"))
    assert await other.ack() == {"ok": True, "error": ""}
    rest = transfer_bytes()[len(half) :]
    await first.send(rest)
    await second.send(rest)
    assert await first.ack() == {"ok": True, "error": ""} and await second.ack() == {"ok": True, "error": ""}
    assert sorted(t.request_id for t in r.handled) == ["req-1", "req-2", "req-4"]
    assert all(t.layers == layers() for t in r.handled) and r.rx.refused == 1
    for peer in (first, second, extra, other):
        peer.close()
    await until(lambda: not r.rx._per_peer, what="the connections to be counted out")
    await send_kv("127.0.0.1", r.rx.port, push("req-5"), stall_s=5.0)  # the slots came back
    assert r.handled[-1].request_id == "req-5"


# --- stalls: no progress, not slowness ----------------------------------------------------------

BIG = {"start": 0, "end": 256, "kv_heads": 2, "head_dim": 64, "dtype": "float32", "num_layers": 1}
BIG_LAYER = layer_bytes(256, 2, 64, "float32", "native")  # 256 KiB


async def test_a_slow_sender_that_keeps_making_progress_is_not_a_stall(rig, refusals):
    stall_s, pieces, gap_s = 0.6, 16, 0.05  # each gap a twelfth of stall_s; the whole layer takes longer
    r = await rig(stall_s=stall_s)
    peer = await Peer.dial(r.rx.port)
    layer = bytes(range(256)) * (BIG_LAYER // 256)
    data = frame(Frame.LAYER, layer)
    loop = asyncio.get_running_loop()
    await peer.send(header(**BIG))
    start = loop.time()
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        await peer.send(data[i : i + step])
        await asyncio.sleep(gap_s)  # the pace under test, not a wait for the receiver
    took = loop.time() - start
    await peer.send(packed(Frame.DONE, DONE))
    assert await peer.ack() == {"ok": True, "error": ""}
    assert took > stall_s  # the layer took longer than stall_s, and still arrived
    [t] = r.handled
    assert t.layers == [layer] and r.rx.refused == 0 and refusals() == []
    peer.close()


@pytest.mark.parametrize("stop", ["before the header", "mid header", "after the header", "mid layer", "before DONE"])
async def test_a_sender_that_stops_sending_fails_on_the_receiver_after_stall_s(rig, refusals, stop):
    stall_s = 0.3
    r = await rig(stall_s=stall_s)
    peer = await Peer.dial(r.rx.port)
    upto = CUTS.get(stop, 0)
    sent = await peer.send(WHOLE[:upto]) if upto else asyncio.get_running_loop().time()
    took = await peer.cut(timeout=stall_s + 5) - sent  # the connection stays open: only the stall ends it
    assert stall_s * 0.8 <= took < stall_s + 2.0, took
    [line] = refusals()
    assert "from 127.0.0.1 refused: KV transfer stalled: no data for 0.3s" in line
    assert r.handled == [] and r.rx.refused == 1 and not r.rx._receiving
    peer.close()


@pytest.mark.parametrize("stop", ["mid header", "mid DONE"])
async def test_a_small_frames_body_must_follow_its_length_at_once(rig, refusals, stop):
    r = await rig(stall_s=5.0)  # a layer may take its time; a header or DONE body may not
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(WHOLE[: CUTS[stop]])
    took = await peer.cut() - sent
    assert CONTROL_BODY_S * 0.8 <= took < CONTROL_BODY_S + 2.0, took
    [line] = refusals()
    assert f"refused: KV transfer stalled: no data for {CONTROL_BODY_S:.1f}s" in line
    assert r.handled == [] and r.rx.refused == 1
    peer.close()


async def test_send_kv_gives_up_on_a_receiver_that_stops_reading_or_never_answers():
    stall_s = 0.3
    conns: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    huge = 16 << 20  # more than the socket buffers hold
    for p in (push(), push(kv={**KV, "end": huge // 256, "num_layers": 1}, data=[bytes(huge)])):
        start = loop.time()  # the first waits for an ACK that never comes; the second, for a full window
        with pytest.raises(KVTransferError, match="stalled"):
            await asyncio.wait_for(send_kv("127.0.0.1", port, p, stall_s=stall_s), stall_s + 5.0)
        assert loop.time() - start < stall_s + 2.0
    server.close()
    for w in conns:
        w.transport.abort()


async def test_cancel_cuts_a_transfer_that_is_arriving(rig, refusals):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    await peer.send(header() + frame(Frame.LAYER, layers(1)[0])[:100])
    await until(lambda: "req-1" in r.rx._receiving, what="the transfer to be under way")
    assert r.rx.cancel("req-1") and not r.rx.cancel("req-1")
    cancelled = asyncio.get_running_loop().time()
    assert await peer.cut() - cancelled < 2.0  # at once, not at the stall
    assert r.handled == []
    peer.close()


# --- mutual TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Secrets:
    cfg = config_from_dict(
        {"instances": [{"id": "prefill-0", "role": "prefill", "dc": "A"}, {"id": "md-0", "role": "md", "dc": "B"}]}
    )
    return Secrets(make_secrets(cfg, tmp_path_factory.mktemp("kv") / "secrets"))


async def test_over_mutual_tls_a_prefill_peer_is_served_and_any_other_refused(rig, refusals, secrets):
    r = await rig(tls=secrets.kv_server_context("md-0"))
    await send_kv("127.0.0.1", r.rx.port, push(), 5.0, tls=secrets.kv_client_context("prefill-0"), server_name="md-0")
    assert [t.layers for t in r.handled] == [layers()]
    with pytest.raises(KVTransferError):  # a decoder's certificate from the same CA: not a prefill instance
        await send_kv(
            "127.0.0.1", r.rx.port, push("req-2"), 5.0, tls=secrets.kv_client_context("md-0"), server_name="md-0"
        )
    assert refusals() == ["KV transfer from 127.0.0.1 refused: the peer's certificate is not a prefill instance's"]
    with pytest.raises(KVTransferError):  # the right certificate, the wrong token
        await send_kv(
            "127.0.0.1",
            r.rx.port,
            push("req-3", "guessed"),
            5.0,
            tls=secrets.kv_client_context("prefill-0"),
            server_name="md-0",
        )
    assert "of req-3 from 127.0.0.1 refused: wrong transfer token" in refusals()[-1]
    assert len(r.handled) == 1 and r.rx.refused == 2 and r.vetted == ["req-1", "req-3"]
