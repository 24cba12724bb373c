"""A burst of low-hit requests against the relay pool, stepped through the real policy.

Backs the oscillation demo: without admission control a burst piles onto the small RLD pool,
its queue grows without bound and every relayed request's TTFT grows with it; with the guard
RLD never holds more than `rld_slots` requests and the overflow takes `p-md` with its bounded
TTFT penalty. Deterministic, no threads, no clock: a plain queue model.

Model: one idle prefill and one idle MD (DC B); RLD (DC A) serves up to `rld_slots` requests at
once, each for `rld_service_ms` (its residency until handoff frees the slot); the rest wait,
first come first served. Each arrival is planned by `choose_plan` with RLD's current running /
waiting figures. TTFT of a relayed request = the policy's estimate on an idle relay + its wait
for a slot; of a `p-md` request = the policy's p-md estimate.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

from services.scheduler.policy import InstanceView, PlanRequest, PolicyConfig, choose_plan


def simulate_burst(
    n_requests: int, arrival_gap_ms: float, rld_slots: int, rld_service_ms: float, config: PolicyConfig,
    prompt_len: int = 1024, max_tokens: int = 256,
) -> dict:  # fmt: skip
    """Run the burst with the guard on and off; figures for each, plus the offered RLD load
    (arrival rate x residency / slots: above 1 the pool cannot keep up)."""
    cfg = dataclasses.replace(config, rld_slots=rld_slots, default_pipeline="auto")
    shape = (n_requests, arrival_gap_ms, rld_service_ms, prompt_len, max_tokens)
    return {
        "offered_rld_load": rld_service_ms / max(arrival_gap_ms, 1e-9) / rld_slots,
        "guard_on": _run(dataclasses.replace(cfg, guard=True), *shape),
        "guard_off": _run(dataclasses.replace(cfg, guard=False), *shape),
    }


def _fleet(running: int, waiting: int) -> list[InstanceView]:
    return [
        InstanceView("prefill-0", "prefill", "A"),
        InstanceView("rld-0", "rld", "A", running=running, waiting=waiting),
        InstanceView("md-0", "md", "B"),
    ]


def _run(cfg: PolicyConfig, n: int, gap_ms: float, service_ms: float, prompt_len: int, max_tokens: int) -> dict:
    idle = choose_plan(PlanRequest("idle", prompt_len, max_tokens, pipeline="p-rld-md"), _fleet(0, 0), cfg)
    relay_ttft = idle.estimates.ttft_ms["p-rld-md"]
    free_at = [0.0] * cfg.rld_slots  # heap: when each RLD slot frees
    admitted: list[tuple[float, float]] = []  # (start, end) of requests still on RLD
    ttfts: list[float] = []
    counts: dict[str, int] = {}
    max_queue = max_busy = 0
    for k in range(n):
        now = k * gap_ms
        admitted = [(s, e) for s, e in admitted if e > now]
        running = sum(s <= now for s, _ in admitted)
        d = choose_plan(PlanRequest(f"r{k}", prompt_len, max_tokens), _fleet(running, len(admitted) - running), cfg)
        counts[d.reason] = counts.get(d.reason, 0) + 1
        if d.pipeline == "p-md":
            ttfts.append(d.estimates.ttft_ms["p-md"])
            continue
        start = max(now, heapq.heappop(free_at))
        heapq.heappush(free_at, start + service_ms)
        admitted.append((start, start + service_ms))
        ttfts.append(relay_ttft + start - now)
        max_queue = max(max_queue, sum(s > now for s, _ in admitted))
        max_busy = max(max_busy, len(admitted))
    return {
        "max_rld_queue": max_queue,
        "max_rld_busy": max_busy,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "reasons": counts,
    }


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]
