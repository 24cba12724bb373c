"""Links that carry KV: the WAN line, shared by every transfer on it, and in-DC paths.

`SharedLink` (the WAN) is a processor-sharing model of TCP fair share: the n flows in flight
each get bandwidth(t) / n. Every change (a flow starts or ends, the bandwidth swings) settles
the bytes moved so far and schedules the next completion; a stale completion (one scheduled
before a later change) is recognised by its version and ignored. A flow's last byte then pays
the one-way delay plus a uniform jitter in [0, jitter_ms]: the receiver has it at that time.
A zero-byte send (a "done" frame, a token-id handoff, an ack) pays the delay alone. A flow can
be cancelled while on the line (a KV its decoder no longer needs): the others share the rate.

`BandwidthSchedule` gives the WAN's swings: piecewise-constant bandwidth, either flat, a
square wave (`square`: nominal, then `low` x nominal, `period_s` each) or a seeded random walk
(`random_walk`: every `step_s` the factor moves by up to `step` within [`low`, 1]).

`DirectLink` (in-DC RDMA / loopback) gives every transfer the full rate: in-DC paths are not
the bottleneck the report is about, and each prefill has its own NIC.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from sim.events import EventLoop

BYTES_PER_MS_PER_MBPS = 125.0


@dataclass(frozen=True)
class BandwidthSchedule:
    mbps: float
    swing: str = "none"  # none | square | random_walk
    low: float = 1.0  # lowest share of the nominal bandwidth
    period_s: float = 10.0  # square: length of each half; random_walk: step length
    step: float = 0.2  # random_walk: largest move of the factor per step
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mbps <= 0 or not 0 < self.low <= 1 or self.period_s <= 0:
            raise ValueError(f"bandwidth schedule needs mbps > 0, 0 < low <= 1, period_s > 0: {self}")
        if self.swing not in ("none", "square", "random_walk"):
            raise ValueError(f"swing {self.swing!r} must be none, square or random_walk")

    def segments(self, horizon_ms: float) -> list[tuple[float, float]]:
        """(start_ms, mbps) pieces covering [0, horizon_ms]."""
        if self.swing == "none":
            return [(0.0, self.mbps)]
        period = self.period_s * 1000.0
        n = int(horizon_ms // period) + 1
        if self.swing == "square":
            return [(k * period, self.mbps * (1.0 if k % 2 == 0 else self.low)) for k in range(n)]
        rng, factor, out = random.Random(f"{self.seed}:wan"), 1.0, []
        for k in range(n):
            out.append((k * period, self.mbps * factor))
            factor = min(1.0, max(self.low, factor + rng.uniform(-self.step, self.step)))
        return out


class SharedLink:
    def __init__(
        self,
        loop: EventLoop,
        schedule: BandwidthSchedule,
        delay_ms: float,
        jitter_ms: float = 0.0,
        horizon_ms: float = 3_600_000.0,
        seed: int = 0,
        on_active: Callable[[bool], None] | None = None,
    ) -> None:
        self.loop, self.delay_ms, self.jitter_ms = loop, delay_ms, jitter_ms
        self.on_active = on_active  # told whether any flow is in flight, whenever that may change
        self._rng = random.Random(f"{seed}:jitter")
        self._flows: dict[int, list] = {}  # id -> [bytes left, on_done, nbytes, started]
        self._ids = 0
        self._version = 0
        self._settled_at = 0.0
        self.bytes_sent = 0
        self.mbps = schedule.mbps
        for start, mbps in schedule.segments(horizon_ms)[1:]:
            loop.at(start, self._set_bandwidth, mbps)

    @property
    def active(self) -> int:
        return len(self._flows)

    def send(self, nbytes: int, on_done: Callable[[float, float], None]) -> int | None:
        """Move `nbytes`; `on_done(arrival_ms, seconds_in_flight)` runs when the receiver has them.
        Returns the flow's id (None for a zero-byte send), which `cancel` takes."""
        self.bytes_sent += nbytes
        if nbytes <= 0:
            self._deliver(on_done, self.loop.now)
            return None
        self._settle()
        self._ids += 1
        self._flows[self._ids] = [float(nbytes), on_done, nbytes, self.loop.now]
        self._reschedule()
        return self._ids

    def cancel(self, flow: int | None) -> float | None:
        """Stop a flow still on the line: its `on_done` never runs, its fair share goes to the others.
        Returns the bytes it had left (not sent after all), or None when it is no longer on the line."""
        if flow not in self._flows:
            return None
        self._settle()
        left = max(self._flows.pop(flow)[0], 0.0)
        self.bytes_sent -= round(left)
        self._reschedule()
        return left

    def _deliver(self, on_done: Callable[[float, float], None], started: float) -> None:
        lag = self.delay_ms + (self._rng.uniform(0.0, self.jitter_ms) if self.jitter_ms else 0.0)
        self.loop.after(lag, lambda: on_done(self.loop.now, (self.loop.now - started) / 1000.0))

    def _rate(self) -> float:
        return self.mbps * BYTES_PER_MS_PER_MBPS / max(len(self._flows), 1)

    def _settle(self) -> None:
        moved = (self.loop.now - self._settled_at) * self._rate() if self._flows else 0.0
        self._settled_at = self.loop.now
        for flow in self._flows.values():
            flow[0] -= moved

    def _reschedule(self) -> None:
        if self.on_active is not None:
            self.on_active(bool(self._flows))
        self._version += 1
        if self._flows:
            left = min(f[0] for f in self._flows.values())
            self.loop.after(max(left, 0.0) / self._rate(), self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._settle()
        slack = self._rate() * 1e-6  # what a flow moves in a nanosecond: below the clock's resolution
        done = [k for k, f in self._flows.items() if f[0] <= max(1e-6 * f[2], slack) + 1e-9]
        for k in done:
            _, on_done, _, started = self._flows.pop(k)
            self._deliver(on_done, started)
        self._reschedule()

    def _set_bandwidth(self, mbps: float) -> None:
        self._settle()
        self.mbps = mbps
        self._reschedule()


class DirectLink:
    """Full rate for every transfer (in-DC), plus a fixed delay."""

    def __init__(self, loop: EventLoop, mbps: float, delay_ms: float = 0.0) -> None:
        if mbps <= 0 or math.isnan(mbps):
            raise ValueError(f"in-DC link needs mbps > 0, got {mbps!r}")
        self.loop, self.mbps, self.delay_ms = loop, mbps, delay_ms
        self.bytes_sent = 0

    def send(self, nbytes: int, on_done: Callable[[float, float], None]) -> None:
        self.bytes_sent += nbytes
        dt = max(nbytes, 0) / (self.mbps * BYTES_PER_MS_PER_MBPS) + self.delay_ms
        started = self.loop.now
        self.loop.after(dt, lambda: on_done(self.loop.now, (self.loop.now - started) / 1000.0))
