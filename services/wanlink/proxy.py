"""One proxied connection through the WAN link: the ROUTE handshake, then two one-way pipes.

    A -> B (client -> upstream, KV):  stall gate, link token bucket, delay line, ledger, write
    B -> A (upstream -> client, ACK): stall gate, delay line, write

Each pipe is a reader task and a writer task joined by a queue of (due time, chunk): the reader
paces the link (it only reads the next chunk once the link has taken the last one, so unread
bytes stay in the sender's socket = backpressure); the writer holds each chunk until it is due.
EOF travels the same way and becomes a half-close on the far side. A reset on either side (an
aborted transfer) cuts both at once: each socket's pending error is polled, because a pipe
waiting for the link's tokens is not reading and would otherwise carry on draining what the
sender had already written.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Protocol

import msgpack

from services.wanlink.shaper import DelayLine
from shared.kv_transport import Frame, KVTransferError, read_frame, reset

log = logging.getLogger(__name__)

CHUNK = 64 * 1024  # big transfers interleave with others at this grain
QUEUE_CHUNKS = 1024  # chunks "on the wire" per direction (bandwidth x delay), bounded
RESET_POLL_S = 0.05


class StallGate:
    """Open unless a stall is on; a stall holds every pipe of the link until it ends."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._timer: asyncio.TimerHandle | None = None
        self.until = 0.0

    @property
    def stalled(self) -> bool:
        return not self._open.is_set()

    def stall(self, seconds: float) -> None:
        """Stop forwarding for `seconds` from now (extends a stall already on, never shortens it)."""
        loop = asyncio.get_running_loop()
        self.until = max(self.until, loop.time() + seconds)
        if self._timer is not None:
            self._timer.cancel()
        self._open.clear()
        self._timer = loop.call_at(self.until, self._open.set)

    async def wait(self) -> None:
        await self._open.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._open.set()


class Link(Protocol):
    """What a connection needs from the link it runs through."""

    gate: StallGate

    async def admit(self, nbytes: int) -> None:
        """Wait until the link has carried `nbytes` more (the shared bandwidth cap)."""

    def delay(self) -> float:
        """One-way delay in seconds (with jitter) for a chunk leaving now."""

    async def account(self, request_id: str, nbytes: int) -> None:
        """Count `nbytes` about to be written upstream for `request_id`."""


@dataclass(frozen=True)
class Route:
    host: str
    port: int
    request_id: str


async def read_route(reader: asyncio.StreamReader, timeout: float) -> Route:
    """The first frame of a connection through the link. Raises KVTransferError if it is not one."""
    kind, body = await read_frame(reader, timeout)
    if kind != Frame.ROUTE:
        raise KVTransferError(f"expected ROUTE, got {kind.name}")
    try:
        raw = msgpack.unpackb(body)
        route = Route(raw["host"], raw["port"], raw.get("request_id", ""))
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
        raise KVTransferError(f"bad ROUTE frame: {e!r}") from None
    if not isinstance(route.host, str) or not isinstance(route.port, int) or not isinstance(route.request_id, str):
        raise KVTransferError(f"bad ROUTE frame: {raw!r}")
    return route


Side = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Connection:
    """Owns both sockets and the four tasks of one proxied connection."""

    def __init__(self, link: Link, route: Route, client: Side, upstream: Side) -> None:
        self.link = link
        self.route = route
        self.client = client
        self.upstream = upstream
        self._tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        """Forward both ways until both have ended (clean close) or one fails (both reset)."""
        pipes = self._pipe(self.client[0], self.upstream[1], self.route.request_id)
        pipes += self._pipe(self.upstream[0], self.client[1], None)
        self._tasks = [*pipes, asyncio.create_task(self._watch_resets(pipes))]
        clean = False
        try:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            clean = len(done) == len(self._tasks) and not errors and not any(t.cancelled() for t in done)
            if errors:
                route = self.route
                log.info("wan connection %s -> %s:%d ended: %r", route.request_id, route.host, route.port, errors[0])
        finally:
            if clean:
                self.client[1].close()
                self.upstream[1].close()
            else:
                self.abort()

    def abort(self) -> None:
        """Cut the connection: both sockets reset, forwarding stops."""
        for task in self._tasks:
            task.cancel()
        reset(self.client[1])
        reset(self.upstream[1])

    async def _watch_resets(self, pipes: list[asyncio.Task]) -> None:
        """Raise when either socket was reset by its peer; return once the pipes are done."""
        socks = [w.get_extra_info("socket") for w in (self.client[1], self.upstream[1])]
        while not all(t.done() for t in pipes):
            for sock in socks:
                if sock is not None and sock.fileno() >= 0 and (err := sock.getsockopt(socket.SOL_SOCKET,
                                                                                       socket.SO_ERROR)):  # fmt: skip
                    raise ConnectionResetError(err, "reset by peer")
            await asyncio.sleep(RESET_POLL_S)

    def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, request_id: str | None) -> list[asyncio.Task]:
        """Start one direction; `request_id` set = the shaped, accounted A -> B direction."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        return [
            asyncio.create_task(self._read_side(src, queue, shaped=request_id is not None)),
            asyncio.create_task(self._write_side(dst, queue, request_id)),
        ]

    async def _read_side(self, src: asyncio.StreamReader, queue: asyncio.Queue, shaped: bool) -> None:
        loop = asyncio.get_running_loop()
        line = DelayLine()
        while True:
            await self.link.gate.wait()
            data = await src.read(CHUNK)
            if data and shaped:
                await self.link.admit(len(data))
            await queue.put((line.due(loop.time(), self.link.delay()), data))
            if not data:
                return

    async def _write_side(self, dst: asyncio.StreamWriter, queue: asyncio.Queue, request_id: str | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await self.link.gate.wait()
            if not data:
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()
                return
            if request_id is not None:
                await self.link.account(request_id, len(data))
            dst.write(data)
            await dst.drain()
