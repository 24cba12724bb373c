"""Sizing the line as an operator would: the smallest nominal capacity whose utilisation, over
`WINDOW_S` windows, stays under `BOUND` in all but 1% of them (p99), on the line's own swings.

1. Demand: the KV bytes each request sent across the WAN, counted in the window its prefill
   ended (when its transfer starts), from a run on a line big enough not to hold anything back.
2. Capacity in a window: nominal x the line's mean factor there (`BandwidthSchedule`: the
   random walk's 25-100%, 1 when it does not swing).
3. utilisation(window) = demand / capacity, so the p99 of utilisation is under `BOUND` exactly
   when nominal >= p99(demand / (factor x window)) / BOUND: no search needed.
"""

from __future__ import annotations

import math

from benchmarks.summary import percentile
from sim.link import BandwidthSchedule
from sim.request import RequestRun

WINDOW_S = 10.0
BOUND = 0.8  # p99 of the windows' utilisation
PCT = 99.0
STEP_GBPS = 10.0  # lines are bought in whole multiples of this


def demand_per_window(runs: list[RequestRun], window_s: float = WINDOW_S) -> list[float]:
    """WAN KV bytes per window, by the time each request's transfer started (its prefill's end)."""
    out: dict[int, float] = {}
    for r in runs:
        if r.wan_bytes and "prefill_end" in r.marks:
            k = int(r.marks["prefill_end"] / 1000.0 // window_s)
            out[k] = out.get(k, 0.0) + r.wan_bytes
    span = max(out, default=-1) + 1
    return [out.get(k, 0.0) for k in range(span)]


def mean_factors(schedule: BandwidthSchedule, windows: int, window_s: float = WINDOW_S) -> list[float]:
    """The line's mean share of its nominal capacity in each window."""
    unit = BandwidthSchedule(1.0, schedule.swing, schedule.low, schedule.period_s, schedule.step, schedule.seed)
    pieces = unit.segments(windows * window_s * 1000.0) + [(math.inf, 0.0)]
    out = []
    for k in range(windows):
        a, b, area = k * window_s * 1000.0, (k + 1) * window_s * 1000.0, 0.0
        for (start, f), (end, _) in zip(pieces, pieces[1:]):
            area += f * max(0.0, min(b, end) - max(a, start))
        out.append(area / (b - a))
    return out


def smallest_line_gbps(
    runs: list[RequestRun],
    schedule: BandwidthSchedule,
    bound: float = BOUND,
    pct: float = PCT,
    window_s: float = WINDOW_S,
    step_gbps: float = STEP_GBPS,
) -> dict[str, float]:
    """The smallest nominal line (Gbps, a multiple of `step_gbps`) that keeps the p`pct` of window
    utilisation under `bound`, with the demand's mean and p99 (Gbps) it was sized for."""
    demand = demand_per_window(runs, window_s)
    factors = mean_factors(schedule, len(demand), window_s)
    need = sorted(d * 8 / 1e9 / window_s / f for d, f in zip(demand, factors))  # Gbps of nominal at 100%
    exact = percentile(need, pct) / bound
    rates = sorted(d * 8 / 1e9 / window_s for d in demand)
    return {
        "line_gbps": max(step_gbps, math.ceil(exact / step_gbps) * step_gbps),
        "exact_gbps": exact,
        "demand_mean_gbps": sum(rates) / max(len(rates), 1),
        "demand_p99_gbps": percentile(rates, pct),
    }
