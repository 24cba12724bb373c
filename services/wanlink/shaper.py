"""Pure shaping arithmetic for the WAN link: no sockets, no clock (callers pass `now`).

- `BandwidthProfile`: the link's rate over time: fixed, a repeating step schedule, or a seeded
  random walk (WanConfig.swing); `pin()` fixes it at a rate set at run time.
- `TokenBucket`: ONE per direction of the line, shared by every connection: each chunk reserves its bytes and
  waits until they have gone through. Reservations are served in call order, so connections
  that reserve one chunk at a time take turns (round robin by chunk).
- `DelayLine`: one per connection direction: when a chunk is due at the far end (one-way delay
  plus jitter), never before the chunk ahead of it, so bytes are never reordered.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from shared.config import WanConfig
from shared.messages import WanControl

MBPS = 1e6 / 8  # bytes per second in one Mbps (1 Mbps = 1e6 bits/s)
SWINGS = ("none", "schedule", "random_walk")
DIRECTIONS = ("both", "a-b", "b-a")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def check_config(cfg: WanConfig) -> None:
    """Raise ValueError naming the first bad setting of a WAN config."""
    where = f"wan {cfg.name!r}"
    if cfg.swing not in SWINGS:
        raise ValueError(f"{where}: swing {cfg.swing!r} is not one of {SWINGS}")
    if not _positive(cfg.bandwidth_mbps):
        raise ValueError(f"{where}: bandwidth_mbps must be > 0, got {cfg.bandwidth_mbps!r}")
    for name in ("delay_ms", "jitter_ms"):
        if not _non_negative(getattr(cfg, name)):
            raise ValueError(f"{where}: {name} must be >= 0, got {getattr(cfg, name)!r}")
    if cfg.swing == "schedule":
        if not cfg.schedule:
            raise ValueError(f"{where}: swing 'schedule' needs a non-empty schedule of (seconds, mbps)")
        for t, mbps in cfg.schedule:
            if not _non_negative(t) or not _positive(mbps):
                raise ValueError(f"{where}: schedule point ({t!r}, {mbps!r}) needs seconds >= 0 and mbps > 0")
    if cfg.swing == "random_walk":
        lo, hi = cfg.walk_min_mbps, cfg.walk_max_mbps
        if not (_positive(lo) and _positive(hi) and lo <= hi):
            raise ValueError(f"{where}: need 0 < walk_min_mbps <= walk_max_mbps, got {lo!r}, {hi!r}")
        if not _non_negative(cfg.walk_step):
            raise ValueError(f"{where}: walk_step must be >= 0, got {cfg.walk_step!r}")


def control_error(msg: WanControl) -> str:
    """Why a WanControl cannot be applied ("" when it can). Nothing is applied on an error."""
    if msg.direction not in DIRECTIONS:
        return f"direction must be one of {DIRECTIONS}, got {msg.direction!r}"
    if msg.forward and (msg.bandwidth_mbps, msg.delay_ms, msg.jitter_ms) != (None, None, None):
        return "bandwidth, delay and jitter belong to the line, not to one forward"
    if msg.bandwidth_mbps is not None and not _positive(msg.bandwidth_mbps):
        return f"bandwidth_mbps must be a finite number > 0, got {msg.bandwidth_mbps!r}"
    for name in ("delay_ms", "jitter_ms", "stall_s"):
        value = getattr(msg, name)
        if value is not None and not _non_negative(value):
            return f"{name} must be a finite number >= 0, got {value!r}"
    return ""


def schedule_mbps(points: Sequence[tuple[float, float]], t: float, base: float) -> float:
    """The rate `t` seconds after start under a repeating step schedule.

    Each (t_i, mbps_i) sets the rate from t_i until the next point. The last point's rate holds
    as long as the gap before it, then the pattern repeats: [(0, 1000), (5, 100)] alternates
    every 5 s. Before the first point (when it is > 0) the base rate holds, in every cycle.
    A single point is a step from the base rate to it, once.
    """
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1] if t >= pts[0][0] else base
    period = pts[-1][0] + (pts[-1][0] - pts[-2][0])
    tau = t % period if period > 0 else t
    rate = base
    for t_i, mbps in pts:
        if t_i > tau:
            break
        rate = mbps
    return rate


class RandomWalk:
    """A seeded multiplicative walk, one value per whole second, clamped to [lo, hi].

    Each second the rate is multiplied by (1 + step) ** u, u uniform in [-1, 1] (symmetric in
    log space). Values are drawn in order, so second k is the same whatever is queried first
    (asking for an earlier second than the last replays the walk from its seed).
    """

    def __init__(self, start: float, step: float, lo: float, hi: float, seed: int) -> None:
        self.start, self.step, self.lo, self.hi, self.seed = start, step, lo, hi, seed
        self._rewind()

    def _rewind(self) -> None:
        self._rng = random.Random(f"{self.seed}:walk")
        self._k, self._value = 0, self._clamp(self.start)

    def _clamp(self, mbps: float) -> float:
        return min(self.hi, max(self.lo, mbps))

    def mbps(self, t: float) -> float:
        k = max(0, int(t))
        if k < self._k:
            self._rewind()
        while self._k < k:
            self._value = self._clamp(self._value * (1 + self.step) ** self._rng.uniform(-1, 1))
            self._k += 1
        return self._value


class BandwidthProfile:
    """The link's rate in Mbps as a function of seconds since the link started."""

    def __init__(self, cfg: WanConfig) -> None:
        check_config(cfg)
        self.swing = cfg.swing
        self.base = float(cfg.bandwidth_mbps)
        self.schedule = tuple(cfg.schedule)
        self._walk = RandomWalk(cfg.bandwidth_mbps, cfg.walk_step, cfg.walk_min_mbps, cfg.walk_max_mbps, cfg.seed)

    def pin(self, mbps: float) -> None:
        """A rate set at run time wins: the swing stops and the link stays at `mbps`."""
        self.swing = "none"
        self.base = float(mbps)

    def mbps(self, t: float) -> float:
        if self.swing == "schedule":
            return schedule_mbps(self.schedule, t, self.base)
        if self.swing == "random_walk":
            return self._walk.mbps(t)
        return self.base


class TokenBucket:
    """Bytes through one link at a (possibly changing) rate, with a little credit for idle time.

    A reservation may overdraw the bucket; the debt is what earlier reservations still have to
    send, so each caller waits for everything reserved before it (FIFO). The credit, at most
    max(burst_bytes, burst_s of traffic at the current rate), absorbs the callers' oversleeping
    and event-loop lag, so the long-run rate stays at the cap even at high rates.
    """

    def __init__(self, burst_bytes: float, now: float, burst_s: float = 0.0) -> None:
        self.burst_bytes = float(burst_bytes)
        self.burst_s = burst_s
        self.tokens = float(burst_bytes)
        self.last = now
        self.rate = 0.0  # the rate since `last` (the one given by the latest reservation)

    def reserve(self, nbytes: int, rate_bytes_s: float, now: float) -> float:
        """Take `nbytes` at `rate_bytes_s` (the rate from now on); returns the seconds until they
        have gone through, assuming the rate holds (a later change is paid by later callers)."""
        if now > self.last:
            cap = max(self.burst_bytes, self.rate * self.burst_s)
            self.tokens = min(cap, self.tokens + (now - self.last) * self.rate)
            self.last = now
        self.rate = rate_bytes_s
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / rate_bytes_s


def one_way_delay(delay_s: float, jitter_s: float, rng: random.Random) -> float:
    """delay +- uniform jitter, never negative."""
    if jitter_s <= 0:
        return delay_s
    return max(0.0, delay_s + rng.uniform(-jitter_s, jitter_s))


class DelayLine:
    """Arrival times of the chunks of one connection direction, in order."""

    def __init__(self) -> None:
        self.last_due = -math.inf

    def due(self, sent_at: float, delay_s: float) -> float:
        """When a chunk that left at `sent_at` arrives: after `delay_s`, never before its predecessor."""
        self.last_due = max(self.last_due, sent_at + delay_s)
        return self.last_due
