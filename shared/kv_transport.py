"""KV plane: length-prefixed frames on dedicated (mutual-TLS) TCP connections, one transfer at a
time on each, kept standing between transfers.

A sender keeps its connections to each decoder in a small idle pool (`KVConnections`): a push
takes an idle one (no TCP or TLS handshake: across the WAN that is two round trips saved) or
dials, and gives it back once the receiver's ACK is read. The receiver reads transfer after
transfer on a connection, each one whole and ACKed before the next HEADER is read, so two
pushes never share a stream: concurrent pushes to one decoder go on separate connections. A
connection may also be readied before the KV exists (`EarlyConnection`: prefill readies
main-decode's when the task arrives, from the pool or by dialing), so a handshake that is
needed crosses the WAN while the prompt prefills.

Wire format, one frame = `u32 length (big endian) | u8 type | body[length - 1]`:

    HEADER       TransferHead (msgpack): request, sender, secret, KVHeader     at most 4 KiB
    PART         KVPart (msgpack): the next part of the header's token range ends at `end`
    LAYER        raw K then V bytes of one layer for the part, `num_layers` frames in layer
                 order after each PART, each exactly the size the part's range implies
    FIRST_TOKEN  FirstToken (msgpack): prefill's first token and its figures   at most 16 KiB
    ACK          TransferAck (msgpack), receiver -> sender, after the KV is committed

A transfer is HEADER, then parts that tile the header's range [start, end) in order (none when
it is empty), then FIRST_TOKEN. Prefill sends each part as soon as its engine computed it (a
chunk of a long prompt): the KV of a cold prompt crosses while the rest of it prefills, and
only the last chunk's KV is left for after the first token. Between parts the sender waits for
its engine (a chunk's forward): both sides allow `PART_WAIT_S` for a next PART, not `stall_s`.

Control frames are typed messages (shared/messages.py's codec), checked field by field on decode.

The receiver checks, for every transfer on a connection, before it reads a body: the TLS peer is a
prefill instance of this cluster, the header is small and names a transfer it expects (`vet`: the request, the transfer
secret the scheduler minted for it, the token range and layout), and every frame has exactly its
planned size; anything else is cut at once, logged once with the peer's address, and fails
nothing but that transfer. A transfer whose peer makes no progress for `stall_s` (no byte at
all, not "a frame took longer": a big layer on a slow line is progress) fails on both sides.
A transfer that ends any other way than with its ACK (a failure, or the sender's task
cancelled by an abort) resets its socket, and `KVReceiver.cancel` resets a receiving one: data
still in buffers is dropped rather than carried on to the end across a slow WAN.

Between transfers: the first HEADER on a connection must come within `stall_s` of its opening
(an `EarlyConnection` unused for half of that is closed by its sender); after an ACK the
receiver waits `RECEIVER_IDLE_S` for the next one, the sender keeps an idle connection
`POOL_IDLE_S` (less) and at most `POOL_MAX_IDLE` per decoder. An idle connection that ends
(closed, reset, timed out, or evicted by a receiver at its per-peer cap) ends quietly on both
sides: the sender finds it dead when it takes it (or when its push fails on it: then one fresh
dial, the push sent whole again; see `KVConnections.send`). A push is a success only once its ACK
is read, so a push is never taken for delivered on a dead connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

import msgpack

from shared.messages import BadMessage, Logprob, Message, RequestStats
from shared.runtime.kv_payload import KVHeader

log = logging.getLogger(__name__)

FRAME_HEAD = struct.Struct(">IB")
MAX_HEADER = 4 * 1024
MAX_CONTROL = 16 * 1024
CONTROL_BODY_S = 0.5  # a small frame's body follows its length at once: a sender that stops mid-way is cut
WRITE_SLICE = 256 * 1024  # the sender drains per slice: a stall is a slice that does not move
POOL_IDLE_S = 60.0  # a sender's idle connection is closed after this long unused
POOL_MAX_IDLE = 4  # ... and it keeps at most this many idle per decoder
MAX_PER_PEER = 16  # a receiver's connections from one address; past it (no idle one to close) it refuses
MAX_BUSY = MAX_PER_PEER // 2  # a sender's connections in use per decoder: two senders on one host fit
RECEIVER_IDLE_S = 2 * POOL_IDLE_S  # the receiver waits this long for a HEADER after an ACK: the sender closes first
# A streamed push's next PART comes once prefill computed it: a chunk's forward, seconds on a loaded
# CPU, not a stalled line. A sender that dies resets its connections at once; one whose request is
# aborted cuts its push; this bounds only a sender that hangs.
PART_WAIT_S = 120.0


class Frame(IntEnum):
    HEADER = 2
    LAYER = 3
    FIRST_TOKEN = 4
    ACK = 5
    PART = 6


@dataclass
class TransferHead(Message):
    """HEADER: which transfer this is, and the KV that follows it."""

    request_id: str
    sender: str  # the prefill instance (its TLS certificate must agree)
    secret: str  # minted by the scheduler for (request, this decoder): the receiver checks it
    kv: KVHeader
    wan: bool = False


@dataclass
class KVPart(Message):
    """PART: the KV of tokens [the previous part's end (the header's start for the first), end)
    follows, one LAYER frame per layer."""

    end: int


@dataclass
class FirstToken(Message):
    """FIRST_TOKEN, the transfer's last frame: prefill's first token and what prefill measured."""

    token_id: int
    stats: RequestStats = field(default_factory=RequestStats)
    logprob: Logprob | None = None  # the first token's, when the request asked for them


@dataclass
class TransferAck(Message):
    """ACK, receiver -> sender: the KV is committed (or why not)."""

    ok: bool = True
    error: str = ""


M = TypeVar("M", bound=Message)


class KVTransferError(RuntimeError):
    pass


class ConnectionLost(KVTransferError):
    """The connection was closed or reset under a transfer (not a stall, not a refusal by ACK)."""


class ConnectionUnused(ConnectionLost):
    """The peer closed the connection cleanly where a frame would begin. Before a HEADER that is a
    sender's connection it did not need (`EarlyConnection`, an idle pooled one), not a failed
    transfer; later, a transfer cut short like any other."""


class ConnectionIdle(KVTransferError):
    """No next transfer came on a standing connection within the receiver's idle time."""


def frame(kind: Frame, body: bytes) -> bytes:
    return FRAME_HEAD.pack(len(body) + 1, kind) + body


def packed(kind: Frame, obj: Message | Any) -> bytes:
    """A control frame: a typed message (or, for tests of the receiver's checks, any msgpack value)."""
    return frame(kind, obj.encode() if isinstance(obj, Message) else msgpack.packb(obj, use_bin_type=True))


async def _read_exactly(reader: asyncio.StreamReader, n: int, stall_s: float, idle_s: float | None = None) -> bytes:
    """`n` bytes, failing only when `stall_s` passes with no byte arriving. With `idle_s` (a standing
    connection between transfers), the first byte may take that long, and a connection that ends
    before it (closed, reset, or `idle_s` passed) ends quietly (`ConnectionUnused`, `ConnectionIdle`)."""
    parts, left = [], n
    while left:
        try:
            idle = idle_s is not None and left == n
            part = await asyncio.wait_for(reader.read(min(left, 1 << 20)), idle_s if idle else stall_s)
        except TimeoutError:
            if idle:
                raise ConnectionIdle(f"no transfer for {idle_s:.0f}s") from None
            raise KVTransferError(f"KV transfer stalled: no data for {stall_s:.1f}s") from None
        except (ConnectionError, ssl.SSLError) as e:
            if idle_s is not None and left == n:
                raise ConnectionUnused(f"the idle KV connection ended: {e}") from None
            raise
        if not part:
            raise (ConnectionUnused if left == n else ConnectionLost)("KV connection closed mid-transfer")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


async def read_frame(
    reader: asyncio.StreamReader,
    stall_s: float,
    kind: Frame,
    max_body: int,
    exact: int | None = None,
    idle_s: float | None = None,
    waits: list[float] | None = None,
) -> bytes:
    """The body of the next frame, which must be of `kind` and at most `max_body` bytes (exactly
    `exact` when given): checked on the 5-byte prefix, before any of the body is read. `idle_s`:
    the frame may take that long to begin (`_read_exactly`). `waits` gets the seconds spent
    waiting for the prefix (a sender still computing the frame, not the line carrying it)."""
    before = time.perf_counter()
    length, got = FRAME_HEAD.unpack(await _read_exactly(reader, FRAME_HEAD.size, stall_s, idle_s))
    if waits is not None:
        waits.append(time.perf_counter() - before)
    if got != kind:
        raise KVTransferError(f"expected a {kind.name} frame, got type {got}")
    size = length - 1
    if size < 0 or size > max_body or (exact is not None and size != exact):
        want = f"exactly {exact}" if exact is not None else f"at most {max_body}"
        raise KVTransferError(f"{kind.name} frame of {size} bytes; {want} allowed")
    return await _read_exactly(reader, size, stall_s if kind == Frame.LAYER else min(stall_s, CONTROL_BODY_S))


def decode_body(cls: type[M], body: bytes, kind: Frame) -> M:
    try:
        return cls.decode(body)
    except BadMessage as e:
        raise KVTransferError(f"bad {kind.name} frame: {e}") from None


@dataclass(frozen=True)
class Part:
    """A part of a transfer as received: tokens [start, end), per-layer raw bytes in wire format."""

    start: int
    end: int
    layers: list[bytes]


@dataclass
class Transfer:
    """What a receiver got: the header, its range's KV in parts (per-layer raw bytes), and
    prefill's first token."""

    head: TransferHead
    parts: list[Part] = field(default_factory=list)
    first: FirstToken | None = None  # set once the last frame is read
    wire_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    # HEADER read -> FIRST_TOKEN read, less the waits before each PART and LAYER frame began: the
    # time the KV took to arrive, not the time prefill took to compute a streamed push's next part
    # or layers (the line's pace, which the scheduler's bandwidth samples measure)
    elapsed_ms: float = 0.0

    @property
    def request_id(self) -> str:
        return self.head.request_id

    @property
    def via_wan(self) -> bool:
        return self.head.wan


def reset(writer: asyncio.StreamWriter) -> None:
    """Cut a socket now: buffered data is dropped and the peer gets a reset."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()
