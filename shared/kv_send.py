"""The KV plane's sending side: a push (shared/kv_push.py) on a standing connection
(shared/kv_transport.py has the frames and what the receiver checks).

A sender keeps its connections to each decoder in a small idle pool (`KVConnections`): a push
takes an idle one (no TCP or TLS handshake: across the WAN that is two round trips saved) or
dials, and gives it back once the receiver's ACK is read; concurrent pushes to one decoder go on
separate connections. A connection may also be readied before the KV exists (`EarlyConnection`:
prefill readies main-decode's when the task arrives, from the pool or by dialing), so a
handshake that is needed crosses the WAN while the prompt prefills. An idle connection that
ended is found dead when taken, or when a push fails on it: then one fresh dial, the push sent
whole again (`KVConnections.send`). A push is a success only once its ACK is read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

from shared.kv_push import KVPush
from shared.kv_transport import (
    MAX_BUSY,
    MAX_CONTROL,
    POOL_IDLE_S,
    POOL_MAX_IDLE,
    WRITE_SLICE,
    ConnectionLost,
    Frame,
    KVTransferError,
    TransferAck,
    decode_body,
    read_frame,
    reset,
)

log = logging.getLogger(__name__)


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
        async for data in push.frames():
            for i in range(0, len(data), WRITE_SLICE):
                writer.write(data[i : i + WRITE_SLICE])
                await asyncio.wait_for(writer.drain(), stall_s)
            sent += len(data)
        # The last frames may still sit in buffers on a slow link: allow them 1 Mbps before the ACK.
        body = await read_frame(reader, stall_s + sent * 8 / 1e6, Frame.ACK, MAX_CONTROL)
        ack = decode_body(TransferAck, body, Frame.ACK)
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
    each `stale` one (found ended when taken, or failed under a push: then dialed again).

    At most `max_busy` connections per endpoint are in use at once (a push's, or an
    `EarlyConnection` readied for one): a decoder refuses a sender's connections past its
    per-peer cap (shared/kv_receive.py), so a burst of pushes past it would be refused, retried
    and failed rather than queued. A push waits for a free one (up to `stall_s`); an early
    connection is not readied when none is free (its push waits instead). `MAX_BUSY` is half the
    receivers' cap: two senders on one host (one address) fit beside each other's idle ones."""

    def __init__(
        self,
        stall_s: float,
        tls: ssl.SSLContext | None = None,
        max_idle: int = POOL_MAX_IDLE,
        idle_s: float = POOL_IDLE_S,
        count: Callable[[str, str], None] | None = None,
        max_busy: int = MAX_BUSY,
    ) -> None:
        self.stall_s = stall_s
        self.tls = tls
        self.max_idle = max_idle
        self.idle_s = idle_s
        self.max_busy = max_busy
        self._busy: Counter[Endpoint] = Counter()  # connections in use, per endpoint
        self._waiting: dict[Endpoint, list[asyncio.Future]] = {}  # pushes waiting for one, oldest first
        self.counts: Counter[tuple[str, str]] = Counter()  # (decoder, how) -> n, as `count` is told
        self._count = count
        self._idle: dict[Endpoint, list[_Idle]] = {}  # oldest first
        self._closed = False

    def _counted(self, ep: Endpoint, how: str) -> None:
        self.counts[(ep.name or str(ep), how)] += 1
        if self._count is not None:
            self._count(ep.name or str(ep), how)

    def busy(self, ep: Endpoint) -> int:
        """Connections to `ep` in use now (pushes and early connections)."""
        return self._busy[ep]

    def try_hold(self, ep: Endpoint) -> bool:
        """A connection to `ep` may be put to use now (counted until `let_go`); False at `max_busy`."""
        if self._busy[ep] >= self.max_busy:
            return False
        self._busy[ep] += 1
        return True

    async def hold(self, ep: Endpoint) -> None:
        """Wait (up to `stall_s`) until a connection to `ep` may be put to use, and count it."""
        deadline = asyncio.get_running_loop().time() + self.stall_s
        while not self.try_hold(ep):
            turn = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(ep, []).append(turn)
            try:
                await asyncio.wait_for(turn, max(deadline - asyncio.get_running_loop().time(), 0.0))
            except TimeoutError:
                raise KVTransferError(f"no KV connection to {ep.name or ep} free within {self.stall_s:.0f}s") from None
            finally:
                if turn in self._waiting.get(ep, []):
                    self._waiting[ep].remove(turn)

    def let_go(self, ep: Endpoint) -> None:
        """A connection to `ep` is no longer in use (back idle, or closed): the oldest waiter's turn."""
        self._busy[ep] = max(self._busy[ep] - 1, 0)
        for turn in self._waiting.get(ep, []):
            if not turn.done():
                turn.set_result(None)
                return

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
        given (an `EarlyConnection`'s of this pool, already counted in use; `reused`: it came from
        the idle ones), else, once one may be used (`hold`), on an idle one, else on one dialed
        now. A reused connection that fails under the push, closed or reset (the receiver closed
        it meanwhile, the line cut it), is dropped and the push sent whole again on one fresh
        dial, which does not count as a retry of the caller's. A stall or a refusal is the
        caller's failure, as on a new connection. After the ACK the connection goes back idle."""
        if conn is None:
            await self.hold(ep)
        try:
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
        finally:
            self.let_go(ep)
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
        # one of the pool's connections in use for the decoder, until the push ends or it goes unused
        self._holding = pool is not None and pool.try_hold(self._ep)
        taken = pool.take(self._ep) if self._holding else None
        self.reused = taken is not None  # an idle connection from `pool`, not a dial
        self._since = taken[1] if taken else None
        if pool is not None and not self._holding:
            dialing = _none  # every connection the pool may use for it is in use: the push waits for one
        elif taken:
            dialing = functools.partial(_ready, taken[0])
        elif pool is not None:
            dialing = functools.partial(pool.dial, self._ep)
        else:
            dialing = functools.partial(dial, host, port, stall_s, tls, server_name)
        self._let_go_done = False
        self._closed = False  # `close` was called: never hand the connection out
        self._task = spawn(self._hold(dialing))
        # "used", "unused" (expired or closed), "failed" (the dial) or "busy" (none free), once settled
        self.outcome = ""
        if taken:  # cancelled before it even ran (`close` at once): the pooled connection goes back
            self._task.add_done_callback(lambda t: t.cancelled() and self._let_go(taken[0]))
        self._task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task) -> None:
        """Not handed to a push: the pool's count of connections in use lets it go (a push that took
        it lets it go when it ends)."""
        if self._holding and (task.cancelled() or task.result() is None):
            self._holding = False
            self._pool.let_go(self._ep)

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

    async def _hold(self, dialing: Callable[[], Awaitable[Connection | None]]) -> Connection | None:
        try:
            conn = await dialing()
        except KVTransferError:
            self.outcome = "failed"
            return None
        if conn is None:
            self.outcome = "busy"
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
        # closed while dialing: Python 3.11's wait_for loses a cancellation that meets a finished dial
        if self._closed or not self._wanted.is_set():
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
        self._closed = True
        if not self._task.done():
            self._wanted.set()  # wakes a wait that outlived its cancellation
            self._task.cancel()
            self.outcome = self.outcome or "unused"

    @property
    def settled(self) -> bool:
        """Used, closed, or failed to dial: it holds no connection for the push any more."""
        return self._task.done()


async def _ready(conn: Connection) -> Connection:
    return conn


async def _none() -> None:
    return None
