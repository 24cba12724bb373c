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
    LAYER        raw K then V bytes of one layer, `num_layers` frames in layer order, each
                 exactly the size the header implies
    FIRST_TOKEN  FirstToken (msgpack): prefill's first token and its figures   at most 16 KiB
    ACK          TransferAck (msgpack), receiver -> sender, after the KV is committed

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
import functools
import logging
import socket
import ssl
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

import msgpack

from shared.messages import BadMessage, Logprob, Message, RequestStats
from shared.pipelines import Role
from shared.runtime.kv_payload import KVHeader
from shared.security import peer_unit

log = logging.getLogger(__name__)

_LEN = struct.Struct(">IB")
MAX_HEADER = 4 * 1024
MAX_CONTROL = 16 * 1024
CONTROL_BODY_S = 0.5  # a small frame's body follows its length at once: a sender that stops mid-way is cut
WRITE_SLICE = 256 * 1024  # the sender drains per slice: a stall is a slice that does not move
POOL_IDLE_S = 60.0  # a sender's idle connection is closed after this long unused
POOL_MAX_IDLE = 4  # ... and it keeps at most this many idle per decoder
RECEIVER_IDLE_S = 2 * POOL_IDLE_S  # the receiver waits this long for a HEADER after an ACK: the sender closes first


class Frame(IntEnum):
    HEADER = 2
    LAYER = 3
    FIRST_TOKEN = 4
    ACK = 5


@dataclass
class TransferHead(Message):
    """HEADER: which transfer this is, and the KV that follows it."""

    request_id: str
    sender: str  # the prefill instance (its TLS certificate must agree)
    secret: str  # minted by the scheduler for (request, this decoder): the receiver checks it
    kv: KVHeader
    wan: bool = False


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
    return _LEN.pack(len(body) + 1, kind) + body


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
) -> bytes:
    """The body of the next frame, which must be of `kind` and at most `max_body` bytes (exactly
    `exact` when given): checked on the 5-byte prefix, before any of the body is read. `idle_s`:
    the frame may take that long to begin (`_read_exactly`)."""
    length, got = _LEN.unpack(await _read_exactly(reader, _LEN.size, stall_s, idle_s))
    if got != kind:
        raise KVTransferError(f"expected a {kind.name} frame, got type {got}")
    size = length - 1
    if size < 0 or size > max_body or (exact is not None and size != exact):
        want = f"exactly {exact}" if exact is not None else f"at most {max_body}"
        raise KVTransferError(f"{kind.name} frame of {size} bytes; {want} allowed")
    return await _read_exactly(reader, size, stall_s if kind == Frame.LAYER else min(stall_s, CONTROL_BODY_S))


def _decode(cls: type[M], body: bytes, kind: Frame) -> M:
    try:
        return cls.decode(body)
    except BadMessage as e:
        raise KVTransferError(f"bad {kind.name} frame: {e}") from None


@dataclass
class Transfer:
    """What a receiver got: the header, per-layer raw bytes, and prefill's first token."""

    head: TransferHead
    layers: list[bytes] = field(default_factory=list)
    first: FirstToken | None = None  # set once the last frame is read
    wire_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    elapsed_ms: float = 0.0  # first header byte read -> FIRST_TOKEN read

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


@dataclass(frozen=True)
class KVPush:
    """One push: a decoder's range of a request's KV, and prefill's first token with it."""

    head: TransferHead
    layers: list[bytes]
    first: FirstToken


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True)
class Endpoint:
    """A decoder's KV listener: where to dial, and the name its TLS certificate must prove."""

    host: str
    port: int
    name: str | None = None  # the decoder's instance id (the TLS server name, the metrics label)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


async def dial(
    host: str, port: int, stall_s: float, tls: ssl.SSLContext | None = None, server_name: str | None = None
) -> Connection:
    """A KV connection, its TLS handshake done. With `tls` the receiver must prove it is
    `server_name` (the decoder the scheduler picked)."""
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=tls, server_hostname=server_name if tls else None), stall_s
        )
    except (TimeoutError, OSError, ssl.SSLError) as e:
        raise KVTransferError(f"cannot connect to KV endpoint {host}:{port}: {e}") from None


def alive(conn: Connection) -> bool:
    """Nothing says the connection ended: not closing, no EOF or error from the peer. (A reset on
    its way is only seen once it arrives: a push on such a connection fails, see `KVConnections`.)"""
    reader, writer = conn
    return not writer.is_closing() and not reader.at_eof() and reader.exception() is None


async def _push_on(conn: Connection, push: KVPush, stall_s: float, where: str) -> tuple[int, TransferAck]:
    """Send one transfer's frames on `conn` and read the receiver's ACK: (bytes sent, the ACK). The
    connection is left open once an ACK was read (the stream is at a transfer's boundary), reset
    on any other way out (a failure, or the caller cancelled mid-way): buffered data is dropped and
    the peer told at once, never left to carry a part of a transfer."""
    reader, writer = conn
    sent, acked = 0, False
    try:
        frames = [
            packed(Frame.HEADER, push.head),
            *(frame(Frame.LAYER, d) for d in push.layers),
            packed(Frame.FIRST_TOKEN, push.first),
        ]
        for data in frames:
            for i in range(0, len(data), WRITE_SLICE):
                writer.write(data[i : i + WRITE_SLICE])
                await asyncio.wait_for(writer.drain(), stall_s)
            sent += len(data)
        # The last frames may still sit in buffers on a slow link: allow them 1 Mbps before the ACK.
        body = await read_frame(reader, stall_s + sent * 8 / 1e6, Frame.ACK, MAX_CONTROL)
        ack = _decode(TransferAck, body, Frame.ACK)
        acked = True
        return sent, ack
    except TimeoutError:
        raise KVTransferError(f"KV transfer to {where} stalled for {stall_s:.1f}s") from None
    except (ConnectionError, OSError, ssl.SSLError) as e:
        raise ConnectionLost(f"KV connection to {where} failed: {e}") from None
    finally:
        if not acked:
            reset(writer)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (TimeoutError, OSError, ssl.SSLError):
        pass


async def send_kv(
    host: str,
    port: int,
    push: KVPush,
    stall_s: float,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
    conn: Connection | None = None,
) -> int:
    """Push one transfer on a connection of its own and wait for the receiver's ACK; the connection
    is closed after it (`KVConnections.send` keeps it). Returns the bytes sent. On `conn` (an
    `EarlyConnection`'s, dialed to the same endpoint) when given, else on a connection dialed now."""
    conn = conn or await dial(host, port, stall_s, tls, server_name)
    sent, ack = await _push_on(conn, push, stall_s, f"{host}:{port}")
    await _close(conn[1])
    if not ack.ok:
        raise KVTransferError(f"receiver refused the KV: {ack.error}")
    return sent


@dataclass(eq=False)
class _Idle:
    conn: Connection
    since: float  # when its last transfer's ACK was read (loop time)
    timer: asyncio.TimerHandle | None = None


class KVConnections:
    """A sender's standing KV connections, per decoder endpoint: a push takes an idle one (no
    handshake) or dials, and gives it back once its ACK is read. Only idle connections are pooled:
    one push at a time per connection, so concurrent pushes to a decoder use separate ones.

    At most `max_idle` wait per endpoint (the oldest goes first), each closed cleanly once idle for
    `idle_s` (well within the receiver's `RECEIVER_IDLE_S`), all of them on `close`. `count(decoder,
    how)` is called for each `dialed` connection (a TCP and TLS handshake), each `reused` one, and
    each `stale` one (found ended when taken, or failed under a push: then dialed again)."""

    def __init__(
        self,
        stall_s: float,
        tls: ssl.SSLContext | None = None,
        max_idle: int = POOL_MAX_IDLE,
        idle_s: float = POOL_IDLE_S,
        count: Callable[[str, str], None] | None = None,
    ) -> None:
        self.stall_s = stall_s
        self.tls = tls
        self.max_idle = max_idle
        self.idle_s = idle_s
        self.counts: Counter[tuple[str, str]] = Counter()  # (decoder, how) -> n, as `count` is told
        self._count = count
        self._idle: dict[Endpoint, list[_Idle]] = {}  # oldest first
        self._closed = False

    def _counted(self, ep: Endpoint, how: str) -> None:
        self.counts[(ep.name or str(ep), how)] += 1
        if self._count is not None:
            self._count(ep.name or str(ep), how)

    def idle(self, ep: Endpoint | None = None) -> int:
        """Idle connections (to `ep`, or to every endpoint)."""
        return sum(len(v) for k, v in self._idle.items() if ep is None or k == ep)

    async def dial(self, ep: Endpoint) -> Connection:
        conn = await dial(ep.host, ep.port, self.stall_s, self.tls, ep.name)
        self._counted(ep, "dialed")
        return conn

    def take(self, ep: Endpoint) -> tuple[Connection, float] | None:
        """An idle connection to `ep` that is still alive, the most recently used first, and when
        it went idle; None when there is none (dial one)."""
        idle = self._idle.get(ep, [])
        while idle:
            entry = idle.pop()
            if entry.timer is not None:
                entry.timer.cancel()
            if alive(entry.conn):
                self._counted(ep, "reused")
                return entry.conn, entry.since
            self._counted(ep, "stale")
            reset(entry.conn[1])
        self._idle.pop(ep, None)
        return None

    def put(self, ep: Endpoint, conn: Connection, since: float | None = None) -> None:
        """Give a connection back, at a transfer boundary (its ACK read, or never written on), idle
        since `since` (now by default). Closed instead when the pool is closed or full."""
        loop = asyncio.get_running_loop()
        since = loop.time() if since is None else since
        left = since + self.idle_s - loop.time()
        if self._closed or not alive(conn) or left <= 0:
            conn[1].close()
            return
        idle = self._idle.setdefault(ep, [])
        entry = _Idle(conn, since)
        entry.timer = loop.call_later(left, self._expire, ep, entry)
        idle.append(entry)
        idle.sort(key=lambda e: e.since)
        while len(idle) > self.max_idle:
            self._drop(ep, idle[0])

    def _expire(self, ep: Endpoint, entry: _Idle) -> None:
        self._drop(ep, entry)

    def _drop(self, ep: Endpoint, entry: _Idle) -> None:
        idle = self._idle.get(ep, [])
        if entry in idle:
            idle.remove(entry)
            if not idle:
                del self._idle[ep]
        if entry.timer is not None:
            entry.timer.cancel()
        entry.conn[1].close()  # clean: the receiver sees EOF before a HEADER

    async def send(self, ep: Endpoint, push: KVPush, conn: Connection | None = None, reused: bool = False) -> int:
        """Push one transfer and wait for the receiver's ACK; returns the bytes sent. On `conn` when
        given (an `EarlyConnection`'s; `reused`: it came from this pool), else on an idle one, else
        on one dialed now. A reused connection that fails under the push, closed or reset (the
        receiver closed it meanwhile, the line cut it), is dropped and the push sent whole again on
        one fresh dial, which does not count as a retry of the caller's. A stall or a refusal is
        the caller's failure, as on a new connection. After the ACK the connection goes back idle."""
        if conn is None:
            taken = self.take(ep)
            conn, reused = (taken[0], True) if taken else (await self.dial(ep), False)
        try:
            sent, ack = await _push_on(conn, push, self.stall_s, str(ep))
        except ConnectionLost as e:
            if not reused:
                raise
            self._counted(ep, "stale")
            log.info("KV connection to %s (%s) was gone (%s): dialing a new one", ep.name, ep, e)
            conn = await self.dial(ep)
            sent, ack = await _push_on(conn, push, self.stall_s, str(ep))
        self.put(ep, conn)
        if not ack.ok:
            raise KVTransferError(f"receiver refused the KV: {ack.error}")
        return sent

    async def close(self) -> None:
        """Close every idle connection (cleanly); any given back later is closed too."""
        self._closed = True
        entries = [(ep, e) for ep, idle in self._idle.items() for e in list(idle)]
        for ep, entry in entries:
            self._drop(ep, entry)
        await asyncio.gather(*(_close(e.conn[1]) for _, e in entries))


class EarlyConnection:
    """A KV connection readied before its KV exists, so that TCP's and TLS's handshakes (two round
    trips: ~40 ms at 10 ms one way), when one is needed, overlap the prefill rather than delay the
    first KV byte. With a `pool`, an idle connection to the endpoint is taken at once (`reused`)
    instead of dialing.

    The receiver waits `stall_s` for a new connection's first HEADER, so a dialed connection is
    handed out (`take`) only within `hold_s` (default `stall_s / 2`) of its creation; past that, or
    when `close`d unused, it is closed cleanly, which the receiver takes for what it is
    (`ConnectionUnused`), not a failed transfer; a reused one goes back to the pool instead.
    `take` returns None when the dial failed or the connection went unused too long: the push then
    takes or dials its own, as without one."""

    def __init__(
        self,
        host: str,
        port: int,
        stall_s: float,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        spawn: Callable[[Coroutine], asyncio.Task] = asyncio.ensure_future,
        hold_s: float | None = None,
        pool: KVConnections | None = None,
    ) -> None:
        self._wanted = asyncio.Event()
        self._deadline = asyncio.get_running_loop().time() + (stall_s / 2 if hold_s is None else hold_s)
        self._pool, self._ep = pool, Endpoint(host, port, server_name)
        taken = pool.take(self._ep) if pool is not None else None
        self.reused = taken is not None  # an idle connection from `pool`, not a dial
        self._since = taken[1] if taken else None
        if taken:
            dialing = functools.partial(_ready, taken[0])
        elif pool is not None:
            dialing = functools.partial(pool.dial, self._ep)
        else:
            dialing = functools.partial(dial, host, port, stall_s, tls, server_name)
        self._let_go_done = False
        self._task = spawn(self._hold(dialing))
        self.outcome = ""  # "used", "unused" (expired or closed) or "failed" (the dial), once settled
        if taken:  # cancelled before it even ran (`close` at once): the pooled connection goes back
            self._task.add_done_callback(lambda t: t.cancelled() and self._let_go(taken[0]))

    def _let_go(self, conn: Connection) -> None:
        """Not used: back to the pool if it came from there, else closed cleanly (the receiver sees
        EOF before a HEADER). Once only."""
        if self._let_go_done:
            return
        self._let_go_done = True
        if self.reused and self._pool is not None:
            self._pool.put(self._ep, conn, self._since)
        else:
            conn[1].close()

    async def _hold(self, dialing: Callable[[], Awaitable[Connection]]) -> Connection | None:
        try:
            conn = await dialing()
        except KVTransferError:
            self.outcome = "failed"
            return None
        left = self._deadline - asyncio.get_running_loop().time()
        if not self._wanted.is_set():
            try:
                await asyncio.wait_for(self._wanted.wait(), max(left, 0.0))
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                self._let_go(conn)
                raise
        if not self._wanted.is_set():
            self._let_go(conn)
            self.outcome = "unused"
            return None
        self.outcome = "used"
        return conn

    async def take(self) -> Connection | None:
        """The connection for a push now (None: take or dial one). Once only."""
        self._wanted.set()
        try:
            return await self._task  # at once unless the dial is still under way
        except asyncio.CancelledError:
            if self._task.done() and not self._task.cancelled() and (conn := self._task.result()) is not None:
                self._let_go(conn)  # it was ready just as the push was cancelled: nobody else closes it
            if asyncio.current_task().cancelling():
                raise  # the push was cancelled (its task cancels the dial with it)
            return None  # closed meanwhile

    def close(self) -> None:
        """Unused after all (the request ended first): close it, or stop dialing."""
        if not self._task.done():
            self._task.cancel()
            self.outcome = self.outcome or "unused"

    @property
    def settled(self) -> bool:
        """Used, closed, or failed to dial: it holds no connection for the push any more."""
        return self._task.done()


async def _ready(conn: Connection) -> Connection:
    return conn


class Verdict(IntEnum):
    """What the receiver makes of a header, before reading anything else."""

    RECEIVE = 0
    HAVE_IT = 1  # already committed (the sender's retry after a lost ACK): read it to the end, keep nothing, ACK
    REFUSE = 2


Handler = Callable[[Transfer], Awaitable[str]]  # returns "" when committed, else an error
Vet = Callable[[Transfer], Awaitable[tuple[Verdict, str]]]


class KVReceiver:
    """A TCP listener that hands each complete transfer to `handler` and ACKs its verdict, transfer
    after transfer on each connection (`_serve`)."""

    def __init__(
        self,
        handler: Handler,
        stall_s: float,
        vet: Vet | None = None,
        tls: ssl.SSLContext | None = None,
        layer_bytes: Callable[[Transfer], int] = lambda t: t.head.kv.layer_bytes,
        max_per_peer: int = 16,
        idle_s: float = RECEIVER_IDLE_S,
    ) -> None:
        self.handler = handler
        self.stall_s = stall_s
        self.vet = vet
        self.tls = tls  # with it, only a peer whose certificate says OU=prefill is served
        self.layer_bytes = layer_bytes
        self.max_per_peer = max_per_peer
        self.idle_s = idle_s  # a standing connection's wait for its next HEADER
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.refused = 0  # transfers cut before or while reading: bad peer, header, token or frame
        self.transfers = 0  # transfers read whole (and answered with an ACK)
        self._receiving: dict[str, asyncio.StreamWriter] = {}  # request id -> its connection, mid-transfer
        self._per_peer: Counter[str] = Counter()
        self._idle: dict[str, list[asyncio.StreamWriter]] = {}  # peer -> its connections between transfers

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        handshake = {"ssl": self.tls, "ssl_handshake_timeout": self.stall_s} if self.tls else {}
        self.server = await asyncio.start_server(self._serve, host, port, **handshake)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """No new connection; the standing ones between transfers are closed (cleanly)."""
        if self.server is not None:
            self.server.close()
        for idle in list(self._idle.values()):
            for writer in list(idle):
                writer.close()

    def cancel(self, request_id: str) -> bool:
        """Cut the request's transfer if one is arriving (it was aborted): True if one was."""
        writer = self._receiving.pop(request_id, None)
        if writer is not None:
            reset(writer)
        return writer is not None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: its transfers one after another, each read whole and ACKed before the
        next HEADER is read, each vetted on its own. Ends when the sender closes it, on the first
        transfer refused (reset), or after `idle_s` without a next transfer (closed)."""
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        self._per_peer[peer] += 1
        try:
            if self._per_peer[peer] > self.max_per_peer and not self._evict_idle(peer):
                self._refuse(writer, None, peer, f"more than {self.max_per_peer} connections from {peer}")
                return
            first = True
            while await self._receive(reader, writer, peer, first):
                first = False
        finally:
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]

    def _evict_idle(self, peer: str) -> bool:
        """At the cap of connections from `peer`: close its longest idle one to make room (its sender
        finds it closed and dials again when it needs one). False when none is idle."""
        idle = self._idle.get(peer)
        if not idle:
            return False
        idle[0].close()
        self._set_idle(peer, idle[0], False)
        return True

    def _set_idle(self, peer: str, writer: asyncio.StreamWriter, idle: bool) -> None:
        conns = self._idle.setdefault(peer, [])
        if idle:
            conns.append(writer)
        elif writer in conns:
            conns.remove(writer)
        if not conns:
            del self._idle[peer]

    async def _receive(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, first: bool
    ) -> bool:
        """One transfer on the connection; True when it was ACKed and the connection may carry the
        next. The first HEADER must come within `stall_s`, a later one within `idle_s`."""
        transfer = None
        try:
            if self.tls is not None and peer_unit(writer.get_extra_info("peercert")) != Role.PREFILL:
                raise KVTransferError("the peer's certificate is not a prefill instance's")
            if not first:
                self._set_idle(peer, writer, True)
            try:
                head = await read_frame(
                    reader, self.stall_s, Frame.HEADER, MAX_HEADER, idle_s=None if first else self.idle_s
                )
            except (ConnectionUnused, ConnectionIdle) as e:
                log.debug("a%s KV connection from %s closed: %s", "n unused" if first else " standing", peer, e)
                writer.close()
                return False
            finally:
                if not first:
                    self._set_idle(peer, writer, False)
            transfer = Transfer(_decode(TransferHead, head, Frame.HEADER), wire_bytes=len(head) + _LEN.size)
            verdict, why = await self.vet(transfer) if self.vet is not None else (Verdict.RECEIVE, "")
            if verdict == Verdict.REFUSE:
                raise KVTransferError(why)
            self._receiving[transfer.request_id] = writer
            # HAVE_IT (a retried push whose first attempt landed): read to the end, checked and not kept, then
            # ACK. Closing on unread data would reset the socket, and the sender, still sending, lose its ACK.
            await self._receive_body(reader, transfer, keep=verdict == Verdict.RECEIVE)
        except (KVTransferError, ConnectionError, ssl.SSLError) as e:
            self._refuse(writer, transfer, peer, str(e))
            return False
        finally:
            if transfer is not None and self._receiving.get(transfer.request_id) is writer:
                del self._receiving[transfer.request_id]
        error = ""
        if verdict == Verdict.RECEIVE:
            try:
                error = await self.handler(transfer)
            except Exception as e:  # the handler's failure is the sender's answer, not a crash
                error = f"{type(e).__name__}: {e}"
        self.transfers += 1
        try:
            writer.write(packed(Frame.ACK, TransferAck(ok=not error, error=error)))
            await asyncio.wait_for(writer.drain(), self.stall_s)
        except (TimeoutError, OSError, ssl.SSLError):
            writer.close()
            return False
        return True

    async def _receive_body(self, reader: asyncio.StreamReader, t: Transfer, keep: bool = True) -> None:
        size = self.layer_bytes(t)
        for _ in range(t.head.kv.num_layers):
            layer = await read_frame(reader, self.stall_s, Frame.LAYER, size, exact=size)
            if keep:
                t.layers.append(layer)
            t.wire_bytes += size + _LEN.size
        body = await read_frame(reader, self.stall_s, Frame.FIRST_TOKEN, MAX_CONTROL)
        t.first = _decode(FirstToken, body, Frame.FIRST_TOKEN)
        t.wire_bytes += len(body) + _LEN.size
        t.elapsed_ms = (time.perf_counter() - t.started) * 1000

    def _refuse(self, writer: asyncio.StreamWriter, t: Transfer | None, peer: str, why: str) -> None:
        self.refused += 1
        log.warning("KV transfer %sfrom %s refused: %s", f"of {t.request_id} " if t else "", peer, why)
        reset(writer)  # the sender (and a proxy between) stop at once rather than drain to the end
