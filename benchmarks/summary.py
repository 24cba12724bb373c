"""Benchmark summary: pure functions from recorded requests to the figures the report prints.

Input is one dict per request (one line of `requests.jsonl`, see `benchmarks/report.py`) plus
the run's settings (`slo`, `prices`, `instances`, `duration_s`). Nothing here talks to a server.

1. `request_latencies` turns one record's client-side timestamps into TTFT, time to second
   token, inter-token gaps, TPOT and E2E (all ms, measured from `sent_s`, not `arrival_s`).
2. `summarize_mode` pools those over one mode's records and adds goodput, throughput, WAN
   bytes, tokens per role, prefix hit rates, hardware cost and BCR.
3. `outputs_match` checks that every mode produced the same text for the same request.
4. `hit_buckets` groups one mode's requests by MD-side prefix-hit fraction.
5. `build_results` is the whole `results.json` document.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from benchmarks.modes import LOCAL_MODE

Record = dict[str, Any]

# (label, lo, hi) over the MD-side hit fraction; [lo, hi) except the last, which is [0.99, 1.0].
# 0-50 / 50-80 hold the low-hit tail that drives P90/P99 TTFT and the report's "bathtub" valley;
# 80-90 / 90-95 sit around the ~90% average hit; 95-98 / 98-99 / 99-100 split the 70-80% of
# agentic requests that hit above 95%, where only a small increment of KV crosses the WAN.
HIT_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("0-50%", 0.0, 0.50),
    ("50-80%", 0.50, 0.80),
    ("80-90%", 0.80, 0.90),
    ("90-95%", 0.90, 0.95),
    ("95-98%", 0.95, 0.98),
    ("98-99%", 0.98, 0.99),
    ("99-100%", 0.99, 1.0),
)

LATENCY_FIELDS = ("ttft_ms", "ttst_ms", "itl_ms", "tpot_ms", "e2e_ms", "max_gap_ms")


@dataclass(frozen=True)
class RequestLatency:
    """One request's client-side latencies, ms. `ttst_ms` / `tpot_ms` are None when undefined."""

    ttft_ms: float
    ttst_ms: float | None
    gaps_ms: list[float]
    tpot_ms: float | None
    e2e_ms: float


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


def request_latencies(record: Record) -> RequestLatency | None:
    """Latencies from client timestamps; None for a failed request or one that streamed nothing.

    ttft = token_times_s[0] - sent_s; ttst = token_times_s[1] - sent_s; gaps = successive
    differences of token_times_s; e2e = token_times_s[-1] - sent_s;
    tpot = (e2e - ttft) / (output_tokens - 1), defined only when output_tokens >= 2 (a chunk may
    carry several tokens, so output_tokens, not the number of chunks, is the divisor).
    """
    times = [float(t) for t in record.get("token_times_s") or []]
    if not record.get("ok") or not times:
        return None
    sent = float(record.get("sent_s", 0.0))
    ttft = (times[0] - sent) * 1000
    e2e = (times[-1] - sent) * 1000
    n_out = int(record.get("output_tokens", 0))
    return RequestLatency(
        ttft_ms=ttft,
        ttst_ms=(times[1] - sent) * 1000 if len(times) > 1 else None,
        gaps_ms=[(b - a) * 1000 for a, b in itertools.pairwise(times)],
        tpot_ms=(e2e - ttft) / (n_out - 1) if n_out >= 2 else None,
        e2e_ms=e2e,
    )


def meets_slo(lat: RequestLatency, slo: dict[str, float]) -> bool:
    """ttft <= slo.ttft_ms and, when TPOT is defined (>= 2 tokens), tpot <= slo.tpot_ms.

    A missing SLO bound does not constrain.
    """
    if lat.ttft_ms > float(slo.get("ttft_ms", math.inf)):
        return False
    return lat.tpot_ms is None or lat.tpot_ms <= float(slo.get("tpot_ms", math.inf))


def mode_duration_s(records: list[Record], settings: dict[str, Any], mode: str) -> float:
    """settings.duration_s[mode]; if absent or <= 0, the records' span (first send to last token)."""
    duration = float(settings.get("duration_s", {}).get(mode, 0.0) or 0.0)
    if duration > 0 or not records:
        return duration
    sent = [float(r.get("sent_s", 0.0)) for r in records]
    tokens = [float(t) for r in records for t in r.get("token_times_s") or []]
    return max(max(sent + tokens) - min(sent), 0.0)


def cost_rate_per_hour(settings: dict[str, Any], mode: str) -> float:
    """Hardware cost per hour of one mode's fleet.

    rate = (n_prefill + n_rld) * chip_a + n_md * chip_md + wan_line,
    where chip_md = chip_b (MD in datacenter B) and the WAN line is charged, except in
    `pd-local`, where chip_md = chip_a and there is no line.
    """
    prices = settings.get("prices", {})
    inst = settings.get("instances", {}).get(mode, {})
    chip_a = float(prices.get("chip_a", 0.0))
    local = mode == LOCAL_MODE
    chip_md = chip_a if local else float(prices.get("chip_b", 0.0))
    rate = (inst.get("prefill", 0) + inst.get("rld", 0)) * chip_a + inst.get("md", 0) * chip_md
    return rate + (0.0 if local else float(prices.get("wan_line", 0.0)))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _pdd_sum(records: list[Record], group: str, key: str) -> int:
    return sum(int((r.get("pdd") or {}).get(group, {}).get(key, 0)) for r in records)


def _latency_summary(lats: list[RequestLatency]) -> dict[str, dict[str, float]]:
    return {
        "ttft_ms": latency_stats([x.ttft_ms for x in lats]),
        "ttst_ms": latency_stats([x.ttst_ms for x in lats if x.ttst_ms is not None]),
        "itl_ms": latency_stats([g for x in lats for g in x.gaps_ms]),
        "tpot_ms": latency_stats([x.tpot_ms for x in lats if x.tpot_ms is not None]),
        "e2e_ms": latency_stats([x.e2e_ms for x in lats]),
        "max_gap_ms": latency_stats([max(x.gaps_ms) for x in lats if x.gaps_ms]),
    }


def summarize_mode(records: list[Record], settings: dict[str, Any], mode: str) -> dict[str, Any]:
    """One mode's column of the report (`records` may hold every mode; only `mode`'s are used).

    completed = records with ok; failed = the rest. Latencies pool the completed requests that
    streamed at least one token (see `request_latencies`); max_gap_ms is per-request largest gap.
    goodput_rps = #requests meeting every SLO (`meets_slo`) / duration_s.
    output_tok_s = sum(output_tokens of completed) / duration_s.
    hit_rate[side] = sum(prefix_hit_tokens[side]) / sum(prompt_tokens) over completed requests.
    cost = duration_h * cost_rate_per_hour (chips plus the WAN line, see `cost_rate_per_hour`).
    bcr = goodput_rps / cost_rate_per_hour: SLA-good requests per second per unit of hourly
    hardware cost (0.0 when the rate is 0). Durations come from `mode_duration_s`.
    """
    mine = [r for r in records if r.get("mode") == mode]
    done = [r for r in mine if r.get("ok")]
    lats = [x for x in (request_latencies(r) for r in done) if x is not None]
    duration = mode_duration_s(mine, settings, mode)
    rate = cost_rate_per_hour(settings, mode)
    goodput = _ratio(sum(meets_slo(x, settings.get("slo", {})) for x in lats), duration)
    prompt = sum(int(r.get("prompt_tokens", 0)) for r in done)
    return {
        "requests": len(mine),
        "completed": len(done),
        "failed": len(mine) - len(done),
        **_latency_summary(lats),
        "goodput_rps": goodput,
        "output_tok_s": _ratio(sum(int(r.get("output_tokens", 0)) for r in done), duration),
        "wan_kv_bytes": sum(int((r.get("pdd") or {}).get("wan_kv_bytes", 0)) for r in done),
        "tokens_by_role": {k: _pdd_sum(done, "tokens_by_role", k) for k in ("rld", "md")},
        "hit_rate": {k: _ratio(_pdd_sum(done, "prefix_hit_tokens", k), prompt) for k in ("prefill", "md")},
        "cost": duration / 3600 * rate,
        "bcr": _ratio(goodput, rate),
    }


def outputs_match(records_by_mode: dict[str, list[Record]]) -> float:
    """Fraction of request ids, present and ok in every mode, whose `text` is the same in all.

    0.0 when no request id is common to every mode (nothing could be compared).
    """
    texts = [{r["request_id"]: r.get("text", "") for r in rs if r.get("ok")} for rs in records_by_mode.values()]
    if not texts:
        return 0.0
    common = set.intersection(*(set(t) for t in texts))
    same = sum(len({t[rid] for t in texts}) == 1 for rid in common)
    return _ratio(same, len(common))


def md_hit_fraction(record: Record) -> float:
    """prefix_hit_tokens.md / prompt_tokens, clamped to [0, 1]; 0.0 without a prompt."""
    hit = int((record.get("pdd") or {}).get("prefix_hit_tokens", {}).get("md", 0))
    return min(max(_ratio(hit, int(record.get("prompt_tokens", 0))), 0.0), 1.0)


def _bucket_index(fraction: float) -> int:
    for i, (_, lo, hi) in enumerate(HIT_BUCKETS):
        if lo <= fraction < hi:
            return i
    return len(HIT_BUCKETS) - 1  # fraction == 1.0 closes the last bucket


def hit_buckets(records: list[Record]) -> list[dict[str, Any]]:
    """`HIT_BUCKETS` over one mode's completed requests, by `md_hit_fraction`.

    Each: {"bucket", "lo", "hi", "count", "ttft_ms": latency_stats, "mean_wan_kv_bytes"}.
    """
    groups: list[list[Record]] = [[] for _ in HIT_BUCKETS]
    for r in records:
        if r.get("ok"):
            groups[_bucket_index(md_hit_fraction(r))].append(r)
    out = []
    for (label, lo, hi), rs in zip(HIT_BUCKETS, groups):
        lats = [x for x in (request_latencies(r) for r in rs) if x is not None]
        wan = [int((r.get("pdd") or {}).get("wan_kv_bytes", 0)) for r in rs]
        out.append(
            {
                "bucket": label,
                "lo": lo,
                "hi": hi,
                "count": len(rs),
                "ttft_ms": latency_stats([x.ttft_ms for x in lats]),
                "mean_wan_kv_bytes": _ratio(sum(wan), len(wan)),
            }
        )
    return out


def modes_in(records: list[Record], settings: dict[str, Any]) -> list[str]:
    """The run's modes: those in settings.duration_s (run, maybe with no records), then any other."""
    modes = list(settings.get("duration_s", {}))
    for r in records:
        if r.get("mode") not in modes:
            modes.append(r.get("mode"))
    return modes


def by_mode(records: list[Record], modes: list[str]) -> dict[str, list[Record]]:
    return {m: [r for r in records if r.get("mode") == m] for m in modes}


def build_results(workload_info: dict[str, Any], settings: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """The `results.json` document: workload, settings, one summary per mode, outputs match."""
    modes = modes_in(records, settings)
    return {
        "workload": workload_info,
        "settings": settings,
        "modes": {m: summarize_mode(records, settings, m) for m in modes},
        "outputs_match_across_modes": outputs_match(by_mode(records, modes)),
    }
