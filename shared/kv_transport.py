"""KV plane: length-prefixed frames on a dedicated (mutual-TLS) TCP connection per transfer.

The connection may be dialed before the KV exists (`EarlyConnection`: prefill dials main-decode's
when the task arrives), so its handshakes cross the WAN while the prompt prefills.

Wire format, one frame = `u32 length (big endian) | u8 type | body[length - 1]`:

    HEADER       TransferHead (msgpack): request, sender, secret, KVHeader     at most 4 KiB
    LAYER        raw K then V bytes of one layer, `num_layers` frames in layer order, each
                 exactly the size the header implies
    FIRST_TOKEN  FirstToken (msgpack): prefill's first token and its figures   at most 16 KiB
    ACK          TransferAck (msgpack), receiver -> sender, after the KV is committed

Control frames are typed messages (shared/messages.py's codec), checked field by field on decode.

The receiver checks before it reads a body: the TLS peer is a prefill instance of this
cluster, the header is small and names a transfer it expects (`vet`: the request, the transfer
secret the scheduler minted for it, the token range and layout), and every frame has exactly its
planned size; anything else is cut at once, logged once with the peer's address, and fails
nothing but that transfer. A transfer whose peer makes no progress for `stall_s` (no byte at
all, not "a frame took longer": a big layer on a slow line is progress) fails on both sides.
A transfer that ends any other way than with its ACK (a failure, or the sender's task
cancelled by an abort) resets its socket, and `KVReceiver.cancel` resets a receiving one: data
still in buffers is dropped rather than carried on to the end across a slow WAN.
"""

from __future__ import annotations

import asyncio
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


class ConnectionUnused(KVTransferError):
    """The peer closed the connection cleanly where a frame would begin. Before a HEADER that is a
    sender's early connection it did not need (`EarlyConnection`), not a failed transfer; later,
    a transfer cut short like any other."""


def frame(kind: Frame, body: bytes) -> bytes:
    return _LEN.pack(len(body) + 1, kind) + body


def packed(kind: Frame, obj: Message | Any) -> bytes:
    """A control frame: a typed message (or, for tests of the receiver's checks, any msgpack value)."""
    return frame(kind, obj.encode() if isinstance(obj, Message) else msgpack.packb(obj, use_bin_type=True))


async def _read_exactly(reader: asyncio.StreamReader, n: int, stall_s: float) -> bytes:
    """`n` bytes, failing only when `stall_s` passes with no byte arriving."""
    parts, left = [], n
    while left:
        try:
            part = await asyncio.wait_for(reader.read(min(left, 1 << 20)), stall_s)
        except TimeoutError:
            raise KVTransferError(f"KV transfer stalled: no data for {stall_s:.1f}s") from None
        if not part:
            raise (ConnectionUnused if left == n else KVTransferError)("KV connection closed mid-transfer")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


async def read_frame(
    reader: asyncio.StreamReader, stall_s: float, kind: Frame, max_body: int, exact: int | None = None
) -> bytes:
    """The body of the next frame, which must be of `kind` and at most `max_body` bytes (exactly
    `exact` when given): checked on the 5-byte prefix, before any of the body is read."""
    length, got = _LEN.unpack(await _read_exactly(reader, _LEN.size, stall_s))
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


async def send_kv(
    host: str,
    port: int,
    push: KVPush,
    stall_s: float,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
    conn: Connection | None = None,
) -> int:
    """Push one transfer and wait for the receiver's ACK. Returns the bytes sent. On `conn` (an
    `EarlyConnection`'s, dialed to the same endpoint) when given, else on a connection dialed now."""
    reader, writer = conn or await dial(host, port, stall_s, tls, server_name)
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
        acked = True
        ack = _decode(TransferAck, body, Frame.ACK)
        if not ack.ok:
            raise KVTransferError(f"receiver refused the KV: {ack.error}")
        return sent
    except TimeoutError:
        raise KVTransferError(f"KV transfer to {host}:{port} stalled for {stall_s:.1f}s") from None
    except (ConnectionError, OSError, ssl.SSLError) as e:
        raise KVTransferError(f"KV connection to {host}:{port} failed: {e}") from None
    finally:
        if not acked:  # failed or cancelled mid-way: drop what is still buffered, tell the peer now
            reset(writer)
        else:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (TimeoutError, OSError, ssl.SSLError):
                pass


class EarlyConnection:
    """A KV connection dialed before its KV exists, so that TCP's and TLS's handshakes (two round
    trips: ~40 ms at 10 ms one way) overlap the prefill rather than delay the first KV byte.

    The receiver waits `stall_s` for a connection's HEADER, so the connection is handed out
    (`take`) only within `hold_s` (default `stall_s / 2`) of its creation; past that, or when
    `close`d unused, it is closed cleanly, which the receiver takes for what it is
    (`ConnectionUnused`), not a failed transfer. `take` returns None when the dial failed or the
    connection went unused too long: the push then dials its own, as without one."""

    def __init__(
        self,
        host: str,
        port: int,
        stall_s: float,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        spawn: Callable[[Coroutine], asyncio.Task] = asyncio.ensure_future,
        hold_s: float | None = None,
    ) -> None:
        self._wanted = asyncio.Event()
        self._deadline = asyncio.get_running_loop().time() + (stall_s / 2 if hold_s is None else hold_s)
        self._task = spawn(self._hold(dial(host, port, stall_s, tls, server_name)))
        self.outcome = ""  # "used", "unused" (expired or closed) or "failed" (the dial), once settled

    async def _hold(self, dialing: Awaitable[Connection]) -> Connection | None:
        try:
            conn = await dialing
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
                conn[1].close()
                raise
        if not self._wanted.is_set():
            conn[1].close()  # clean: the receiver sees EOF before a HEADER
            self.outcome = "unused"
            return None
        self.outcome = "used"
        return conn

    async def take(self) -> Connection | None:
        """The connection for a push now (None: dial one). Once only."""
        self._wanted.set()
        try:
            return await self._task  # at once unless the dial is still under way
        except asyncio.CancelledError:
            if self._task.done() and not self._task.cancelled() and (conn := self._task.result()) is not None:
                conn[1].close()  # it was ready just as the push was cancelled: nobody else closes it
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


class Verdict(IntEnum):
    """What the receiver makes of a header, before reading anything else."""

    RECEIVE = 0
    HAVE_IT = 1  # already committed (the sender's retry after a lost ACK): read it to the end, keep nothing, ACK
    REFUSE = 2


Handler = Callable[[Transfer], Awaitable[str]]  # returns "" when committed, else an error
Vet = Callable[[Transfer], Awaitable[tuple[Verdict, str]]]


class KVReceiver:
    """A TCP listener that hands each complete transfer to `handler` and ACKs its verdict."""

    def __init__(
        self,
        handler: Handler,
        stall_s: float,
        vet: Vet | None = None,
        tls: ssl.SSLContext | None = None,
        layer_bytes: Callable[[Transfer], int] = lambda t: t.head.kv.layer_bytes,
        max_per_peer: int = 16,
    ) -> None:
        self.handler = handler
        self.stall_s = stall_s
        self.vet = vet
        self.tls = tls  # with it, only a peer whose certificate says OU=prefill is served
        self.layer_bytes = layer_bytes
        self.max_per_peer = max_per_peer
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.refused = 0  # transfers cut before or while reading: bad peer, header, token or frame
        self._receiving: dict[str, asyncio.StreamWriter] = {}  # request id -> its connection, mid-transfer
        self._per_peer: Counter[str] = Counter()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        handshake = {"ssl": self.tls, "ssl_handshake_timeout": self.stall_s} if self.tls else {}
        self.server = await asyncio.start_server(self._serve, host, port, **handshake)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    def cancel(self, request_id: str) -> bool:
        """Cut the request's transfer if one is arriving (it was aborted): True if one was."""
        writer = self._receiving.pop(request_id, None)
        if writer is not None:
            reset(writer)
        return writer is not None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        self._per_peer[peer] += 1
        try:
            if self._per_peer[peer] > self.max_per_peer:
                self._refuse(writer, None, peer, f"more than {self.max_per_peer} connections from {peer}")
                return
            await self._receive(reader, writer, peer)
        finally:
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        transfer = None
        try:
            if self.tls is not None and peer_unit(writer.get_extra_info("peercert")) != Role.PREFILL:
                raise KVTransferError("the peer's certificate is not a prefill instance's")
            try:
                head = await read_frame(reader, self.stall_s, Frame.HEADER, MAX_HEADER)
            except ConnectionUnused:
                log.debug("an unused KV connection from %s closed", peer)
                writer.close()
                return
            transfer = Transfer(_decode(TransferHead, head, Frame.HEADER), wire_bytes=len(head) + _LEN.size)
            verdict, why = await self.vet(transfer) if self.vet is not None else (Verdict.RECEIVE, "")
            if verdict == Verdict.REFUSE:
                raise KVTransferError(why)
            self._receiving[transfer.request_id] = writer
            # HAVE_IT (a retried push whose first attempt landed): read to the end, checked and not kept, then
            # ACK. Closing on unread data would reset the socket, and the sender, still sending, lose its ACK.
            await self._receive_body(reader, transfer, keep=verdict == Verdict.RECEIVE)
            if verdict == Verdict.HAVE_IT:
                writer.write(packed(Frame.ACK, TransferAck()))
                writer.close()
                return
        except (KVTransferError, ConnectionError, ssl.SSLError) as e:
            self._refuse(writer, transfer, peer, str(e))
            return
        finally:
            if transfer is not None and self._receiving.get(transfer.request_id) is writer:
                del self._receiving[transfer.request_id]
        try:
            error = await self.handler(transfer)
        except Exception as e:  # the handler's failure is the sender's answer, not a crash
            error = f"{type(e).__name__}: {e}"
        try:
            writer.write(packed(Frame.ACK, TransferAck(ok=not error, error=error)))
            await asyncio.wait_for(writer.drain(), self.stall_s)
        except (TimeoutError, OSError, ssl.SSLError):
            pass
        finally:
            writer.close()

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
