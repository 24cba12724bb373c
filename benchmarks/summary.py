"""Benchmark summary: pure functions from recorded requests to the figures the report prints.

Input is one dict per request (one line of `requests.jsonl`, see `benchmarks/report.py`) plus
the run's settings (`slo`, `prices`, `instances`, `duration_s`). Nothing here talks to a server.

1. `request_latencies` turns one record's client-side timestamps into TTFT, time to second
   token, inter-token gaps, TPOT and E2E (all ms, measured from `sent_s`, not `arrival_s`).
2. `summarize_mode` pools those over one mode's records and adds goodput, throughput, WAN
   bytes, tokens per role, prefix hit rates, hardware cost and BCR, vLLM's figures under vLLM's
   names (benchmarks/vllm_compat.py) and each instance's busy fraction when it was measured.
   Figures that need the `pdd` object are None (missing, not zero) when no completed request
   carried one (another server than PDD), and cost and BCR when the fleet is unknown.
3. `outputs_match` checks that every mode produced the same text for the same request.
4. `hit_buckets` groups one mode's requests by MD-side prefix-hit fraction.
5. `build_results` is the whole `results.json` document.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from benchmarks.modes import LOCAL_MODE
from benchmarks.stats import latency_stats as latency_stats  # re-exported: the one percentile lives there
from benchmarks.stats import percentile as percentile
from benchmarks.vllm_compat import vllm_figures
from shared.pipelines import Role

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
CACHE_SIDES = (Role.PREFILL, Role.MD)  # the roles whose prefix hits the `pdd` object reports


@dataclass(frozen=True)
class RequestLatency:
    """One request's client-side latencies, ms. `ttst_ms` / `tpot_ms` are None when undefined."""

    ttft_ms: float
    ttst_ms: float | None
    gaps_ms: list[float]
    tpot_ms: float | None
    e2e_ms: float


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
    rate = (inst.get(Role.PREFILL, 0) + inst.get(Role.RLD, 0)) * chip_a + inst.get(Role.MD, 0) * chip_md
    return rate + (0.0 if local else float(prices.get("wan_line", 0.0)))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _pdd_sum(records: list[Record], group: str, key: str) -> int:
    return sum(int((r.get("pdd") or {}).get(group, {}).get(key, 0)) for r in records)


def _latency_summary(lats: list[RequestLatency], fields: tuple[str, ...] = LATENCY_FIELDS) -> dict[str, dict]:
    values = {
        "ttft_ms": lambda: [x.ttft_ms for x in lats],
        "ttst_ms": lambda: [x.ttst_ms for x in lats if x.ttst_ms is not None],
        "itl_ms": lambda: [g for x in lats for g in x.gaps_ms],
        "tpot_ms": lambda: [x.tpot_ms for x in lats if x.tpot_ms is not None],
        "e2e_ms": lambda: [x.e2e_ms for x in lats],
        "max_gap_ms": lambda: [max(x.gaps_ms) for x in lats if x.gaps_ms],
    }
    return {key: latency_stats(values[key]()) for key in fields}


PIPELINE_FIELDS = ("ttft_ms", "ttst_ms", "e2e_ms", "max_gap_ms")


def by_pipeline(done: list[Record]) -> dict[str, dict[str, Any]]:
    """Completed requests grouped by the pipeline their `pdd` object names ("" when none): each
    group's count and TTFT, time to second token, E2E (time to the last token) and largest gap.
    An agent waits for the whole answer, so E2E matters as much as TTFT; the median request is
    a later, cached turn on one pipeline, the tail a cold one on another."""
    groups: dict[str, list[RequestLatency]] = {}
    for r in done:
        if (lat := request_latencies(r)) is not None:
            groups.setdefault(str((r.get("pdd") or {}).get("pipeline", "")), []).append(lat)
    return {
        name: {"count": len(lats), **_latency_summary(lats, PIPELINE_FIELDS)} for name, lats in sorted(groups.items())
    }


def handoff_gap_ratios(done: list[Record]) -> list[float]:
    """For each handed-off request (its relay and main-decode both sent tokens), the largest
    gap at the handoff (the gateway's `handoff_gap_ms`) over the request's own median
    inter-token gap: 1.0 is a handoff no one could see in the stream."""
    out = []
    for r in done:
        pdd, lat = r.get("pdd") or {}, request_latencies(r)
        roles = pdd.get("tokens_by_role") or {}
        if lat is None or not lat.gaps_ms or not (roles.get(Role.RLD) and roles.get(Role.MD)):
            continue
        median = sorted(lat.gaps_ms)[len(lat.gaps_ms) // 2]
        if median > 0:
            out.append(float(pdd.get("handoff_gap_ms", 0.0)) / median)
    return out


def _pdd_figures(done: list[Record], prompt: int, known: bool) -> dict[str, Any]:
    if not known:
        return {"wan_kv_bytes": None, "tokens_by_role": None, "hit_rate": None}
    return {
        "wan_kv_bytes": sum(int((r.get("pdd") or {}).get("wan_kv_bytes", 0)) for r in done),
        "tokens_by_role": {k: _pdd_sum(done, "tokens_by_role", k) for k in Role},
        "hit_rate": {k: _ratio(_pdd_sum(done, "prefix_hit_tokens", k), prompt) for k in CACHE_SIDES},
    }


def summarize_mode(
    records: list[Record], settings: dict[str, Any], mode: str, busy: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One mode's column of the report (`records` may hold every mode; only `mode`'s are used).

    completed = records with ok; failed = the rest. Latencies pool the completed requests that
    streamed at least one token (see `request_latencies`); max_gap_ms is per-request largest gap.
    goodput_rps = #requests meeting every SLO (`meets_slo`) / duration_s.
    output_tok_s = sum(output_tokens of completed) / duration_s.
    hit_rate[side] = sum(prefix_hit_tokens[side]) / sum(prompt_tokens) over completed requests.
    cost = duration_h * cost_rate_per_hour (chips plus the WAN line, see `cost_rate_per_hour`).
    bcr = goodput_rps / cost_rate_per_hour: SLA-good requests per second per unit of hourly
    hardware cost (0.0 when the rate is 0). Durations come from `mode_duration_s`.
    by_pipeline: `by_pipeline`; handoff_gap_ratio: stats of `handoff_gap_ratios` (zeros when no
    request was handed off).
    wan_kv_bytes, tokens_by_role, hit_rate and by_pipeline are None when requests completed and none carried a
    `pdd` object; cost and bcr are None for a mode absent from settings.instances (a server we
    did not start). request_goodput counts against settings.goodput (vLLM's `--goodput`).
    busy: {instance id: {"role", "dc", "busy_s", "wall_s", "busy_fraction"}} or None.
    With the line's own counters (settings.line_bytes[mode], benchmarks/busy.py), wan_kv_bytes is
    what the line carried A -> B on its KV forwards during the replay (every push to the other
    site, including those nobody's `pdd` object reports: aborted ones, and cache-warming ones
    after the relay finished); the `pdd` objects' sum stays as wan_kv_bytes_attributed, and
    line_bytes has every forward each way (the NATS link's too).
    """
    mine = [r for r in records if r.get("mode") == mode]
    done = [r for r in mine if r.get("ok")]
    lats = [x for x in (request_latencies(r) for r in done) if x is not None]
    duration = mode_duration_s(mine, settings, mode)
    rate = cost_rate_per_hour(settings, mode)
    fleet_known = mode in settings.get("instances", {})
    pdd_known = not done or any(r.get("pdd") for r in done)
    goodput = _ratio(sum(meets_slo(x, settings.get("slo", {})) for x in lats), duration)
    prompt = sum(int(r.get("prompt_tokens", 0)) for r in done)
    pdd = _pdd_figures(done, prompt, pdd_known)
    line = settings.get("line_bytes", {}).get(mode)
    if line is not None:
        pdd["wan_kv_bytes_attributed"] = pdd["wan_kv_bytes"]
        pdd["wan_kv_bytes"] = sum(n for f, n in line.get("a-b", {}).items() if not f.startswith("nats-"))
    return {
        **vllm_figures(lats, done, duration, settings.get("goodput")),
        "requests": len(mine),
        "completed": len(done),
        "failed": len(mine) - len(done),
        **_latency_summary(lats),
        "goodput_rps": goodput,
        "output_tok_s": _ratio(sum(int(r.get("output_tokens", 0)) for r in done), duration),
        **pdd,
        "by_pipeline": by_pipeline(done) if pdd_known else None,
        "handoff_gap_ratio": latency_stats(handoff_gap_ratios(done)),
        "tool_calls": tool_call_figures(done),
        "line_bytes": line,
        "cost": duration / 3600 * rate if fleet_known else None,
        "bcr": _ratio(goodput, rate) if fleet_known else None,
        "busy": busy,
    }


def outputs_match(records_by_mode: dict[str, list[Record]]) -> float:
    """Fraction of request ids, present and ok in every mode, whose `text` is the same in all.

    0.0 when no request id is common to every mode (nothing could be compared).
    """
    texts = [{r["request_id"]: _output(r) for r in rs if r.get("ok")} for rs in records_by_mode.values()]
    if not texts:
        return 0.0
    common = set.intersection(*(set(t) for t in texts))
    same = sum(len({t[rid] for t in texts}) == 1 for rid in common)
    return _ratio(same, len(common))


def _output(record: Record) -> str:
    """A request's answer: its text, and its tool calls' names and arguments (ids are random)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in record.get("tool_calls") or []]
    return record.get("text", "") + (json.dumps(calls) if calls else "")


def tool_call_figures(done: list[Record]) -> dict[str, Any] | None:
    """Requests that called tools: how many, the share whose every call's arguments parse as
    JSON, and the time from sending to the complete call (its finish chunk); None when none did."""
    called = [r for r in done if r.get("tool_calls")]
    if not called:
        return None

    def parses(call: dict[str, Any]) -> bool:
        try:
            return isinstance(json.loads(call["function"]["arguments"]), dict)
        except ValueError:
            return False

    return {
        "requests": len(called),
        "arguments_parse": _ratio(sum(all(parses(c) for c in r["tool_calls"]) for r in called), len(called)),
        "complete_ms": latency_stats(
            [(r["tool_call_done_s"] - r["sent_s"]) * 1000 for r in called if "tool_call_done_s" in r]
        ),
    }


def md_hit_fraction(record: Record) -> float:
    """prefix_hit_tokens.md / prompt_tokens, clamped to [0, 1]; 0.0 without a prompt."""
    hit = int((record.get("pdd") or {}).get("prefix_hit_tokens", {}).get(Role.MD, 0))
    return min(max(_ratio(hit, int(record.get("prompt_tokens", 0))), 0.0), 1.0)


def _bucket_index(fraction: float) -> int:
    for i, (_, lo, hi) in enumerate(HIT_BUCKETS):
        if lo <= fraction < hi:
            return i
    return len(HIT_BUCKETS) - 1  # fraction == 1.0 closes the last bucket


def hit_buckets(records: list[Record]) -> list[dict[str, Any]]:
    """`HIT_BUCKETS` over one mode's completed requests that carry a `pdd` object, by `md_hit_fraction`.

    Each: {"bucket", "lo", "hi", "count", "ttft_ms": latency_stats, "mean_wan_kv_bytes"}.
    """
    groups: list[list[Record]] = [[] for _ in HIT_BUCKETS]
    for r in records:
        if r.get("ok") and r.get("pdd"):
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


def build_results(
    workload_info: dict[str, Any],
    settings: dict[str, Any],
    records: list[Record],
    busy: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `results.json` document: workload, settings, one summary per mode, outputs match.
    `busy` holds each mode's instance busy fractions (benchmarks/busy.py), when measured."""
    modes = modes_in(records, settings)
    return {
        "workload": workload_info,
        "settings": settings,
        "modes": {m: summarize_mode(records, settings, m, (busy or {}).get(m)) for m in modes},
        "outputs_match_across_modes": outputs_match(by_mode(records, modes)),
    }
