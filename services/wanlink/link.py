"""The WAN emulator: a TCP proxy for the KV plane A -> B over a shaped, faultable link.

Lifecycle of one KV connection through the link:
1. Prefill (A) connects to the link's listen port and sends one ROUTE frame
   {host, port, request_id} (shared.kv_transport, `send_kv(..., via=link)`).
2. The link reads it (within ROUTE_TIMEOUT_S) and connects to host:port in B. The ROUTE frame
   itself is not forwarded; a bad frame or an unreachable upstream resets the client.
3. A -> B, chunk by chunk (<= 64 KiB): wait out any stall; take the bytes from the ONE token
   bucket of the link (its rate follows the swing: none / schedule / random_walk); add the
   one-way delay +- jitter (never reordering); count them for the request id (memory, then
   Redis); write them upstream.
4. B -> A (the receiver's ACK): wait out any stall, pay the one-way delay, write back.
5. EOF on one side is forwarded as a half-close; the connection ends when both directions have
   ended, or at once (both sockets reset) on an error, a `drop`, or `stop`.

Control at any time: in process (`set`, `stall`, `drop`) or over NATS on
`pdd.wanlink.<name>.control` (WanControl -> Ack). Settings and totals are mirrored to Redis
(see ledger.py) on every change and once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import Any

from redis.asyncio import Redis

from services.wanlink.ledger import ByteLedger
from services.wanlink.proxy import CHUNK, Connection, StallGate, read_route, reset
from services.wanlink.shaper import MBPS, BandwidthProfile, TokenBucket, control_error, one_way_delay
from shared import subjects
from shared.bus import Bus
from shared.config import WanConfig
from shared.kv_transport import KVTransferError
from shared.messages import Ack, WanControl

log = logging.getLogger(__name__)

BURST_S = 0.005  # idle credit of the link: 5 ms of traffic (or one chunk), so event-loop lag costs no rate


class WanLink:
    """One emulated link. `bus` (runtime control) and `redis` (byte counts, state) are optional."""

    ROUTE_TIMEOUT_S = 10.0
    CONNECT_TIMEOUT_S = 10.0
    STATE_EVERY_S = 1.0

    def __init__(self, cfg: WanConfig, bus: Bus | None = None, redis: Redis | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.profile = BandwidthProfile(cfg)  # validates cfg
        self.delay_ms = float(cfg.delay_ms)
        self.jitter_ms = float(cfg.jitter_ms)
        self.ledger = ByteLedger(cfg.name, redis)
        self.gate = StallGate()
        self.port = 0
        self._rng = random.Random(f"{cfg.seed}:jitter")
        self._bucket = TokenBucket(CHUNK, 0.0, BURST_S)
        self._started_at: float | None = None  # loop time of start(); the swing's t = 0
        self._server: asyncio.Server | None = None
        self._conns: set[Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._state_task: asyncio.Task | None = None
        self._dirty = asyncio.Event()
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (port 0 = a free one), subscribe to control, publish state. Returns the port."""
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        self._stopping = False
        self._bucket = TokenBucket(CHUNK, loop.time(), BURST_S)
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.bus is not None:
            await self.bus.serve(subjects.wan_control(self.cfg.name), WanControl, self._on_control)
        if self.ledger.redis is not None:
            await self.ledger.publish_state(self.state(), reset_total=True)
            self._state_task = asyncio.create_task(self._publish_state())
        return self.port

    async def stop(self) -> None:
        """Close the listener and every connection. The bus and Redis stay the caller's to close."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        self.drop()
        tasks = [*self._handlers, *([self._state_task] if self._state_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.gate.close()
        if self.ledger.redis is not None:
            await self.ledger.publish_state(self.state())

    # -- control ---------------------------------------------------------------------------

    def bandwidth_mbps(self) -> float:
        """The rate right now (it moves with the swing unless pinned by `set`)."""
        return self.profile.mbps(self._elapsed(asyncio.get_running_loop().time()))

    def set(
        self, bandwidth_mbps: float | None = None, delay_ms: float | None = None, jitter_ms: float | None = None
    ) -> None:
        """Change settings (None = unchanged); a bandwidth pins the link there (the swing stops)."""
        error = control_error(WanControl(bandwidth_mbps, delay_ms, jitter_ms))
        if error:
            raise ValueError(error)
        if bandwidth_mbps is not None:
            self.profile.pin(bandwidth_mbps)
        self.delay_ms = self.delay_ms if delay_ms is None else float(delay_ms)
        self.jitter_ms = self.jitter_ms if jitter_ms is None else float(jitter_ms)
        log.info("wan %s: now %s", self.cfg.name, self.describe())
        self._dirty.set()

    def stall(self, seconds: float) -> None:
        """Stop forwarding on every connection for `seconds`; unread data waits in the senders."""
        if seconds > 0:
            self.gate.stall(seconds)
            log.info("wan %s: stalled for %.2fs", self.cfg.name, seconds)
            self._dirty.set()

    def drop(self) -> int:
        """Cut every open connection now (both ends get a reset). Returns how many."""
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        if conns:
            log.info("wan %s: dropped %d connection(s)", self.cfg.name, len(conns))
        self._dirty.set()
        return len(conns)

    def forwarded_bytes(self, request_id: str) -> int:
        """Bytes written upstream (A -> B, after the ROUTE frame) for `request_id` so far."""
        return self.ledger.forwarded(request_id)

    @property
    def total_bytes(self) -> int:
        return self.ledger.total

    @property
    def connections(self) -> int:
        return len(self._conns)

    def state(self) -> dict[str, Any]:
        return {
            "bandwidth_mbps": round(self.bandwidth_mbps(), 3),
            "delay_ms": self.delay_ms,
            "jitter_ms": self.jitter_ms,
            "connections": self.connections,
            "stalled": int(self.gate.stalled),
        }

    async def _on_control(self, msg: WanControl) -> Ack:
        error = control_error(msg)
        if error:
            log.warning("wan %s: refused control %s: %s", self.cfg.name, msg, error)
            return Ack(request_id="", ok=False, error=error)
        if (msg.bandwidth_mbps, msg.delay_ms, msg.jitter_ms) != (None, None, None):
            self.set(msg.bandwidth_mbps, msg.delay_ms, msg.jitter_ms)
        if msg.stall_s:
            self.stall(msg.stall_s)
        if msg.drop:
            self.drop()
        return Ack(request_id="", ok=True)

    # -- the Link interface for connections (see proxy.Link) -------------------------------

    async def admit(self, nbytes: int) -> None:
        now = asyncio.get_running_loop().time()
        rate = self.profile.mbps(self._elapsed(now)) * MBPS
        wait = self._bucket.reserve(nbytes, rate, now)
        if wait > 0:
            await asyncio.sleep(wait)

    def delay(self) -> float:
        return one_way_delay(self.delay_ms / 1e3, self.jitter_ms / 1e3, self._rng)

    async def account(self, request_id: str, nbytes: int) -> None:
        await self.ledger.add(request_id, nbytes)

    # -- internals -------------------------------------------------------------------------

    def _elapsed(self, now: float) -> float:
        return 0.0 if self._started_at is None else now - self._started_at

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:
            pass  # `stop` ended it; ending quietly keeps asyncio's stream callback from logging it
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            route = await read_route(reader, self.ROUTE_TIMEOUT_S)
            async with asyncio.timeout(self.CONNECT_TIMEOUT_S):
                up = await asyncio.open_connection(route.host, route.port)
        except (KVTransferError, OSError, TimeoutError, ValueError) as e:
            log.warning("wan %s: refused a connection from %s: %s", self.cfg.name, writer.get_extra_info("peername"), e)
            reset(writer)
            return
        except asyncio.CancelledError:
            reset(writer)
            raise
        if self._stopping:  # stop() came while we were connecting
            reset(writer)
            reset(up[1])
            return
        conn = Connection(self, route, (reader, writer), up)
        self._conns.add(conn)
        self._dirty.set()
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)
            self._dirty.set()

    async def _publish_state(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (stop would hang)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.STATE_EVERY_S):
                    await self._dirty.wait()
            self._dirty.clear()
            await self.ledger.publish_state(self.state())

    def describe(self) -> str:
        """The settings in one line, for logs."""
        swing = self.profile.swing
        rate = f"bandwidth {self.bandwidth_mbps():g} Mbps (swing {swing})"
        return f"{rate}, delay {self.delay_ms:g} ms +- {self.jitter_ms:g} ms"
