"""The WAN emulator: the line between datacenter A and B, as a set of TCP port forwards.

Every connection between the two sites crosses it: prefill's KV pushes to the decoders in B
(A dials) and B's NATS server joining A's (B dials). It is not an open relay: each listen port
forwards to the one endpoint the topology names for it (`Forward`), nothing else.

Lifecycle of one connection through the line:
1. The dialing site connects to the forward's listen port; one round trip later (TCP's
   handshake, which the line charges since it accepted the dialer at once) the line connects to
   its upstream (a refused or unreachable upstream resets the dialer). Bytes the dialer sent
   meanwhile wait in its socket.
2. Each direction, chunk by chunk (<= 64 KiB): wait out a stall or an outage; take the bytes
   from that direction's ONE token bucket (its rate follows the swing: none / schedule /
   random_walk); add the one-way delay +- jitter (never reordering); write them on. Bytes are
   counted per forward and direction. The line never looks inside: TLS runs end to end.
3. EOF on one side is forwarded as a half-close; the connection ends when both directions have
   ended, or at once (both sockets reset) on an error, a `drop`, or `stop`.

Control at any time: in process (`control(WanControl)`) or over NATS on
`pdd.wanlink.<name>.control` (WanControl -> WanState), per direction or both: bandwidth,
delay, jitter, a timed stall, down / up, and drop (cut every connection now).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from services.wanlink.line import Gate, Line
from services.wanlink.proxy import Connection, Recorder
from services.wanlink.shaper import control_error
from shared import subjects
from shared.bus import Bus
from shared.config import WanConfig
from shared.kv_transport import reset
from shared.messages import WanControl, WanState

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Forward:
    """A listen port of the line and the one endpoint it reaches; `dialer_dc` is the site whose
    connections arrive on it (A for a KV push to a decoder in B)."""

    name: str
    dialer_dc: str
    upstream: tuple[str, int]
    port: int = 0


class WanLink:
    def __init__(self, cfg: WanConfig, forwards: list[Forward], bus: Bus | None = None) -> None:
        self.cfg = cfg
        self.forwards = forwards
        self.bus = bus
        self.lines: dict[str, Line] = {}
        self.gates: dict[str, Gate] = {f.name: Gate() for f in forwards}  # faults of one forward only
        self.ports: dict[str, int] = {}
        self.accepted: Counter[str] = Counter()
        self._servers: list[asyncio.Server] = []
        self._conns: set[Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._stopping = False
        self.recorder: Recorder | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1") -> dict[str, int]:
        """Listen on every forward's port (0 = a free one); returns name -> port."""
        self.lines = Line.pair(self.cfg, asyncio.get_running_loop().time())  # validates cfg
        for fwd in self.forwards:
            server = await asyncio.start_server(lambda r, w, f=fwd: self._serve(f, r, w), host, fwd.port)
            self._servers.append(server)
            self.ports[fwd.name] = server.sockets[0].getsockname()[1]
        if self.bus is not None:
            await self.bus.serve(subjects.wan_control(self.cfg.name), WanControl, self.on_control)
        return dict(self.ports)

    async def stop(self) -> None:
        """Close the listeners and every connection. The bus stays the caller's to close."""
        self._stopping = True
        for server in self._servers:
            server.close()
        self.drop()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for gate in [*(line.gate for line in self.lines.values()), *self.gates.values()]:
            gate.close()

    # -- control ---------------------------------------------------------------------------
    async def on_control(self, msg: WanControl) -> WanState:
        return self.control(msg)

    def control(self, msg: WanControl) -> WanState:
        """Apply a change (nothing of it when any part is invalid); returns the state after."""
        if not (error := control_error(msg)) and msg.forward and msg.forward not in self.gates:
            error = f"no forward {msg.forward!r}; forwards: {sorted(self.gates)}"
        if not error and msg.capture and not self.cfg.capture_dir:
            error = "capture needs wan.capture_dir in the config"
        if error:
            log.warning("wan %s: refused control %s: %s", self.cfg.name, msg, error)
            return self.state(error)
        lines = list(self.lines.values()) if msg.direction == "both" else [self.lines[msg.direction]]
        for line in lines:
            line.set(msg.bandwidth_mbps, msg.delay_ms, msg.jitter_ms)
        for gate in [self.gates[msg.forward]] if msg.forward else [line.gate for line in lines]:
            if msg.stall_s:
                gate.stall(msg.stall_s)
            if msg.down is not None:
                gate.set_down(msg.down)
        if msg.drop:
            self.drop(msg.forward)
        if msg.capture is not None:
            self.capture(msg.capture)
        if msg != WanControl():
            log.info("wan %s: %s -> %s", self.cfg.name, msg, self.describe())
        return self.state()

    def capture(self, on: bool) -> None:
        """Record what crosses from now on, as tcpdump on the line would see it (no decryption)."""
        if on and not self.cfg.capture_dir:
            raise ValueError("capture needs wan.capture_dir")
        self.recorder = Recorder(Path(self.cfg.capture_dir)) if on else None
        for conn in self._conns:
            conn.recorder = self.recorder

    def drop(self, forward: str = "") -> int:
        """Cut every open connection (of `forward`) now: both ends get a reset. Returns how many."""
        conns = [c for c in self._conns if not forward or c.forward == forward]
        for conn in conns:
            conn.abort()
        return len(conns)

    def state(self, error: str = "") -> WanState:
        now = asyncio.get_running_loop().time()
        open_now = Counter(c.forward for c in self._conns)
        return WanState(
            self.cfg.name,
            lines={d: line.state(now) for d, line in self.lines.items()},
            forwards=dict(self.ports),
            connections=dict(open_now),
            accepted=dict(self.accepted),
            error=error,
        )

    def describe(self) -> str:
        """The settings in one line, for logs."""
        s = self.state()
        return "; ".join(
            f"{d} {ls.bandwidth_mbps:g} Mbps, {ls.delay_ms:g} +- {ls.jitter_ms:g} ms" + (" DOWN" if ls.down else "")
            for d, ls in s.lines.items()
        )

    # -- connections -----------------------------------------------------------------------
    async def _serve(self, fwd: Forward, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        self.accepted[fwd.name] += 1
        try:
            await self._proxy(fwd, reader, writer)
        except asyncio.CancelledError:
            pass  # `stop` ended it; ending quietly keeps asyncio's stream callback from logging it
        finally:
            self._handlers.discard(task)

    async def _proxy(self, fwd: Forward, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        out = "a-b" if fwd.dialer_dc == self.cfg.src_dc else "b-a"
        back = "b-a" if out == "a-b" else "a-b"
        # TCP's handshake: across a real WAN the dialer's connect returns one round trip after its
        # SYN. Here it was accepted at once, so the connection opens a round trip later instead.
        await asyncio.sleep((self.lines[out].delay_ms + self.lines[back].delay_ms) / 1e3)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                up = await asyncio.open_connection(*fwd.upstream)
        except (OSError, TimeoutError) as e:
            log.warning("wan %s: %s cannot reach %s: %s", self.cfg.name, fwd.name, fwd.upstream, e)
            reset(writer)
            return
        if self._stopping:
            reset(writer)
            reset(up[1])
            return
        conn = Connection(
            fwd.name,
            self.lines[out],
            self.lines[back],
            self.gates[fwd.name],
            (reader, writer),
            up,
            self.cfg.write_stall_s,
        )
        conn.recorder = self.recorder
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)


def forwards_of(cfg) -> list[Forward]:
    """The forwards a cluster config names (shared.config.ClusterConfig.wan_forwards)."""
    return [
        Forward(name, dialer, upstream, cfg.wan.ports.get(name, 0)) for name, dialer, upstream in cfg.wan_forwards()
    ]
