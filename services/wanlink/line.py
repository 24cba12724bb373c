"""One direction of the emulated line (A -> B or B -> A), shared by every connection on it.

It owns the direction's rate (a `BandwidthProfile` and ONE `TokenBucket`, so connections
share the bandwidth chunk by chunk), its one-way delay and jitter, its gate (a timed stall, or
down until told otherwise) and its byte counts per forward. A chunk waits at the gate, then
for its bytes to go through, then for the delay, as a packet on a real shared line would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

from services.wanlink.shaper import MBPS, BandwidthProfile, TokenBucket, one_way_delay
from shared.config import WanConfig
from shared.messages import LineState

CHUNK = 64 * 1024  # big transfers interleave with others at this grain
BURST_S = 0.005  # idle credit: 5 ms of traffic (or one chunk), so event-loop lag costs no rate


class Gate:
    """Open unless a stall is on or the line is down; while shut, every pipe on it waits."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._timer: asyncio.TimerHandle | None = None
        self.until = 0.0
        self.down = False

    @property
    def shut(self) -> bool:
        return not self._open.is_set()

    def stall(self, seconds: float) -> None:
        """Stop forwarding for `seconds` from now (extends a stall already on, never shortens it)."""
        loop = asyncio.get_running_loop()
        self.until = max(self.until, loop.time() + seconds)
        if self._timer is not None:
            self._timer.cancel()
        self._open.clear()
        self._timer = loop.call_at(self.until, self._reopen)

    def set_down(self, down: bool) -> None:
        self.down = down
        if down:
            self._open.clear()
        else:
            self._reopen()

    def _reopen(self) -> None:
        if not self.down and asyncio.get_running_loop().time() >= self.until:
            self._open.set()

    async def wait(self) -> None:
        await self._open.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.down = False
        self._open.set()


class Line:
    def __init__(self, cfg: WanConfig, start: float, name: str = "a-b") -> None:
        self.name = name
        self.profile = BandwidthProfile(cfg)  # validates cfg
        self.delay_ms, self.jitter_ms = float(cfg.delay_ms), float(cfg.jitter_ms)
        self.gate = Gate()
        self.bytes: Counter[str] = Counter()  # forward -> bytes carried
        self._start = start
        self._rng = random.Random(f"{cfg.seed}:{cfg.name}:jitter")
        self._bucket = TokenBucket(CHUNK, start, BURST_S)

    @classmethod
    def pair(cls, cfg: WanConfig, start: float) -> dict[str, Line]:
        """The two directions: A -> B with the config's settings, B -> A with `reverse` on top."""
        try:  # its own jitter draws unless `reverse` names a seed
            back = dataclasses.replace(cfg, **{"seed": cfg.seed + 1, **cfg.reverse})
        except TypeError as e:  # a misspelt setting: a config error, not a crash
            raise ValueError(f"wan {cfg.name!r}: bad reverse settings {cfg.reverse!r}: {e}") from None
        return {"a-b": cls(cfg, start, "a-b"), "b-a": cls(back, start, "b-a")}

    def mbps(self, now: float) -> float:
        return self.profile.mbps(now - self._start)

    async def carry(self, forward: str, nbytes: int) -> float:
        """Wait at the gate and for the bytes to go through; returns the one-way delay they take."""
        await self.gate.wait()
        loop = asyncio.get_running_loop()
        wait = self._bucket.reserve(nbytes, self.mbps(loop.time()) * MBPS, loop.time())
        if wait > 0:
            await asyncio.sleep(wait)
        self.bytes[forward] += nbytes
        return one_way_delay(self.delay_ms / 1e3, self.jitter_ms / 1e3, self._rng)

    def set(self, bandwidth_mbps: float | None, delay_ms: float | None, jitter_ms: float | None) -> None:
        if bandwidth_mbps is not None:
            self.profile.pin(bandwidth_mbps)
        self.delay_ms = self.delay_ms if delay_ms is None else float(delay_ms)
        self.jitter_ms = self.jitter_ms if jitter_ms is None else float(jitter_ms)

    def state(self, now: float) -> LineState:
        return LineState(
            bandwidth_mbps=round(self.mbps(now), 3),
            delay_ms=self.delay_ms,
            jitter_ms=self.jitter_ms,
            down=self.gate.down,
            stalled=self.gate.shut and not self.gate.down,
            bytes=sum(self.bytes.values()),
            bytes_by_forward=dict(self.bytes),
        )
