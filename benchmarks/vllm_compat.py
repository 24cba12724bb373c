"""The figures `vllm bench serve` writes, under its names, from the same request records.

Every mode's summary carries them next to PDD's own (benchmarks/summary.py), so a script written
for vLLM's result JSON reads a `pdd bench` run unchanged:

    completed, duration, total_input_tokens, total_output_tokens,
    request_throughput = completed / duration,
    request_goodput    = requests meeting every `--goodput` SLO / duration (None without --goodput),
    output_throughput  = total_output_tokens / duration,
    total_token_throughput = (total_input_tokens + total_output_tokens) / duration,
    {mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms

TTFT, TPOT, ITL (gaps between streamed chunks) and E2EL are the client-side figures of
`benchmarks.summary.request_latencies`; std is numpy's (population); percentiles are numpy's
linear interpolation. `--goodput ttft:MS tpot:MS e2el:MS` takes vLLM's syntax.
"""

from __future__ import annotations

from typing import Any

from benchmarks.stats import percentile, std

GOODPUT_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
STATS = ("mean", "median", "std", "p90", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")
VLLM_KEYS = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{metric}_ms" for metric in METRICS for stat in STATS),
)

# The rows of report.md's vLLM table.
REPORT_KEYS = (
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_input_tokens",
    "total_output_tokens",
    *(f"{stat}_{metric}_ms" for metric in METRICS for stat in ("mean", "median", "p99")),
)


def parse_goodput(specs: list[str] | None) -> dict[str, float] | None:
    """["ttft:500", "tpot:50"] -> {"ttft_ms": 500.0, "tpot_ms": 50.0}; None for none given.

    ValueError naming the bad item (unknown key, not KEY:MS, a negative or non-numeric bound)."""
    if not specs:
        return None
    slo: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {spec!r}: use KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if bound < 0:
            raise ValueError(f"--goodput {spec!r}: the bound must be >= 0 ms")
        slo[GOODPUT_KEYS[key]] = bound
    return slo


def meets_goodput(ttft_ms: float, tpot_ms: float | None, e2el_ms: float, slo: dict[str, float]) -> bool:
    """Every bound given holds (a TPOT bound does not constrain a one-token request, as in vLLM)."""
    if ttft_ms > slo.get("ttft_ms", float("inf")) or e2el_ms > slo.get("e2el_ms", float("inf")):
        return False
    return tpot_ms is None or tpot_ms <= slo.get("tpot_ms", float("inf"))


def _figures(name: str, values: list[float]) -> dict[str, float | None]:
    """The five statistics of `values`; None for each when there are none (vLLM writes 0 there,
    which reads as an infinitely fast server when every request failed or streamed nothing)."""
    xs = sorted(values)
    if not xs:
        return dict.fromkeys(f"{stat}_{name}_ms" for stat in STATS)
    mean = sum(xs) / len(xs)
    return {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(xs, 50),
        f"std_{name}_ms": std(xs),
        f"p90_{name}_ms": percentile(xs, 90),
        f"p99_{name}_ms": percentile(xs, 99),
    }


def vllm_figures(
    lats: list[Any], done: list[dict[str, Any]], duration_s: float, goodput: dict[str, float] | None
) -> dict[str, Any]:
    """vLLM's keys over one mode: `lats` are its `RequestLatency`s, `done` its completed records."""
    n_in = sum(int(r.get("prompt_tokens", 0)) for r in done)
    n_out = sum(int(r.get("output_tokens", 0)) for r in done)

    def per_s(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    good = None
    if goodput is not None:
        good = per_s(sum(meets_goodput(x.ttft_ms, x.tpot_ms, x.e2e_ms, goodput) for x in lats))
    out: dict[str, Any] = {
        "completed": len(done),
        "duration": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": per_s(len(done)),
        "request_goodput": good,
        "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
    }
    out |= _figures("ttft", [x.ttft_ms for x in lats])
    out |= _figures("tpot", [x.tpot_ms for x in lats if x.tpot_ms is not None])
    out |= _figures("itl", [g for x in lats for g in x.gaps_ms])
    out |= _figures("e2el", [x.e2e_ms for x in lats])
    return out
