"""What the policy plans with: per-instance figures, time estimates, and the live WAN bandwidth.

Plain arithmetic on plain figures. No I/O and no clock: callers pass times in.
Units: milliseconds, tokens, bytes, megabits per second (1 Mbps = 125,000 B/s).

Time to first token (TTFT) of a pipeline. Prefill samples the first token, but it travels with
the KV, so the user sees it when the first decoder of the pipeline has the KV and steps once:

    p-md      prefill + WAN transfer of what MD lacks    + MD queue  + one MD step
    p-rld-md  prefill + in-DC transfer of what RLD lacks + RLD queue + one RLD step
    p-rld     as p-rld-md

- prefill: (uncached prompt tokens + tokens already queued on that instance) / its tok/s.
- transfer: `kv_bytes_per_token * (prompt_len - decoder_hit)` / bandwidth + one-way delay; the
  link is the WAN when prefill and decoder sit in different datacenters, in-DC otherwise. On
  the WAN a transfer also waits for the line's backlog (`wan_backlog_bytes`: KV dispatched
  across it that has not landed) / bandwidth: it finishes no sooner than everything ahead of it.
  A decoder that lacks nothing sends no KV and waits for none.
- extend (main-decode's suffix path, `computes`): it computes what it lacks itself, so only the
  transfer's header crosses (the one-way delay, no bytes, no backlog) and its extend of those
  tokens (`extend_ms`, at its own prefill throughput) comes before its first step; the policy
  takes that path when `extend_ms` beats `push_ms` (policy.py `choose_suffix`).
- queue: each request waiting on the decoder costs about one step (the step that admits it).
  `running` enters through the measured step time: a bigger batch steps slower.
Measured figures (`step_ms`, `prefill_tok_s`: moving averages each engine keeps of its own steps,
with `queued_tokens`, carried by its heartbeat) win over the configured priors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Protocol

from shared.pipelines import Pipeline, Role, first_decoder

BYTES_PER_MBIT_PER_MS = 125.0  # 1 Mbps moves 125 bytes per millisecond


@dataclass(frozen=True)
class InstanceView:
    """One alive instance as the policy sees it (from its last heartbeat and the prefix index).
    An instance that missed its heartbeats has expired from the registry and is simply absent."""

    id: str
    role: Role
    dc: str
    occupancy: float = 0.0  # a view without pool or queue figures (a bare test or simulator view): this
    hit_tokens: int = 0  # prefix of this request the instance holds (from the Redis index)
    running: int = 0
    waiting: int = 0
    pending: int = 0  # decoders: requests committed to it whose KV has not landed yet
    held: int = 0  # requests it holds, plus those dispatched since its last heartbeat
    capacity: int = 0  # most requests it accepts; 0 = unbounded
    free_blocks: int = 0
    total_blocks: int = 0  # 0 = unknown (then `load` stands in for the KV pool figures)
    block_size: int = 16
    queued_tokens: int = 0  # prefill: prompt tokens accepted and not yet computed
    step_ms: float | None = None  # decoders: measured decode step; None = use the prior
    prefill_tok_s: float | None = None  # measured prefill throughput (a decoder's: its extends); None = use the prior
    dtype: str = "float32"  # its weights' and KV's (the suffix path needs prefill's and main-decode's alike)


class Priors(Protocol):
    """The configured figures the estimates fall back on (`PolicyConfig` provides them)."""

    kv_bytes_per_token: int
    prefill_tok_s: float
    decode_step_ms: float
    local_mbps: float
    wan_delay_ms: float


@dataclass(frozen=True)
class Link:
    mbps: float
    delay_ms: float = 0.0  # one way


def transfer_ms(tokens: int, kv_bytes_per_token: int, link: Link) -> float:
    """Time to move `tokens` tokens of KV over `link`; the delay is paid even for zero bytes
    (the "done" frame that carries the first token still has to cross)."""
    nbytes = max(tokens, 0) * kv_bytes_per_token
    return nbytes / (link.mbps * BYTES_PER_MBIT_PER_MS) + link.delay_ms


def prefill_ms(uncached_tokens: int, queued_tokens: int, tok_s: float) -> float:
    """Compute this request's uncached tokens after the ones already queued on the instance."""
    return (max(uncached_tokens, 0) + max(queued_tokens, 0)) / tok_s * 1000.0


def push_ms(tokens: int, kv_bytes_per_token: int, wan: Link, wan_backlog_bytes: float = 0.0) -> float:
    """Line time of pushing `tokens` tokens of KV across the WAN, behind the KV already on it; the
    one-way delay is left out: a transfer without KV (its header and the first token) pays it too."""
    if tokens <= 0:
        return 0.0
    return (tokens * kv_bytes_per_token + max(wan_backlog_bytes, 0.0)) / (wan.mbps * BYTES_PER_MBIT_PER_MS)


def extend_ms(tokens: int, decoder: InstanceView, priors: Priors) -> float:
    """A decoder computing `tokens` prompt tokens itself, in one extend at its prefill throughput."""
    return prefill_ms(tokens, 0, tok_s_of(decoder, priors))


def decode_queue_ms(waiting: int, step_ms: float) -> float:
    return max(waiting, 0) * step_ms


def step_ms_of(view: InstanceView, priors: Priors) -> float:
    return view.step_ms if view.step_ms else priors.decode_step_ms


def tok_s_of(view: InstanceView, priors: Priors) -> float:
    return view.prefill_tok_s if view.prefill_tok_s else priors.prefill_tok_s


@dataclass(frozen=True)
class TTFTEstimate:
    prefill_ms: float
    transfer_ms: float
    queue_ms: float
    step_ms: float
    extend_ms: float = 0.0  # the decoder computing what it lacks (the suffix path)

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.transfer_ms + self.extend_ms + self.queue_ms + self.step_ms


FIRST_DECODER = {p: first_decoder(p) for p in Pipeline}


def estimate_ttft(
    pipeline: str,
    prompt_len: int,
    prefill: InstanceView,
    decoder: InstanceView,
    priors: Priors,
    wan: Link,
    wan_backlog_bytes: float = 0.0,
    computes: bool = False,
) -> TTFTEstimate:
    """TTFT of `pipeline` with these instances; `decoder` is the one that streams first (MD for
    p-md, RLD otherwise). `wan` is the live link estimate (see `BandwidthEstimator`);
    `wan_backlog_bytes` the KV already on it, which a transfer across it waits for. `computes`:
    the decoder computes what it lacks itself (the suffix path), none of its KV is pushed."""
    if decoder.role != FIRST_DECODER[pipeline]:
        raise ValueError(f"{pipeline}: first decoder must be {FIRST_DECODER[pipeline]}, got {decoder.role}")
    across = decoder.dc != prefill.dc
    link = wan if across else Link(priors.local_mbps)
    lacking = prompt_len - min(decoder.hit_tokens, prompt_len)
    pushed = 0 if computes else lacking
    behind = max(wan_backlog_bytes, 0.0) / (wan.mbps * BYTES_PER_MBIT_PER_MS) if across and pushed > 0 else 0.0
    step = step_ms_of(decoder, priors)
    return TTFTEstimate(
        prefill_ms=prefill_ms(prompt_len - prefill.hit_tokens, prefill.queued_tokens, tok_s_of(prefill, priors)),
        transfer_ms=transfer_ms(pushed, priors.kv_bytes_per_token, link) + behind,
        queue_ms=decode_queue_ms(decoder.waiting, step),
        step_ms=step,
        extend_ms=extend_ms(lacking, decoder, priors) if computes else 0.0,
    )


class BandwidthEstimator:
    """Live WAN bandwidth from finished transfers: the median rate of the most recent samples.

    Fed `(bytes, seconds, at)` per finished WAN transfer (the scheduler takes `wan_kv_bytes` and
    `timings_ms.kv_wan` from the `pdd` stats of finished requests). The median, not a mean: the
    link swings and one stalled transfer (the report saw 1-20 s) must not swing the plans.
    - The one-way delay is taken off each sample; a sample whose time is mostly that delay
      (or that moved fewer than `min_bytes`) says nothing about bandwidth and is ignored.
    - Samples older than `max_age_s` give way to fresher ones, but stale knowledge of the link
      still beats the prior; the prior is used only until the first sample.
    - Concurrent transfers share the link, so each sample is the share a new request would get.
    """

    def __init__(
        self,
        prior_mbps: float,
        delay_ms: float = 0.0,
        window: int = 16,
        max_age_s: float = 120.0,
        min_bytes: int = 1 << 20,
    ) -> None:
        if prior_mbps <= 0 or window < 1:
            raise ValueError(f"prior_mbps > 0 and window >= 1 required, got {prior_mbps}, {window}")
        self.prior_mbps = prior_mbps
        self.delay_ms = delay_ms
        self.max_age_s = max_age_s
        self.min_bytes = min_bytes
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (at, mbps), oldest first

    def add(self, nbytes: int, seconds: float, at: float) -> bool:
        """Record one transfer; False when it was ignored (too small, or latency-dominated)."""
        moving_ms = seconds * 1000.0 - self.delay_ms
        if nbytes < self.min_bytes or moving_ms <= self.delay_ms:
            return False
        self._samples.append((at, nbytes / moving_ms / BYTES_PER_MBIT_PER_MS))
        return True

    def mbps(self, now: float) -> float:
        if not self._samples:
            return self.prior_mbps
        fresh = [mbps for at, mbps in self._samples if now - at <= self.max_age_s]
        return median(fresh or [mbps for _, mbps in self._samples])

    def __len__(self) -> int:
        return len(self._samples)
