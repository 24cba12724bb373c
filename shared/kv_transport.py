"""KV plane: length-prefixed frames on a dedicated TCP connection per transfer.

Wire format, one frame = `u32 length (big endian) | u8 type | body[length - 1]`:

    ROUTE   msgpack {host, port, request_id}   only when going through a WAN proxy: the proxy
                                               reads it, connects upstream, forwards the rest
    HEADER  msgpack {request_id, sender, kv: KVHeader fields}
    LAYER   raw K then V bytes of one layer, `num_layers` frames in layer order
    DONE    msgpack {first_token, stats}
    ACK     msgpack {ok, error}                receiver -> sender, after the KV is committed

A transfer whose peer makes no progress for `stall_s` fails on both sides (never a hang): the
sender raises `KVTransferError`, the receiver drops what it had and reports nothing committed.
A transfer that ends any other way than with its ACK (a failure, or the sender's task cancelled
by an abort) resets its socket, and `KVReceiver.cancel` resets a receiving one: data still in
buffers is dropped rather than carried on to the end across a slow WAN.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

_LEN = struct.Struct(">IB")
MAX_FRAME = 1 << 31


class Frame(IntEnum):
    ROUTE = 1
    HEADER = 2
    LAYER = 3
    DONE = 4
    ACK = 5


class KVTransferError(RuntimeError):
    pass


def frame(kind: Frame, body: bytes) -> bytes:
    return _LEN.pack(len(body) + 1, kind) + body


def packed(kind: Frame, obj: Any) -> bytes:
    return frame(kind, msgpack.packb(obj, use_bin_type=True))


async def read_frame(reader: asyncio.StreamReader, timeout: float) -> tuple[Frame, bytes]:
    try:
        head = await asyncio.wait_for(reader.readexactly(_LEN.size), timeout)
        length, kind = _LEN.unpack(head)
        if length < 1 or length > MAX_FRAME:
            raise KVTransferError(f"bad frame length {length}")
        body = await asyncio.wait_for(reader.readexactly(length - 1), timeout)
    except TimeoutError:
        raise KVTransferError(f"KV transfer stalled: no data for {timeout:.1f}s") from None
    except asyncio.IncompleteReadError:
        raise KVTransferError("KV connection closed mid-transfer") from None
    try:
        return Frame(kind), body
    except ValueError:
        raise KVTransferError(f"unknown frame type {kind}") from None


@dataclass
class Transfer:
    """What a receiver got: header fields, per-layer raw bytes, and the DONE info."""

    request_id: str
    sender: str
    kv: dict[str, Any]
    layers: list[bytes] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)
    wire_bytes: int = 0
    via_wan: bool = False
    started: float = field(default_factory=time.perf_counter)
    elapsed_ms: float = 0.0  # first header byte read -> DONE read


def reset(writer: asyncio.StreamWriter) -> None:
    """Cut a socket now: buffered data is dropped and the peer gets a reset."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


async def send_kv(
    host: str,
    port: int,
    request_id: str,
    sender: str,
    kv_header: dict[str, Any],
    layers: list[bytes],
    done: dict[str, Any],
    stall_s: float,
    via: tuple[str, int] | None = None,
) -> int:
    """Push one transfer and wait for the receiver's ACK. Returns the bytes sent past any proxy."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*(via or (host, port))), stall_s)
    except (TimeoutError, OSError) as e:
        raise KVTransferError(f"cannot connect to KV endpoint {via or (host, port)}: {e}") from None
    sent, acked = 0, False
    try:
        if via is not None:
            writer.write(packed(Frame.ROUTE, {"host": host, "port": port, "request_id": request_id}))
        head = {"request_id": request_id, "sender": sender, "kv": kv_header, "wan": via is not None}
        frames = [packed(Frame.HEADER, head)]
        frames += [frame(Frame.LAYER, data) for data in layers]
        frames.append(packed(Frame.DONE, done))
        for data in frames:
            writer.write(data)
            sent += len(data)
            await asyncio.wait_for(writer.drain(), stall_s)
        # The last frames may still sit in buffers on a slow link: allow them 1 Mbps before the ACK.
        kind, body = await read_frame(reader, stall_s + sent * 8 / 1e6)
        if kind != Frame.ACK:
            raise KVTransferError(f"expected ACK, got {kind.name}")
        ack = msgpack.unpackb(body)
        acked = True
        if not ack.get("ok"):
            raise KVTransferError(f"receiver refused the KV: {ack.get('error')}")
        return sent
    except TimeoutError:
        raise KVTransferError(f"KV transfer to {host}:{port} stalled for {stall_s:.1f}s") from None
    except (ConnectionError, OSError) as e:
        raise KVTransferError(f"KV connection to {host}:{port} failed: {e}") from None
    finally:
        if not acked:  # failed or cancelled mid-way: drop what is still buffered, tell the peer now
            reset(writer)
        else:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (TimeoutError, OSError):
                pass


Handler = Callable[[Transfer], Awaitable[str]]  # returns "" when committed, else an error


async def _receive_header(reader: asyncio.StreamReader, stall_s: float) -> Transfer:
    kind, body = await read_frame(reader, stall_s)
    if kind != Frame.HEADER:
        raise KVTransferError(f"expected HEADER, got {kind.name}")
    head = msgpack.unpackb(body)
    return Transfer(
        head["request_id"], head.get("sender", ""), head["kv"], wire_bytes=len(body) + _LEN.size,
        via_wan=bool(head.get("wan")),
    )  # fmt: skip


async def _receive_body(reader: asyncio.StreamReader, t: Transfer, stall_s: float) -> None:
    for _ in range(t.kv["num_layers"]):
        kind, body = await read_frame(reader, stall_s)
        if kind != Frame.LAYER:
            raise KVTransferError(f"expected LAYER, got {kind.name}")
        t.layers.append(body)
        t.wire_bytes += len(body) + _LEN.size
    kind, body = await read_frame(reader, stall_s)
    if kind != Frame.DONE:
        raise KVTransferError(f"expected DONE, got {kind.name}")
    t.done = msgpack.unpackb(body)
    t.wire_bytes += len(body) + _LEN.size
    t.elapsed_ms = (time.perf_counter() - t.started) * 1000


class KVReceiver:
    """A TCP listener that hands each complete transfer to `handler` and ACKs its verdict."""

    def __init__(
        self, handler: Handler, stall_s: float, on_error: Callable[[str, str], None] | None = None,
        wanted: Callable[[str], bool] | None = None,
    ) -> None:  # fmt: skip
        self.handler = handler
        self.stall_s = stall_s
        self.on_error = on_error  # (request_id or "", message) for transfers that failed mid-way
        self.wanted = wanted  # request id -> still expected here; a transfer for one that is not is cut
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._receiving: dict[str, asyncio.StreamWriter] = {}  # request id -> its connection, mid-transfer

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.server = await asyncio.start_server(self._serve, host, port)
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
        transfer = None
        try:
            transfer = await _receive_header(reader, self.stall_s)
            if self.wanted is not None and not self.wanted(transfer.request_id):  # aborted before its KV came
                raise KVTransferError("no such request here (aborted?): transfer cut")
            self._receiving[transfer.request_id] = writer
            await _receive_body(reader, transfer, self.stall_s)
        except (KVTransferError, KeyError, ValueError, ConnectionError) as e:
            if self.on_error:
                self.on_error(transfer.request_id if transfer else "", str(e))
            reset(writer)  # the sender (and a proxy between) stop at once rather than drain to the end
            return
        finally:
            if transfer is not None and self._receiving.get(transfer.request_id) is writer:
                del self._receiving[transfer.request_id]
        try:
            error = await self.handler(transfer)
        except Exception as e:  # the handler's failure is the sender's answer, not a crash
            error = f"{type(e).__name__}: {e}"
        try:
            writer.write(packed(Frame.ACK, {"ok": not error, "error": error}))
            await asyncio.wait_for(writer.drain(), self.stall_s)
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()
