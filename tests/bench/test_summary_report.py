"""Summary and report over hand-built request records: numbers checked by hand, files checked on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.plots import timeline_segments
from benchmarks.report import check_targets, render_markdown, tool_calls_section, write_report
from benchmarks.summary import (
    HIT_BUCKETS,
    build_results,
    cost_rate_per_hour,
    handoff_gap_ratios,
    hit_buckets,
    latency_stats,
    outputs_match,
    request_latencies,
    summarize_mode,
    tool_call_figures,
)
from benchmarks.vllm_compat import VLLM_KEYS

STAT_KEYS = {"mean", "p50", "p90", "p99", "max"}
LATENCY_KEYS = ("ttft_ms", "ttst_ms", "itl_ms", "tpot_ms", "e2e_ms", "max_gap_ms")
MODE_KEYS = {
    "requests",
    "completed",
    "failed",
    *LATENCY_KEYS,
    "goodput_rps",
    "output_tok_s",
    "wan_kv_bytes",
    "tokens_by_role",
    "hit_rate",
    "cost",
    "bcr",
    "busy",
    "line_bytes",
    "by_pipeline",
    "handoff_gap_ratio",
    "tool_calls",
    *VLLM_KEYS,
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_record(rid: str, mode: str, sent: float, times: list[float], out: int, **kw: Any) -> dict[str, Any]:
    """One request record as the bench writes it; kw overrides prompt/text/ok and pdd figures."""
    ok = kw.get("ok", True)
    pdd = {
        "pipeline": "P->RLD->MD" if kw.get("rld", 0) else "P->MD",
        "handoff": "one-shot",
        "tokens_by_role": {
            "prefill": kw.get("first", 0),
            "rld": kw.get("rld", 0),
            "md": out - kw.get("first", 0) - kw.get("rld", 0),
        },
        "wan_kv_bytes": kw.get("wan", 0),
        "prefix_hit_tokens": {"prefill": kw.get("hit_p", 0), "md": kw.get("hit_md", 0)},
        "timings_ms": kw.get("timings", {"queue": 1.0, "prefill": 20.0, "kv_local": 5.0, "kv_wan": 50.0}),
    }
    return {
        "request_id": rid,
        "mode": mode,
        "kind": "new",
        "session": "s",
        "turn": 0,
        "arrival_s": sent,
        "sent_s": sent,
        "token_times_s": times if ok else [],
        "output_tokens": out if ok else 0,
        "prompt_tokens": kw.get("prompt", 100),
        "text": kw.get("text", f"text-{rid}"),
        "ok": ok,
        "error": "" if ok else "boom",
        "pdd": pdd if ok else {},
    }


SETTINGS = {
    "slo": {"ttft_ms": 400.0, "tpot_ms": 200.0},
    "prices": {"chip_a": 2.0, "chip_b": 3.0, "wan_line": 5.0},
    "instances": {
        "pdd": {"prefill": 2, "rld": 1, "md": 3},
        "pd-wan": {"prefill": 2, "rld": 0, "md": 3},
        "pd-local": {"prefill": 2, "rld": 0, "md": 3},
    },
    "duration_s": {"pdd": 1800.0, "pd-wan": 1800.0, "pd-local": 1800.0},
}


def pdd_records() -> list[dict[str, Any]]:
    """A meets both SLOs; B misses TTFT; C has one token (TTFT only) and meets it; D misses TPOT; E failed."""
    return [
        make_record("A", "pdd", 0.0, [0.1, 0.2, 0.3], 3, rld=1, wan=1000, hit_p=90, hit_md=80),
        make_record("B", "pdd", 1.0, [1.5, 1.6], 2, wan=3000, hit_p=50, hit_md=50),
        make_record("C", "pdd", 2.0, [2.2], 1, wan=0, hit_p=100, hit_md=100),
        make_record("D", "pdd", 3.0, [3.1, 3.5], 2, rld=2, wan=2000, hit_p=60, hit_md=20),
        make_record("E", "pdd", 4.0, [], 5, ok=False),
    ]


def test_latency_stats_hand_computed() -> None:
    assert latency_stats([5, 1, 4, 2, 3]) == pytest.approx({"mean": 3, "p50": 3, "p90": 4.6, "p99": 4.96, "max": 5})
    assert latency_stats([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0, "max": 7.0}
    assert latency_stats([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}


def test_request_latencies_from_client_times() -> None:
    lat = request_latencies(make_record("r", "pdd", 1.0, [1.1, 1.15, 1.3], 3))
    assert lat is not None
    assert (lat.ttft_ms, lat.ttst_ms, lat.e2e_ms) == pytest.approx((100, 150, 300))
    assert lat.gaps_ms == pytest.approx([50, 150])
    assert lat.tpot_ms == pytest.approx(100)  # (300 - 100) / (3 - 1)
    assert request_latencies(make_record("f", "pdd", 0.0, [0.1], 1, ok=False)) is None


def test_summarize_mode_latencies_and_counts() -> None:
    s = summarize_mode(pdd_records() + [make_record("X", "pd-wan", 0.0, [9.0], 1)], SETTINGS, "pdd")
    assert set(s) == MODE_KEYS
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["ttft_ms"]["p50"] == pytest.approx(150)  # [100, 100, 200, 500]
    assert s["ttft_ms"]["mean"] == pytest.approx(225)
    assert s["ttst_ms"]["p50"] == pytest.approx(500)  # [200, 500, 600]
    assert s["itl_ms"]["mean"] == pytest.approx(175)  # pooled [100, 100, 100, 400]
    assert s["tpot_ms"]["max"] == pytest.approx(400)  # [100, 100, 400]
    assert s["max_gap_ms"]["p50"] == pytest.approx(100)  # per request [100, 100, 400]
    assert s["e2e_ms"]["max"] == pytest.approx(600)
    assert s["output_tok_s"] == pytest.approx(8 / 1800)
    assert s["wan_kv_bytes"] == 6000
    assert s["tokens_by_role"] == {"prefill": 0, "rld": 3, "md": 5}
    assert s["hit_rate"] == pytest.approx({"prefill": 300 / 400, "md": 250 / 400})


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    s = summarize_mode(pdd_records(), SETTINGS, "pdd")
    assert s["goodput_rps"] == pytest.approx(2 / 1800)  # A and C only
    loose = {**SETTINGS, "slo": {"ttft_ms": 1000.0, "tpot_ms": 1000.0}}
    assert summarize_mode(pdd_records(), loose, "pdd")["goodput_rps"] == pytest.approx(4 / 1800)


def test_cost_and_bcr_formula() -> None:
    assert cost_rate_per_hour(SETTINGS, "pdd") == pytest.approx((2 + 1) * 2.0 + 3 * 3.0 + 5.0)
    assert cost_rate_per_hour(SETTINGS, "pd-wan") == pytest.approx(2 * 2.0 + 3 * 3.0 + 5.0)
    assert cost_rate_per_hour(SETTINGS, "pd-local") == pytest.approx(5 * 2.0)  # all chip A, no line
    s = summarize_mode(pdd_records(), SETTINGS, "pdd")
    assert s["cost"] == pytest.approx(0.5 * 20.0)  # 1800 s = 0.5 h at 20 per hour
    assert s["bcr"] == pytest.approx((2 / 1800) / 20.0)


def test_duration_falls_back_to_record_span() -> None:
    settings = {**SETTINGS, "duration_s": {}}
    s = summarize_mode(pdd_records(), settings, "pdd")
    assert s["goodput_rps"] == pytest.approx(2 / 4.0)  # first send 0.0 to last event 4.0 (E's send)


def test_outputs_match_fraction() -> None:
    def rec(rid: str, mode: str, text: str, ok: bool = True) -> dict[str, Any]:
        return make_record(rid, mode, 0.0, [0.1], 1, text=text, ok=ok)

    modes = ("pdd", "pd-wan", "pd-local")
    same = {m: [rec("r1", m, "a"), rec("r5", m, "e")] for m in modes}
    same["pdd"] += [rec("r2", "pdd", "b"), rec("r3", "pdd", "c"), rec("r4", "pdd", "d")]
    same["pd-wan"] += [rec("r2", "pd-wan", "DIFFERENT"), rec("r3", "pd-wan", "c", ok=False), rec("r4", "pd-wan", "d")]
    same["pd-local"] += [rec("r2", "pd-local", "b"), rec("r3", "pd-local", "c")]  # r4 missing here
    assert outputs_match(same) == pytest.approx(2 / 3)  # r1, r5 match; r2 differs; r3, r4 not comparable
    assert outputs_match({"pdd": [rec("r1", "pdd", "a")], "pd-wan": []}) == 0.0


def test_hit_bucket_boundaries() -> None:
    fractions = [0.0, 0.49, 0.5, 0.899, 0.9, 0.95, 0.979, 0.98, 0.99, 1.0]
    records = [
        make_record(f"h{i}", "pdd", 0.0, [0.1 * (i + 1)], 1, prompt=1000, hit_md=round(f * 1000), wan=i)
        for i, f in enumerate(fractions)
    ]
    buckets = hit_buckets(records + [make_record("bad", "pdd", 0.0, [], 1, ok=False)])
    assert [b["bucket"] for b in buckets] == [label for label, _, _ in HIT_BUCKETS]
    assert len(buckets) == 7 and buckets[-1]["bucket"] == "99-100%"
    assert [b["count"] for b in buckets] == [2, 1, 1, 1, 2, 1, 2]
    assert buckets[0]["ttft_ms"]["p50"] == pytest.approx(150)  # h0 100 ms, h1 200 ms
    assert buckets[-1]["mean_wan_kv_bytes"] == pytest.approx((8 + 9) / 2)


def test_timeline_segments_split_rld_and_md() -> None:
    r = make_record(
        "t",
        "pdd",
        1.0,
        [1.1, 1.2, 1.5, 1.6],
        4,
        rld=2,
        timings={"queue": 10.0, "prefill": 40.0, "kv_local": 5.0, "kv_wan": 300.0},
    )
    segs = {label: (lane, start, width) for label, lane, start, width in timeline_segments(r)}
    assert segs["queue+prefill"] == (0, 0.0, 50.0)
    assert segs["kv_local"] == (0, 50.0, 5.0) and segs["kv_wan"] == (1, 50.0, 300.0)
    assert segs["RLD tokens"] == pytest.approx((0, 100, 100))
    assert segs["handoff gap"] == pytest.approx((1, 200, 300))
    assert segs["MD tokens"] == pytest.approx((1, 500, 100))
    first = make_record("f", "pdd", 1.0, [1.1, 1.2, 1.5, 1.6], 4, first=1, rld=1)  # prefill streamed the first
    segs = {label: (lane, start, width) for label, lane, start, width in timeline_segments(first)}
    assert segs["P first token"] == pytest.approx((0, 100, 0)) and segs["RLD tokens"] == pytest.approx((0, 200, 0))
    assert segs["handoff gap"] == pytest.approx((1, 200, 300)) and segs["MD tokens"] == pytest.approx((1, 500, 100))


def three_mode_records() -> list[dict[str, Any]]:
    """pdd halves pd-wan's TTFT tail and sends a tenth of its WAN bytes; pd-local is the floor."""
    out = []
    for i in range(6):
        hit = 990 if i % 3 else 100
        out.append(
            make_record(
                f"q{i}",
                "pdd",
                i,
                [i + 0.185, i + 0.25, i + 0.3],
                3,
                prompt=1000,
                hit_md=hit,
                rld=1 if hit < 500 else 0,
                wan=100,
                text=f"t{i}",
            )
        )
        out.append(
            make_record(
                f"q{i}",
                "pd-wan",
                i,
                [i + 0.2 + (2 if hit < 500 else 0), i + 2.5, i + 2.6],
                3,
                prompt=1000,
                hit_md=hit,
                wan=1000,
                text=f"t{i}",
            )
        )
        out.append(
            make_record(
                f"q{i}", "pd-local", i, [i + 0.18, i + 0.23, i + 0.28], 3, prompt=1000, hit_md=hit, text=f"t{i}"
            )
        )
    return out


def test_targets_pass_and_miss() -> None:
    results = build_results({"name": "unit"}, SETTINGS, three_mode_records())
    targets = {t["target"]: t for t in check_targets(results)}
    assert targets["TTFT P90 pdd / pd-wan"]["result"] == "PASS"
    assert targets["WAN KV bytes pdd / pd-wan"]["measured"] == pytest.approx(0.1)
    assert targets["TTFT P50 pdd / pd-local"]["result"] == "PASS"
    assert targets["time to second token P50 pdd / pd-local"]["measured"] == pytest.approx(0.25 / 0.23)
    assert targets["E2E P50 pdd / pd-local"]["measured"] == pytest.approx(0.3 / 0.28)
    assert targets["outputs match across modes"]["result"] == "PASS"
    assert targets["RLD share of pdd output tokens"]["measured"] == pytest.approx(2 / 18)
    slow = {**results, "outputs_match_across_modes": 0.5}
    assert {t["target"]: t["result"] for t in check_targets(slow)}["outputs match across modes"] == "MISS"
    assert check_targets({**results, "modes": {"pdd": results["modes"]["pdd"]}}) == []


def test_write_report_writes_every_file(tmp_path: Path) -> None:
    records = three_mode_records()
    results = build_results({"name": "unit"}, SETTINGS, records)
    paths = write_report(tmp_path / "out", results, records)
    names = {"results.json", "requests.jsonl", "report.md", "ttft_cdf.png", "timeline.png", "hit_buckets.png"}
    assert {p.name for p in paths} == names and all(p.exists() for p in paths)

    loaded = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(loaded) == {"workload", "settings", "modes", "outputs_match_across_modes"}
    assert set(loaded["modes"]) == {"pdd", "pd-wan", "pd-local"}
    for summary in loaded["modes"].values():
        assert set(summary) == MODE_KEYS
        assert all(set(summary[key]) == STAT_KEYS for key in LATENCY_KEYS)
    assert loaded["outputs_match_across_modes"] == 1.0
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records

    report = (tmp_path / "out" / "report.md").read_text()
    for row in (
        "TTFT P50 vs pd-wan",
        "TTFT P99 vs pd-local",
        "WAN KV bytes vs pd-wan",
        "goodput vs pd-local",
        "BCR vs pd-wan",
        "## Targets",
        "PASS",
    ):
        assert row in report
    for name in ("ttft_cdf.png", "timeline.png", "hit_buckets.png"):
        data = (tmp_path / "out" / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_write_report_survives_modes_without_data(tmp_path: Path) -> None:
    records = [make_record("only", "pd-wan", 0.0, [], 1, ok=False)]
    results = build_results({}, SETTINGS, records)  # pdd and pd-local ran but recorded nothing
    assert results["modes"]["pdd"]["requests"] == 0 and results["modes"]["pdd"]["ttft_ms"]["p99"] == 0.0
    paths = write_report(tmp_path, results, records)
    assert all(p.stat().st_size > 0 for p in paths)
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    report = (tmp_path / "report.md").read_text()
    assert "TTFT P50 vs pd-wan" in report and "MISS" in report  # zero baselines: n/a ratios, never a crash


def test_the_lines_own_counters_are_the_wan_bytes_when_measured():
    """What crossed, not what responses reported: a push that warmed main-decode's cache after
    the relay finished shows on the line but in no `pdd` object."""
    from benchmarks.busy import line_bytes
    from shared.messages import LineState, WanState

    def state(kv: int, nats: int) -> WanState:
        ab = LineState(200.0, 20.0, 5.0, bytes_by_forward={"md-0": kv, "nats-B": nats})
        return WanState("a-b", lines={"a-b": ab, "b-a": LineState(200.0, 20.0, 5.0, bytes_by_forward={"nats-B": nats})})

    carried = line_bytes(state(1_000, 50), state(9_000, 80))
    assert carried == {"a-b": {"md-0": 8_000, "nats-B": 30}, "b-a": {"nats-B": 30}}
    rec = {"mode": "pdd", "ok": True, "prompt_tokens": 10, "output_tokens": 2, "pdd": {"wan_kv_bytes": 3_000}}
    settings = {"line_bytes": {"pdd": carried}}
    s = summarize_mode([rec], settings, "pdd")
    assert (s["wan_kv_bytes"], s["wan_kv_bytes_attributed"], s["line_bytes"]) == (8_000, 3_000, carried)
    assert summarize_mode([rec], {}, "pdd")["wan_kv_bytes"] == 3_000  # no counters: the responses' sum
    assert line_bytes(None, state(1, 1)) is None


def test_by_pipeline_and_the_handoff_gap_against_the_requests_own_pace() -> None:
    """Each pipeline's requests apart (the median request is a cached turn on one, the tail a cold
    one on another), and each handed-off request's handoff gap over its own median token gap."""
    smooth = make_record("h1", "pdd", 0.0, [0.1, 0.2, 0.3, 0.4, 0.5], 5, first=1, rld=2)  # gaps all 100 ms
    smooth["pdd"]["handoff_gap_ms"] = 100.0  # no longer than any other gap
    bumpy = make_record("h2", "pdd", 0.0, [0.1, 0.2, 0.3, 0.6, 0.7], 5, first=1, rld=2)
    bumpy["pdd"]["handoff_gap_ms"] = 300.0  # three of its steps
    alone = make_record("m1", "pdd", 0.0, [0.05, 0.06], 2, first=1)  # main-decode only: not handed off
    s = summarize_mode([smooth, bumpy, alone], SETTINGS, "pdd")
    assert sorted(s["by_pipeline"]) == ["P->MD", "P->RLD->MD"]
    handed = s["by_pipeline"]["P->RLD->MD"]
    assert handed["count"] == 2 and handed["e2e_ms"]["max"] == pytest.approx(700.0)
    assert handed["ttst_ms"]["p50"] == pytest.approx(200.0) and handed["max_gap_ms"]["max"] == pytest.approx(300.0)
    assert s["by_pipeline"]["P->MD"]["ttft_ms"]["p50"] == pytest.approx(50.0)
    assert sorted(handoff_gap_ratios([smooth, bumpy, alone])) == pytest.approx([1.0, 3.0])
    assert s["handoff_gap_ratio"]["max"] == pytest.approx(3.0)
    results = build_results({"name": "unit"}, SETTINGS, three_mode_records() + [smooth, bumpy])
    target = next(t for t in check_targets(results) if t["target"].startswith("handoff gap"))
    assert target["result"] == "MISS" and target["measured"] > 1.5
    report = render_markdown(results, {})
    assert "## By pipeline" in report and "P->RLD->MD" in report


def test_tool_calls_are_timed_to_the_complete_call_and_compared_across_modes():
    def called(rid: str, mode: str, arguments: str, done_s: float) -> dict[str, Any]:
        rec = make_record(rid, mode, 1.0, [1.1, 1.2, 1.3], 3, text="")
        call = {"id": f"call_{mode}", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {**rec, "tool_calls": [call], "tool_call_done_s": done_s}

    records = [
        called("a", "pdd", '{"x": 1}', 1.4),
        called("b", "pdd", '{"x": ', 1.6),
        make_record("c", "pdd", 1.0, [1.1], 1),
    ]
    figures = tool_call_figures(records)
    assert figures["requests"] == 2 and figures["arguments_parse"] == 0.5
    assert figures["complete_ms"]["p50"] == pytest.approx(500.0) and figures["complete_ms"]["max"] == pytest.approx(
        600.0
    )
    assert tool_call_figures([make_record("c", "pdd", 1.0, [1.1], 1)]) is None
    same = {"pdd": [called("a", "pdd", '{"x": 1}', 1.4)], "pd-local": [called("a", "pd-local", '{"x": 1}', 1.2)]}
    assert outputs_match(same) == 1.0  # call ids differ, the calls do not
    other = {**same, "pd-local": [called("a", "pd-local", '{"x": 2}', 1.2)]}
    assert outputs_match(other) == 0.0
    section = "\n".join(tool_calls_section({"pdd": {"tool_calls": figures}, "pd-local": {"tool_calls": None}}))
    assert "## Tool calls" in section and "| complete call P50 ms | 500" in section and "pd-local" not in section
