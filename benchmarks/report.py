"""Benchmark report: writes a run's results, its raw requests, a Markdown report and the plots.

`write_report(out_dir, results, records)` writes, in `out_dir`:
1. `results.json`   — `results` as given (`benchmarks.summary.build_results`);
2. `requests.jsonl` — one request record per line, exactly as recorded;
3. `report.md`      — tables with the modes side by side, ratios against the baselines
   (`pd-wan`, `pd-local`) and the project's targets, each marked PASS or MISS (never asserted),
   each instance's busy fraction (bound by compute or by the line?) and vLLM's figures;
   a figure that needs the `pdd` object of a server that sent none shows as n/a;
4. `ttft_cdf.png`, `timeline.png`, `hit_buckets.png` (`benchmarks.plots`);
5. `waterfall_slowest.png`, `waterfall_median.png`: one request each, drawn as the gateway's
   dashboard draws it (`benchmarks.waterfall`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.modes import LOCAL_MODE
from benchmarks.plots import plot_hit_buckets, plot_timeline, plot_ttft_cdf
from benchmarks.summary import CACHE_SIDES, LATENCY_FIELDS, Record, by_mode, hit_buckets
from benchmarks.vllm_compat import REPORT_KEYS
from benchmarks.waterfall import plot_waterfalls
from shared.pipelines import Role

PDD_MODE = "pdd"
WAN_MODE = "pd-wan"
BASELINES = (WAN_MODE, LOCAL_MODE)

# (name, baseline mode, measure(summary) -> float, bound on pdd / baseline): two sites behaving
# as one at every percentile, the median as if both were local, the tail far below naive cross-DC
RATIO_TARGETS = (
    ("TTFT P90 pdd / pd-wan", WAN_MODE, lambda s: s["ttft_ms"]["p90"], 0.35),
    ("TTFT P99 pdd / pd-wan", WAN_MODE, lambda s: s["ttft_ms"]["p99"], 0.35),
    ("WAN KV bytes pdd / pd-wan", WAN_MODE, lambda s: s["wan_kv_bytes"], 0.15),
    ("TTFT P50 pdd / pd-local", LOCAL_MODE, lambda s: s["ttft_ms"]["p50"], 1.05),
    ("time to second token P50 pdd / pd-local", LOCAL_MODE, lambda s: s["ttst_ms"]["p50"], 1.5),
    ("E2E P50 pdd / pd-local", LOCAL_MODE, lambda s: s["e2e_ms"]["p50"], 1.15),
)
HANDOFF_GAP_MAX = 1.5  # P90 over handed-off requests of (handoff gap / that request's median ITL)
# Our bound on RLD's share of pdd's output tokens: RLD must relay some (> 0), but MD must do the
# bulk, or the small RLD pool becomes the bottleneck. The report measured 6.2% (64K in / 1K out).
RLD_SHARE_MAX = 0.2

RATIO_ROWS = (
    ("TTFT P50", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT P90", lambda s: s["ttft_ms"]["p90"]),
    ("TTFT P99", lambda s: s["ttft_ms"]["p99"]),
    ("WAN KV bytes", lambda s: s["wan_kv_bytes"]),
    ("goodput", lambda s: s["goodput_rps"]),
    ("BCR", lambda s: s["bcr"]),
)
LATENCY_TITLES = {
    "ttft_ms": "TTFT",
    "ttst_ms": "Time to second token",
    "itl_ms": "Inter-token latency",
    "tpot_ms": "TPOT",
    "e2e_ms": "E2E",
    "max_gap_ms": "Largest gap per request",
}


def fmt(value: Any) -> str:
    """Ints with thousands separators; floats: 1 decimal from 100, 2 from 1, else 3 significant digits."""
    if isinstance(value, bool) or value is None:
        return "n/a" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.2f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; cells go through `fmt`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rld_share(summary: dict[str, Any]) -> float | None:
    """tokens_by_role.rld / every output token (prefill's first ones too); 0.0 when none were
    produced; None when not known."""
    if summary["tokens_by_role"] is None:
        return None
    total = sum(summary["tokens_by_role"].values())
    return summary["tokens_by_role"][Role.RLD] / total if total else 0.0


def _div(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ratio_rows(modes: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Rows "<metric> vs <baseline>": each mode's value / the baseline's, for each baseline present."""
    return [
        [f"{name} vs {base}", *(_div(get(s), get(modes[base])) for s in modes.values())]
        for base in BASELINES
        if base in modes
        for name, get in RATIO_ROWS
    ]


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets with measured value, bound and "PASS"/"MISS" ([] without pdd and a baseline).

    Ratio targets need pdd and their baseline; a ratio over a zero baseline is n/a and a MISS.
    """
    modes = results["modes"]
    if PDD_MODE not in modes or not any(b in modes for b in BASELINES):
        return []
    out = []
    for name, base, get, bound in RATIO_TARGETS:
        if base in modes:
            ratio = _div(get(modes[PDD_MODE]), get(modes[base]))
            out.append(
                {"target": name, "measured": ratio, "bound": f"<= {bound}", "ok": ratio is not None and ratio <= bound}
            )
    gap = modes[PDD_MODE].get("handoff_gap_ratio")
    if gap and gap["max"] > 0:  # some request was handed off
        out.append(
            {
                "target": "handoff gap / the request's median ITL, P90 over handed-off requests",
                "measured": gap["p90"],
                "bound": f"<= {HANDOFF_GAP_MAX}",
                "ok": gap["p90"] <= HANDOFF_GAP_MAX,
            }
        )
    match = results["outputs_match_across_modes"]
    out.append({"target": "outputs match across modes", "measured": match, "bound": "== 1.0", "ok": match == 1.0})
    share = rld_share(modes[PDD_MODE])
    out.append(
        {
            "target": "RLD share of pdd output tokens",
            "measured": share,
            "bound": f"> 0 and <= {RLD_SHARE_MAX} (report: 0.062)",
            "ok": share is not None and 0 < share <= RLD_SHARE_MAX,
        }
    )
    for t in out:
        t["result"] = "PASS" if t["ok"] else "MISS"
    return out


def _header(results: dict[str, Any]) -> list[str]:
    settings = results.get("settings", {})
    lines = ["# PDD benchmark report", ""]
    lines += [f"- workload: `{json.dumps(results.get('workload', {}), sort_keys=True)}`"]
    for key in ("target", "slo", "goodput", "max_concurrency", "prices", "instances", "duration_s"):
        if key in settings:
            lines.append(f"- {key}: `{json.dumps(settings[key], sort_keys=True)}`")
    lines.append(f"- outputs match across modes: {fmt(results['outputs_match_across_modes'])}")
    if env := results.get("environment"):
        lines.append(
            f"- environment: commit {env.get('git_commit')}{' (uncommitted changes)' if env.get('git_dirty') else ''}, "
            f"{env.get('cpu_model')}, {env.get('cpus_usable')} usable CPUs, "
            f"`{json.dumps(env.get('packages', {}), sort_keys=True)}`"
        )
    return lines


def _part(summary: dict[str, Any], key: str, sub: str) -> Any:
    """summary[key][sub], or None when the mode's server sent no `pdd` object to know it from."""
    return None if summary.get(key) is None else summary[key][sub]


def _nats_bytes(line: dict[str, dict[str, int]] | None) -> int | None:
    if line is None:
        return None
    return sum(n for forwards in line.values() for f, n in forwards.items() if f.startswith("nats-"))


def _overview(modes: dict[str, dict[str, Any]]) -> list[str]:
    names = list(modes)
    rows: list[list[Any]] = [
        [key, *(s[key] for s in modes.values())]
        for key in ("requests", "completed", "failed", "goodput_rps", "output_tok_s", "cost", "bcr")
    ]
    rows += [["WAN KV bytes", *(s["wan_kv_bytes"] for s in modes.values())]]
    if any(s.get("line_bytes") for s in modes.values()):
        rows += [["WAN KV bytes in pdd objects", *(s.get("wan_kv_bytes_attributed") for s in modes.values())]]
        rows += [["NATS link bytes (both ways)", *(_nats_bytes(s.get("line_bytes")) for s in modes.values())]]
    rows += [[f"{role.upper()} tokens", *(_part(s, "tokens_by_role", role) for s in modes.values())] for role in Role]
    rows += [["RLD share of output tokens", *(rld_share(s) for s in modes.values())]]
    rows += [[f"prefix hit rate {side}", *(_part(s, "hit_rate", side) for s in modes.values())] for side in CACHE_SIDES]
    return [
        "## Requests, throughput, cost, WAN",
        "",
        table(["metric", *names], rows),
        "",
        (
            "goodput_rps: requests meeting every SLO per second; cost: duration_h x (chips + WAN line) "
            "per hour; bcr: goodput_rps / hourly hardware cost. WAN KV bytes: what the line carried A -> B "
            "to decoders in B during the replay, by its own counters (the `pdd` objects' sum beside it "
            "leaves out pushes no response reports: aborted, or warming main-decode's cache)."
        ),
        "",
    ]


def _latencies(modes: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["## Latency (ms, client side)", ""]
    for key in LATENCY_FIELDS:
        rows = [[stat, *(s[key][stat] for s in modes.values())] for stat in ("p50", "p90", "p99", "mean", "max")]
        lines += [f"### {LATENCY_TITLES[key]}", "", table(["stat", *modes], rows), ""]
    return lines


def _pipelines(modes: dict[str, dict[str, Any]]) -> list[str]:
    """Per mode, each pipeline's requests: TTFT, time to second token, E2E, largest gap (ms)."""
    lines = ["## By pipeline (ms, client side)", ""]
    header = [
        "pipeline",
        "count",
        "TTFT P50",
        "P90",
        "P99",
        "2nd token P50",
        "E2E P50",
        "P90",
        "P99",
        "largest gap P90",
    ]
    for mode, s in modes.items():
        if not s.get("by_pipeline"):
            continue
        rows = [
            [
                name or "(not reported)",
                g["count"],
                g["ttft_ms"]["p50"],
                g["ttft_ms"]["p90"],
                g["ttft_ms"]["p99"],
                g["ttst_ms"]["p50"],
                g["e2e_ms"]["p50"],
                g["e2e_ms"]["p90"],
                g["e2e_ms"]["p99"],
                g["max_gap_ms"]["p90"],
            ]
            for name, g in s["by_pipeline"].items()
        ]
        lines += [f"### {mode}", "", table(header, rows), ""]
    return lines if len(lines) > 2 else []


def tool_calls_section(modes: dict[str, dict[str, Any]]) -> list[str]:
    """The agentic-tools workload's calls: the time to the complete call, and whether they parse."""
    called = {m: s["tool_calls"] for m, s in modes.items() if s.get("tool_calls")}
    if not called:
        return []
    rows = [["requests that called", *(t["requests"] for t in called.values())]]
    rows += [["arguments parse (share)", *(t["arguments_parse"] for t in called.values())]]
    for k in ("p50", "p90", "p99"):
        rows += [[f"complete call {k.upper()} ms", *(t["complete_ms"][k] for t in called.values())]]
    return ["## Tool calls (time from sending to the complete call)", "", table(["metric", *called], rows), ""]


def _ratios(modes: dict[str, dict[str, Any]]) -> list[str]:
    rows = ratio_rows(modes)
    if not rows:
        return []
    return ["## Ratios (mode / baseline)", "", table(["metric", *modes], rows), ""]


def _buckets(buckets_by_mode: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["## By MD-side prefix hit (prefix_hit_tokens.md / prompt_tokens)", ""]
    for mode, buckets in buckets_by_mode.items():
        rows = [
            [b["bucket"], b["count"], b["ttft_ms"]["p50"], b["ttft_ms"]["p90"], b["mean_wan_kv_bytes"]]
            if b["count"]
            else [b["bucket"], 0, "-", "-", "-"]
            for b in buckets
        ]
        lines += [f"### {mode}", "", table(["hit", "count", "TTFT P50", "TTFT P90", "mean WAN bytes"], rows), ""]
    return lines


def _busy(modes: dict[str, dict[str, Any]]) -> list[str]:
    """Each instance's share of wall time in engine steps, per mode ("-": not in that mode's fleet)."""
    measured = {m: s["busy"] for m, s in modes.items() if s.get("busy")}
    if not measured:
        return []
    ids = sorted({i for busy in measured.values() for i in busy})
    roles = {i: f"{b['role']}, {b['dc']}" for busy in measured.values() for i, b in busy.items()}
    rows = [[f"{i} ({roles[i]})", *(m[i]["busy_fraction"] if i in m else "-" for m in measured.values())] for i in ids]
    note = (
        "Share of the run's wall time each engine spent in steps (busy_s from its heartbeats). "
        "An instance near 1.0 bound the run by compute; all of them low while TTFT is high: bound by the line."
    )
    return ["## Busy fraction per instance", "", table(["instance", *measured], rows), "", note, ""]


def _vllm(modes: dict[str, dict[str, Any]]) -> list[str]:
    rows = [[key, *(s.get(key) for s in modes.values())] for key in REPORT_KEYS]
    return ["## As `vllm bench serve` names them", "", table(["metric", *modes], rows), ""]


def _targets(results: dict[str, Any]) -> list[str]:
    targets = check_targets(results)
    if not targets:
        return []
    rows = [[t["target"], t["measured"], t["bound"], t["result"]] for t in targets]
    return ["## Targets", "", table(["target", "measured", "bound", "result"], rows), ""]


def render_markdown(results: dict[str, Any], buckets_by_mode: dict[str, list[dict[str, Any]]]) -> str:
    """The whole `report.md`."""
    modes = results["modes"]
    parts = [
        _header(results),
        [""],
        _targets(results),
        _overview(modes),
        _busy(modes),
        _latencies(modes),
        tool_calls_section(modes),
        _pipelines(modes),
        _ratios(modes),
        _buckets(buckets_by_mode),
        _vllm(modes),
    ]
    return "\n".join(line for part in parts for line in part)


def write_report(out_dir: Path, results: dict[str, Any], records: list[Record]) -> list[Path]:
    """Write results.json, requests.jsonl, report.md and the three PNGs; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grouped = by_mode(records, list(results["modes"]))
    buckets = {mode: hit_buckets(rs) for mode, rs in grouped.items()}
    results_path = out_dir / "results.json"
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    requests_path = out_dir / "requests.jsonl"
    requests_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    report_path = out_dir / "report.md"
    report_path.write_text(render_markdown(results, buckets))
    shown = PDD_MODE if PDD_MODE in grouped else next(iter(grouped), "")
    plot_waterfalls(out_dir, grouped.get(shown, []), shown)  # written beside the rest; not in the list callers check
    return [
        results_path,
        requests_path,
        report_path,
        plot_ttft_cdf(out_dir / "ttft_cdf.png", grouped),
        plot_timeline(out_dir / "timeline.png", grouped.get(shown, []), f"request timeline ({shown or 'no mode'})"),
        plot_hit_buckets(out_dir / "hit_buckets.png", buckets),
    ]
