"""The KV plane's receiving side: a listener that reads transfer after transfer on each
connection, vets each one before its body (shared/kv_transport.py has the frames and the
checks), hands it to the decoder and ACKs its verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from enum import IntEnum

from shared.kv_transport import (
    FRAME_HEAD,
    MAX_CONTROL,
    MAX_HEADER,
    MAX_PER_PEER,
    PART_WAIT_S,
    RECEIVER_IDLE_S,
    ConnectionIdle,
    ConnectionUnused,
    FirstToken,
    Frame,
    KVPart,
    KVTransferError,
    Part,
    Transfer,
    TransferAck,
    TransferHead,
    decode_body,
    packed,
    read_frame,
    reset,
)
from shared.pipelines import Role
from shared.runtime.kv_payload import KVHeader
from shared.security import peer_unit

log = logging.getLogger(__name__)


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
        layer_bytes: Callable[[KVHeader], int] = lambda kv: kv.layer_bytes,  # a part's, per layer
        max_per_peer: int = MAX_PER_PEER,
        idle_s: float = RECEIVER_IDLE_S,
        part_wait_s: float = PART_WAIT_S,
    ) -> None:
        self.handler = handler
        self.stall_s = stall_s
        self.vet = vet
        self.tls = tls  # with it, only a peer whose certificate says OU=prefill is served
        self.layer_bytes = layer_bytes
        self.max_per_peer = max_per_peer
        self.idle_s = idle_s  # a standing connection's wait for its next HEADER
        self.part_wait_s = part_wait_s  # a streamed push's wait for its next PART (prefill computing it)
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
            transfer = Transfer(decode_body(TransferHead, head, Frame.HEADER), wire_bytes=len(head) + FRAME_HEAD.size)
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
        """The parts that tile the header's range, in order (each PART's end checked before its
        layers are read, each layer frame exactly its part's size), then the first token."""
        kv = t.head.kv
        covered, waited = kv.start, []  # seconds before each frame began: prefill computing it (or the line idle)
        while covered < kv.end:
            # the first part comes with the header; a later one once prefill computed it
            wait_s = self.stall_s if covered == kv.start else max(self.part_wait_s, self.stall_s)
            body = await read_frame(reader, wait_s, Frame.PART, MAX_CONTROL, waits=waited)
            end = decode_body(KVPart, body, Frame.PART).end
            if not covered < end <= kv.end:
                raise KVTransferError(f"a part ending at {end} does not follow [{kv.start}, {covered}) in {kv}")
            t.wire_bytes += len(body) + FRAME_HEAD.size
            size = self.layer_bytes(dataclasses.replace(kv, start=covered, end=end))
            layers = []
            for _ in range(kv.num_layers):  # a last chunk's layers come as prefill's forward computes them
                layers.append(await read_frame(reader, self.stall_s, Frame.LAYER, size, exact=size, waits=waited))
                t.wire_bytes += size + FRAME_HEAD.size
            if keep:
                t.parts.append(Part(covered, end, layers))
            covered = end
        body = await read_frame(reader, self.stall_s, Frame.FIRST_TOKEN, MAX_CONTROL)
        t.first = decode_body(FirstToken, body, Frame.FIRST_TOKEN)
        t.wire_bytes += len(body) + FRAME_HEAD.size
        t.elapsed_ms = (time.perf_counter() - t.started - sum(waited)) * 1000

    def _refuse(self, writer: asyncio.StreamWriter, t: Transfer | None, peer: str, why: str) -> None:
        self.refused += 1
        log.warning("KV transfer %sfrom %s refused: %s", f"of {t.request_id} " if t else "", peer, why)
        reset(writer)  # the sender (and a proxy between) stop at once rather than drain to the end
