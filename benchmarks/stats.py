"""The one percentile of the benchmarks and the simulator, and the latency figures built on it."""

from __future__ import annotations

import math


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): rank = p/100 * (n - 1).
    The one percentile of the benchmarks and the simulator (p = 50 is the median)."""
    if not sorted_values:
        return 0.0
    rank = p / 100 * (len(sorted_values) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def latency_stats(values: list[float]) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99", "max"} of `values` (ms); all 0.0 when there are none."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    return {
        "mean": sum(xs) / len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": xs[-1],
    }


def std(values: list[float]) -> float:
    """Population standard deviation (numpy's default, as `vllm bench serve` reports it); 0.0 for none."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
