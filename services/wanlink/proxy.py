"""One connection across the emulated line: two one-way pipes, each on its direction's `Line`.

    dialer -> upstream   the direction from the dialing site (A -> B for a KV push to md)
    upstream -> dialer   the other direction (the decoder's ACK; for the NATS link, B's side)

Each pipe is a reader task and a writer task joined by a queue of (due time, chunk): the reader
paces the line (it reads the next chunk only once the line has taken the last, so unread bytes
stay in the sender's socket = backpressure); the writer holds each chunk until it is due.
EOF travels the same way and becomes a half-close on the far side. A reset on either side (an
aborted transfer) cuts both at once: each socket's pending error is polled, because a pipe
waiting for the line is not reading and would otherwise carry on draining what the sender
had already written. So does a receiver that takes nothing for `write_stall_s` (the line's
`write_stall_s` setting), which would otherwise hold the connection and its sender forever.
The proxy never looks inside the bytes: TLS runs end to end through it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

from services.wanlink.line import CHUNK, Gate, Line
from services.wanlink.shaper import DelayLine
from shared.kv_transport import reset

log = logging.getLogger(__name__)

QUEUE_CHUNKS = 1024  # chunks "on the wire" per direction (bandwidth x delay), bounded
RESET_POLL_S = 0.05

Side = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Recorder:
    """What crosses the line, appended to `<dir>/<forward>.<direction>.bin` (tests read it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def record(self, forward: str, direction: str, data: bytes) -> None:
        with open(self.directory / f"{forward}.{direction}.bin", "ab") as f:
            f.write(data)


class Connection:
    """Owns both sockets and the four tasks of one proxied connection."""

    def __init__(
        self, forward: str, out: Line, back: Line, gate: Gate, client: Side, upstream: Side, write_stall_s: float
    ) -> None:
        self.forward = forward
        self.write_stall_s = write_stall_s  # a write its receiver does not take within this resets both
        self.out, self.back = out, back  # the dialer's direction, and the other
        self.a_to_b = out if out.name == "a-b" else back
        self.gate = gate  # this forward's own faults (a stall of one decoder's KV connections)
        self.recorder: Recorder | None = None
        self.client = client
        self.upstream = upstream
        self._tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        """Forward both ways until both have ended (clean close) or one fails (both reset)."""
        pipes = self._pipe(self.client[0], self.upstream[1], self.out)
        pipes += self._pipe(self.upstream[0], self.client[1], self.back)
        self._tasks = [*pipes, asyncio.create_task(self._watch_resets(pipes))]
        for task in self._tasks:  # the first error is logged below; a pipe cut by `abort` may end in
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its socket's reset: not news
        clean = False
        try:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            clean = len(done) == len(self._tasks) and not errors and not any(t.cancelled() for t in done)
            if errors:
                log.info("wan connection on %s ended: %r", self.forward, errors[0])
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
                if sock is not None and sock.fileno() >= 0 and (err := _pending_error(sock)):
                    raise ConnectionResetError(err, "reset by peer")
            await asyncio.sleep(RESET_POLL_S)

    def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, line: Line) -> list[asyncio.Task]:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        return [
            asyncio.create_task(self._read_side(src, queue, line)),
            asyncio.create_task(self._write_side(dst, queue, line)),
        ]

    async def _read_side(self, src: asyncio.StreamReader, queue: asyncio.Queue, line: Line) -> None:
        loop = asyncio.get_running_loop()
        order = DelayLine()
        while True:
            await line.gate.wait()
            await self.gate.wait()
            data = await src.read(CHUNK)
            delay = await line.carry(self.forward, len(data)) if data else line.delay_ms / 1e3
            await queue.put((order.due(loop.time(), delay), data))
            if not data:
                return

    async def _write_side(self, dst: asyncio.StreamWriter, queue: asyncio.Queue, line: Line) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await line.gate.wait()  # what was on the wire when the line went down waits too
            await self.gate.wait()
            if not data:
                if dst.can_write_eof() and not dst.is_closing():
                    dst.write_eof()
                return
            if self.recorder is not None:
                self.recorder.record(self.forward, "a-b" if line is self.a_to_b else "b-a", data)
            dst.write(data)
            try:  # a receiver that stops reading would hold this connection, and its sender, forever
                await asyncio.wait_for(dst.drain(), self.write_stall_s)
            except TimeoutError:
                raise TimeoutError(f"the receiver took nothing for {self.write_stall_s:g} s") from None


def _pending_error(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
