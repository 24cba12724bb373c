"""The KV plane's receiver on real loopback sockets, without a cluster: what it refuses (a header
length past MAX_HEADER, a header the vet refuses, a layer frame of the wrong size, truncated frames,
one connection too many from a peer, a peer that stops), that each refusal is logged once with the
peer's address and reaches no handler, and that a slow sender that keeps making progress is no stall.
Malformed frames are written by hand on a raw connection, as tests/cluster/test_fuzz.py does; a
header with a bad field (the codec's field-by-field check, KVHeader's range check) is refused on
decode, before the vet and before any layer is read."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import struct
import time

import msgpack
import pytest

from pdd.certs import make_secrets
from shared.config import config_from_dict
from shared.kv_push import KVPush
from shared.kv_receive import KVReceiver, Verdict
from shared.kv_send import send_kv
from shared.kv_transport import (
    CONTROL_BODY_S,
    MAX_CONTROL,
    MAX_HEADER,
    FirstToken,
    Frame,
    KVPart,
    KVTransferError,
    Part,
    Transfer,
    TransferAck,
    TransferHead,
    frame,
    packed,
    read_frame,
)
from shared.messages import RequestStats
from shared.model_info import WireFormat
from shared.runtime.kv_payload import KVHeader
from shared.runtime.kv_wire import layer_bytes
from shared.security import Secrets
from tests.helpers import until

KV = KVHeader(start=0, end=8, num_layers=3, kv_heads=2, head_dim=16, dtype="float32")
LAYER = layer_bytes(8, 2, 16, "float32", "native")  # 2048: K and V of 8 tokens
SECRET = "minted-for-req-1"
FIRST = FirstToken(7, RequestStats(prefill_ms=12.5, local_kv_bytes=3 * LAYER))


class Rig:
    """A receiver that expects the transfers `expect` names, each with its transfer secret (as a
    decoder expects those the scheduler dispatched), and records what its vet and handler saw."""

    def __init__(self, stall_s: float, **kw) -> None:
        self.expect = {f"req-{i}": SECRET for i in range(1, 10)}
        self.have: set[str] = set()  # already committed: HAVE_IT
        self.vetted: list[str] = []
        self.handled: list[Transfer] = []
        self.answer = ""  # the handler's verdict: "" commits, else the error the sender gets
        self.rx = KVReceiver(self.handler, stall_s, vet=self.vet, **kw)

    async def vet(self, t: Transfer) -> tuple[Verdict, str]:
        self.vetted.append(t.request_id)
        if t.request_id not in self.expect:
            return Verdict.REFUSE, f"no decode task for {t.request_id!r} here"
        if not hmac.compare_digest(t.head.secret, self.expect[t.request_id]):
            return Verdict.REFUSE, f"wrong transfer secret for {t.request_id}"
        return (Verdict.HAVE_IT, "") if t.request_id in self.have else (Verdict.RECEIVE, "")

    async def handler(self, t: Transfer) -> str:
        self.handled.append(t)
        return self.answer


def head(request_id: str = "req-1", secret: str = SECRET, kv: KVHeader = KV, sender: str = "prefill-0") -> TransferHead:
    return TransferHead(request_id=request_id, sender=sender, secret=secret, kv=kv, wan=True)


def header(request_id: str = "req-1", secret: str = SECRET, **kv) -> bytes:
    return packed(Frame.HEADER, head(request_id, secret, dataclasses.replace(KV, **kv)))


def raw_header(drop: tuple[str, ...] = (), **kv) -> bytes:
    """A HEADER whose KV fields are `kv` over KV's, as a raw map: anything a hostile sender might
    write (KVHeader itself refuses to hold a bad field); `drop` leaves those KV fields out."""
    fields = {**dataclasses.asdict(head()), "kv": {**dataclasses.asdict(KV), **kv}}
    fields["kv"] = {k: v for k, v in fields["kv"].items() if k not in drop}
    return packed(Frame.HEADER, fields)


def layers(n: int = KV.num_layers, size: int = LAYER) -> list[bytes]:
    return [bytes([i + 1]) * size for i in range(n)]


PART = packed(Frame.PART, KVPart(KV.end))  # the whole range in one part


def layers_of(t: Transfer) -> list[bytes]:
    """The layers of a transfer that came in one part (a whole push)."""
    [part] = t.parts
    assert (part.start, part.end) == (t.head.kv.start, t.head.kv.end)
    return part.layers


def transfer_bytes(request_id: str = "req-1") -> bytes:
    return (
        header(request_id) + PART + b"".join(frame(Frame.LAYER, d) for d in layers()) + packed(Frame.FIRST_TOKEN, FIRST)
    )


def push(
    request_id: str = "req-1",
    secret: str = SECRET,
    kv: KVHeader = KV,
    data: list[bytes] | None = None,
    sender: str = "prefill-0",
) -> KVPush:
    return KVPush(head(request_id, secret, kv, sender), layers() if data is None else data, FIRST)


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

    async def ack(self, timeout: float = 5.0) -> TransferAck:
        return TransferAck.decode(await read_frame(self.reader, timeout, Frame.ACK, MAX_CONTROL))

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
    assert t.head == head() and (t.request_id, t.via_wan) == ("req-1", True)
    assert (t.head.sender, t.head.secret, t.head.kv) == ("prefill-0", SECRET, KV)
    assert type(t.head.kv) is KVHeader and type(t.head.kv.wire) is WireFormat  # typed, not maps and strings
    assert layers_of(t) == layers() and t.first == FIRST and type(t.first.stats) is RequestStats
    assert t.wire_bytes == sent
    assert r.vetted == ["req-1"] and r.rx.refused == 0 and refusals() == []


async def test_the_handlers_error_is_the_senders_answer(rig, refusals):
    r = await rig()
    r.answer = "no free KV blocks"
    with pytest.raises(KVTransferError, match="^receiver refused the KV: no free KV blocks$"):
        await send_kv("127.0.0.1", r.rx.port, push(), stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    await peer.send(transfer_bytes("req-2"))
    assert await peer.ack() == TransferAck(ok=False, error="no free KV blocks")
    assert [t.request_id for t in r.handled] == ["req-1", "req-2"] and r.rx.refused == 0 and refusals() == []
    peer.close()


@pytest.mark.parametrize("wire", list(WireFormat))
async def test_the_layer_size_follows_the_headers_wire_format(rig, refusals, wire):
    """The receiver's default `layer_bytes` is the header's: a narrower wire format's smaller layers
    arrive whole, and native-sized layers under it are refused on the first layer's prefix."""
    r = await rig()
    kv = dataclasses.replace(KV, wire=wire)
    size = layer_bytes(8, 2, 16, "float32", wire)
    assert kv.layer_bytes == size and (size < LAYER) == (wire != WireFormat.NATIVE)
    await send_kv("127.0.0.1", r.rx.port, push(kv=kv, data=layers(size=size)), stall_s=5.0)
    [t] = r.handled
    assert t.head.kv.wire == wire and layers_of(t) == layers(size=size) and refusals() == []
    if wire != WireFormat.NATIVE:
        with pytest.raises(KVTransferError):
            await send_kv("127.0.0.1", r.rx.port, push("req-2", kv=kv), stall_s=5.0)
        assert refusals() == [
            f"KV transfer of req-2 from 127.0.0.1 refused: LAYER frame of {LAYER} bytes; exactly {size} allowed"
        ]
    assert len(r.handled) == 1


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


async def test_a_header_of_exactly_max_header_is_read_and_one_byte_more_is_not(rig, refusals):
    r = await rig()
    sender = "prefill-0" + "x" * 300  # a str16 from here on: one more character, one more byte
    sender += "x" * (MAX_HEADER - len(head(sender=sender).encode()))
    assert len(head(sender=sender).encode()) == MAX_HEADER
    await send_kv("127.0.0.1", r.rx.port, push(sender=sender), stall_s=5.0)
    assert [t.head.sender for t in r.handled] == [sender] and refusals() == []
    with pytest.raises(KVTransferError):
        await send_kv("127.0.0.1", r.rx.port, push("req-2", sender=sender + "x"), stall_s=5.0)
    assert refusals() == [
        f"KV transfer from 127.0.0.1 refused: HEADER frame of {MAX_HEADER + 1} bytes; at most {MAX_HEADER} allowed"
    ]
    assert len(r.handled) == 1 and r.vetted == ["req-1"]


@pytest.mark.parametrize(
    ("rid", "secret", "why"),
    [
        ("req-1", "guessed", "of req-1 from 127.0.0.1 refused: wrong transfer secret for req-1"),
        ("req-1", "", "of req-1 from 127.0.0.1 refused: wrong transfer secret for req-1"),
        ("req-99", SECRET, "of req-99 from 127.0.0.1 refused: no decode task for 'req-99' here"),
    ],
)
async def test_a_header_the_vet_refuses_is_cut_before_any_kv_is_read(rig, refusals, rid, secret, why):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(header(rid, secret))  # the header alone: the layers would follow
    assert await peer.cut() - sent < 2.0  # refused on the header, not after waiting for layers
    assert refusals() == [f"KV transfer {why}"]
    assert r.vetted == [rid] and r.handled == [] and r.rx.refused == 1
    peer.close()
    with pytest.raises(KVTransferError):  # the sender of a whole push learns it failed
        await send_kv("127.0.0.1", r.rx.port, push(rid, secret), stall_s=5.0)
    assert r.handled == [] and r.rx.refused == 2 and len(refusals()) == 2


@pytest.mark.parametrize(
    ("which", "size"), [(0, LAYER - 1), (0, LAYER + 1), (0, 0), (0, 2**31), (2, LAYER - 1), (2, 2 * LAYER)]
)
async def test_a_layer_frame_of_any_other_than_its_planned_size_is_refused_on_its_prefix(rig, refusals, which, size):
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    good = PART + b"".join(frame(Frame.LAYER, d) for d in layers(which))
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


LAYERS = PART + b"".join(frame(Frame.LAYER, d) for d in layers())
OVERSIZED = {"token_id": 7, "x": "y" * MAX_CONTROL}  # a field the codec would ignore, but too long a frame
BAD_HEADERS = {  # each refused on decode, "bad HEADER frame: " and this
    "not msgpack": (frame(Frame.HEADER, b"\xc1\xc1"), "TransferHead: not msgpack"),
    "not a map": (packed(Frame.HEADER, [1, 2, 3]), "TransferHead: expected a map, got list"),
    "a request id that is no string": (
        packed(Frame.HEADER, {**dataclasses.asdict(head()), "request_id": 5}),
        "TransferHead.request_id: expected str, got int",
    ),
    "no secret": (
        packed(Frame.HEADER, {k: v for k, v in dataclasses.asdict(head()).items() if k != "secret"}),
        "missing 1 required positional argument: 'secret'",
    ),
    "no sender and no kv": (
        packed(Frame.HEADER, {"request_id": "req-1", "secret": SECRET}),
        "missing 2 required positional arguments: 'sender' and 'kv'",
    ),
    "kv that is not a map": (
        packed(Frame.HEADER, {**dataclasses.asdict(head()), "kv": 5}),
        "KVHeader: expected a map, got int",
    ),
    "no num_layers": (raw_header(drop=("num_layers",)), "missing 1 required positional argument: 'num_layers'"),
    "no head_dim": (raw_header(drop=("head_dim",)), "missing 1 required positional argument: 'head_dim'"),
    "no dtype": (raw_header(drop=("dtype",)), "missing 1 required positional argument: 'dtype'"),
    "num_layers None": (raw_header(num_layers=None), "KVHeader.num_layers: expected int, got NoneType"),
    "num_layers a string": (raw_header(num_layers="three"), "KVHeader.num_layers: expected int, got str"),
    "num_layers a bool": (raw_header(num_layers=True), "KVHeader.num_layers: expected int, got bool"),
    "head_dim a float": (raw_header(head_dim=16.0), "KVHeader.head_dim: expected int, got float"),
    "an unknown dtype": (raw_header(dtype="float99"), "KVHeader: KV header out of range: KVHeader(start=0, end=8"),
    "an unknown wire format": (raw_header(wire="fp4"), "KVHeader.wire: 'fp4' is not one of native, bf16, fp8, int8"),
    "a negative start": (raw_header(start=-16), "KV header out of range: KVHeader(start=-16, end=8"),
    "a token range that ends before it starts": (raw_header(start=16), "out of range: KVHeader(start=16, end=8"),
    "a negative kv_heads": (raw_header(kv_heads=-1), "KV header out of range: KVHeader(start=0, end=8, num_layers=3"),
    "a negative head_dim": (raw_header(head_dim=-16), "KV header out of range: KVHeader(start=0, end=8, num_layers=3"),
    "a negative num_layers": (
        raw_header(num_layers=-1),
        "KV header out of range: KVHeader(start=0, end=8, num_layers=-1",
    ),
    "a token range of 2^40": (raw_header(end=2**40), "KV header out of range: KVHeader(start=0, end=1099511627776"),
    "2^21 layers": (
        raw_header(num_layers=2**21),
        "KV header out of range: KVHeader(start=0, end=8, num_layers=2097152",
    ),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
async def test_a_header_with_a_bad_field_is_refused_on_decode_before_the_vet_or_any_layer(rig, refusals, case):
    payload, why = BAD_HEADERS[case]
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(payload)  # the header alone: waiting for a layer would take stall_s
    assert await peer.cut() - sent < 2.0
    [line] = refusals()
    assert line.startswith("KV transfer from 127.0.0.1 refused: bad HEADER frame: ") and why in line, line
    assert r.vetted == [] and r.handled == [] and r.rx.refused == 1
    peer.close()


async def test_a_bad_header_is_refused_the_same_when_nothing_vets(rig, refusals):
    """A receiver without a vet (benchmarks/handoff_micro.py) still refuses, logs and counts each."""
    r = await rig(stall_s=5.0)
    r.rx.vet = None
    for payload, _ in BAD_HEADERS.values():
        peer = await Peer.dial(r.rx.port)
        sent = await peer.send(payload)
        assert await peer.cut() - sent < 2.0
        peer.close()
    assert r.handled == [] and r.rx.refused == len(BAD_HEADERS)
    lines = refusals()
    assert len(lines) == len(BAD_HEADERS)
    assert all(line.startswith("KV transfer from 127.0.0.1 refused: bad HEADER frame: ") for line in lines)
    assert all(why in line for line, (_, why) in zip(lines, BAD_HEADERS.values()))


MALFORMED = {
    "a layer first": (frame(Frame.LAYER, b"\0" * LAYER), "expected a HEADER frame, got type 3"),
    "an unknown frame type": (struct.pack(">IB", 5, 9) + b"\0" * 4, "expected a HEADER frame, got type 9"),
    "a first token that is not msgpack": (
        header() + LAYERS + frame(Frame.FIRST_TOKEN, b"\xc1"),
        "bad FIRST_TOKEN frame: FirstToken: not msgpack",
    ),
    "a first token without its token id": (
        header() + LAYERS + packed(Frame.FIRST_TOKEN, {"stats": {}}),
        "bad FIRST_TOKEN frame: FirstToken: FirstToken.__init__() missing 1 required positional argument: 'token_id'",
    ),
    "a first token id that is no integer": (
        header() + LAYERS + packed(Frame.FIRST_TOKEN, {"token_id": "7"}),
        "bad FIRST_TOKEN frame: FirstToken.token_id: expected int, got str",
    ),
    "first-token stats that are not a map": (
        header() + LAYERS + packed(Frame.FIRST_TOKEN, {"token_id": 7, "stats": [1]}),
        "bad FIRST_TOKEN frame: RequestStats: expected a map, got list",
    ),
    "a first token past MAX_CONTROL": (
        header() + LAYERS + packed(Frame.FIRST_TOKEN, OVERSIZED),
        f"FIRST_TOKEN frame of {len(msgpack.packb(OVERSIZED))} bytes; at most {MAX_CONTROL} allowed",
    ),
    "a fourth layer": (
        header() + LAYERS + frame(Frame.LAYER, layers(1)[0]),
        "expected a FIRST_TOKEN frame, got type 3",
    ),
    "layers without a part": (header() + LAYERS[len(PART) :], "expected a PART frame, got type 3"),
    "a part past the range": (header() + packed(Frame.PART, KVPart(9)), "a part ending at 9 does not follow [0, 0)"),
    "a part that does not advance": (
        header() + packed(Frame.PART, KVPart(0)),
        "a part ending at 0 does not follow [0, 0)",
    ),
    "a part going back": (
        header()
        + packed(Frame.PART, KVPart(4))
        + b"".join(frame(Frame.LAYER, bytes(LAYER // 2)) for _ in range(3))
        + packed(Frame.PART, KVPart(2)),
        "a part ending at 2 does not follow [0, 4)",
    ),
    "a part that is not msgpack": (header() + frame(Frame.PART, b"\xc1"), "bad PART frame: KVPart: not msgpack"),
    "a part's end that is no integer": (
        header() + packed(Frame.PART, {"end": "8"}),
        "bad PART frame: KVPart.end: expected int, got str",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_frames_are_refused(rig, refusals, case):
    payload, why = MALFORMED[case]
    r = await rig(stall_s=5.0)
    peer = await Peer.dial(r.rx.port)
    sent = await peer.send(payload)
    assert await peer.cut() - sent < 2.0
    [line] = refusals()
    assert "from 127.0.0.1 refused: " in line and why in line, line
    assert r.handled == [] and r.rx.refused == 1
    peer.close()


WHOLE = transfer_bytes()
CUTS = {  # where the sender's stream ends (it closes its side) before the transfer is whole
    "mid length prefix": 2,
    "mid header": len(header()) - 3,
    "after the header": len(header()),
    "mid part": len(header()) + len(PART) - 1,
    "mid layer": len(header()) + len(PART) + 5 + LAYER // 2,
    "before the first token": len(header()) + len(PART) + 3 * (5 + LAYER),
    "mid first token": len(WHOLE) - 2,
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
    big = dataclasses.replace(KV, end=1024)
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
    half = header("req-1") + PART + frame(Frame.LAYER, layers(1)[0])[: LAYER // 2]
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
    assert await other.ack() == TransferAck(ok=True, error="")
    rest = transfer_bytes()[len(half) :]
    await first.send(rest)
    await second.send(rest)
    assert await first.ack() == TransferAck() and await second.ack() == TransferAck()
    assert sorted(t.request_id for t in r.handled) == ["req-1", "req-2", "req-4"]
    assert all(layers_of(t) == layers() for t in r.handled) and r.rx.refused == 1
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
    await peer.send(header(**BIG) + packed(Frame.PART, KVPart(BIG["end"])))
    start = loop.time()
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        await peer.send(data[i : i + step])
        await asyncio.sleep(gap_s)  # the pace under test, not a wait for the receiver
    took = loop.time() - start
    await peer.send(packed(Frame.FIRST_TOKEN, FIRST))
    assert await peer.ack() == TransferAck(ok=True, error="")
    assert took > stall_s  # the layer took longer than stall_s, and still arrived
    [t] = r.handled
    assert layers_of(t) == [layer] and r.rx.refused == 0 and refusals() == []
    peer.close()


@pytest.mark.parametrize(
    "stop", ["before the header", "mid header", "after the header", "mid layer", "before the first token"]
)
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


@pytest.mark.parametrize("stop", ["mid header", "mid first token"])
async def test_a_small_frames_body_must_follow_its_length_at_once(rig, refusals, stop):
    r = await rig(stall_s=5.0)  # a layer may take its time; a header or first token's body may not
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
    for p in (push(), push(kv=dataclasses.replace(KV, end=huge // 256, num_layers=1), data=[bytes(huge)])):
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
    await peer.send(header() + PART + frame(Frame.LAYER, layers(1)[0])[:100])
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
    assert [layers_of(t) for t in r.handled] == [layers()]
    with pytest.raises(KVTransferError):  # a decoder's certificate from the same CA: not a prefill instance
        await send_kv(
            "127.0.0.1", r.rx.port, push("req-2"), 5.0, tls=secrets.kv_client_context("md-0"), server_name="md-0"
        )
    assert refusals() == ["KV transfer from 127.0.0.1 refused: the peer's certificate is not a prefill instance's"]
    with pytest.raises(KVTransferError):  # the right certificate, the wrong secret
        await send_kv(
            "127.0.0.1",
            r.rx.port,
            push("req-3", "guessed"),
            5.0,
            tls=secrets.kv_client_context("prefill-0"),
            server_name="md-0",
        )
    assert "of req-3 from 127.0.0.1 refused: wrong transfer secret" in refusals()[-1]
    assert len(r.handled) == 1 and r.rx.refused == 2 and r.vetted == ["req-1", "req-3"]


# --- pushes streamed while prefill runs ---------------------------------------------------------


async def under_way(r: Rig, push: KVPush) -> asyncio.Task:
    """`push` sending in the background, once the receiver has read its header (and vetted it)."""
    sending = asyncio.create_task(send_kv("127.0.0.1", r.rx.port, push, stall_s=5.0))
    await until(lambda: push.head.request_id in r.rx._receiving, what="the push to be under way")
    return sending


async def test_a_push_streamed_in_parts_arrives_in_those_parts_after_waiting_for_each(rig, refusals):
    """Prefill adds each computed chunk's KV to a push already under way: the receiver has the
    header and the first part while the rest is still being computed, and the handler gets the
    parts that tile the range, in order, then the first token."""
    r = await rig(stall_s=5.0)
    streamed = KVPush(head())
    first_half = layers(size=LAYER // 2)
    streamed.add(4, first_half)
    sending = await under_way(r, streamed)
    assert r.handled == [] and not sending.done()  # the receiver waits for the next part
    second_half = [bytes([9 + i]) * (LAYER // 2) for i in range(KV.num_layers)]
    streamed.add(8, second_half)
    assert not sending.done()
    streamed.finish(FIRST)
    sent = await sending
    [t] = r.handled
    assert t.parts == [Part(0, 4, first_half), Part(4, 8, second_half)] and t.first == FIRST
    assert t.wire_bytes == sent and refusals() == []


async def test_a_part_added_layer_by_layer_goes_out_as_its_layers_come_and_lands_as_one_part(rig, refusals):
    """Prefill's last chunk: its PART goes with layer 0, each layer as the forward computed it; the
    push is under way (the receiver holds the header and the first layers) before the last layer
    exists, and the handler gets the part whole, as `add` would have made it."""
    r = await rig(stall_s=5.0)
    streamed = KVPush(head())
    assert not streamed.has_kv
    streamed.add(4, layers(size=LAYER // 2))
    second_half = [bytes([9 + i]) * (LAYER // 2) for i in range(KV.num_layers)]
    streamed.add_layers(8, 0, second_half[:1])
    assert streamed.has_kv and streamed.covered == 4  # a part counts once its last layer came
    sending = await under_way(r, streamed)
    streamed.add_layers(8, 1, second_half[1:])
    assert streamed.covered == 8 and not sending.done()
    streamed.finish(FIRST)
    sent = await sending
    [t] = r.handled
    assert t.parts == [Part(0, 4, layers(size=LAYER // 2)), Part(4, 8, second_half)] and t.first == FIRST
    assert t.wire_bytes == sent and refusals() == []
    whole = KVPush(head())
    whole.add(4, layers(size=LAYER // 2))
    whole.add(8, second_half)
    whole.finish(FIRST)
    assert [f async for f in whole.frames()] == [f async for f in streamed.frames()]


async def test_a_pushs_time_leaves_out_the_waits_for_layers_prefill_was_computing(rig):
    """The receiver's `elapsed_ms` (the scheduler's WAN bandwidth sample) is the line's time: the
    half second between two layers of a part, prefill's forward computing the second, is left out
    as the wait for a PART is."""
    r = await rig(stall_s=5.0)
    streamed = KVPush(head())
    streamed.add(4, layers(size=LAYER // 2))
    sending = await under_way(r, streamed)
    half = [bytes([9 + i]) * (LAYER // 2) for i in range(KV.num_layers)]
    streamed.add_layers(8, 0, half[:1])
    await asyncio.sleep(0.5)  # the forward computing the next layers, not a synchronisation
    streamed.add_layers(8, 1, half[1:])
    streamed.finish(FIRST)
    await sending
    [t] = r.handled
    whole_ms = (time.perf_counter() - t.started) * 1000  # header to now: the wait and the line's time
    assert whole_ms >= 500 and t.elapsed_ms < whole_ms - 400, (t.elapsed_ms, whole_ms)


def test_a_part_coming_layer_by_layer_takes_its_layers_in_order_and_nothing_else_meanwhile():
    streamed = KVPush(head())
    assert not streamed.has_kv
    with pytest.raises(ValueError, match="does not follow"):
        streamed.add_layers(8, 1, [b"x" * LAYER])  # layer 0 first
    streamed.add_layers(8, 0, [b"x" * LAYER])
    with pytest.raises(ValueError, match="does not follow"):
        streamed.add_layers(4, 1, [b"x" * LAYER])  # the same part's end
    with pytest.raises(ValueError, match="does not follow"):
        streamed.add_layers(8, 2, [b"x" * LAYER])  # no layer skipped
    with pytest.raises(ValueError, match="do not fit"):
        streamed.add_layers(8, 1, [b"x" * LAYER] * 3)  # past the last layer
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(8, layers())  # not while a part is half there
    with pytest.raises(ValueError, match="parts cover"):
        streamed.finish(FIRST)
    streamed.add_layers(8, 1, [b"x" * LAYER] * 2)
    streamed.finish(FIRST)


def test_a_push_takes_only_parts_that_follow_and_a_first_token_once_they_cover_the_range():
    streamed = KVPush(head())
    with pytest.raises(ValueError, match="parts cover"):
        streamed.finish(FIRST)
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(0, layers(size=0))  # does not advance
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(9, layers())  # past the range
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(4, layers(n=2, size=LAYER // 2))  # a layer short
    streamed.add(4, layers(size=LAYER // 2))
    assert streamed.covered == 4
    streamed.add(8, layers(size=LAYER // 2))
    streamed.finish(FIRST)
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(8, layers(size=0))


async def test_a_push_given_up_or_starved_fails_at_once_and_the_receiver_takes_nothing(rig, refusals):
    r = await rig(stall_s=5.0)
    given_up = KVPush(head())
    given_up.add(4, layers(size=LAYER // 2))
    sending = await under_way(r, given_up)
    given_up.abandon("the request was aborted")
    with pytest.raises(KVTransferError, match="given up: the request was aborted"):
        await sending
    starved = KVPush(head("req-2"), wait_s=0.3)  # nothing computed for longer than its bound
    with pytest.raises(KVTransferError, match="no KV computed for 0s"):
        await send_kv("127.0.0.1", r.rx.port, starved, stall_s=5.0)
    await until(lambda: r.rx.refused == 2, what="the receiver to see both cut")
    assert r.handled == []


async def test_a_streamed_push_retried_on_a_new_connection_sends_its_parts_again(rig, refusals):
    """A retry (a stale standing connection, or the caller's) reads the push from its first frame."""
    r = await rig(stall_s=5.0)
    streamed = KVPush(head())
    streamed.add(4, layers(size=LAYER // 2))
    cut = await under_way(r, streamed)
    assert r.rx.cancel("req-1")  # the connection is reset under it
    streamed.add(8, layers(size=LAYER // 2))
    streamed.finish(FIRST)
    with pytest.raises(KVTransferError):
        await cut
    await send_kv("127.0.0.1", r.rx.port, streamed, stall_s=5.0)
    [t] = r.handled
    assert [(p.start, p.end) for p in t.parts] == [(0, 4), (4, 8)] and t.first == FIRST


async def test_between_parts_the_receiver_waits_part_wait_s_not_stall_s(rig, refusals):
    """A chunk's forward on a loaded CPU may outlast the line's stall bound: the next PART may take
    `part_wait_s`; a sender silent for longer is cut like any stalled one."""
    stall_s = 0.2
    r = await rig(stall_s=stall_s, part_wait_s=5.0)
    slow = KVPush(head())
    slow.add(4, layers(size=LAYER // 2))
    sending = await under_way(r, slow)
    await asyncio.sleep(3 * stall_s)  # the pace under test: prefill computing the next chunk
    slow.add(8, layers(size=LAYER // 2))
    slow.finish(FIRST)
    await sending
    assert [(p.start, p.end) for p in r.handled[0].parts] == [(0, 4), (4, 8)] and refusals() == []

    short = await rig(stall_s=stall_s, part_wait_s=0.3)
    # the sender learns of the cut when it next writes, or at its own bound: far past the receiver's,
    # so the receiver cuts first however late the loop runs its timer
    hung = KVPush(head(), wait_s=2.0)
    hung.add(4, layers(size=LAYER // 2))
    with pytest.raises(KVTransferError):
        await send_kv("127.0.0.1", short.rx.port, hung, stall_s=5.0)
    assert short.handled == [] and "no data for 0.3s" in refusals()[-1]
