"""Busy fractions from two registry views, vLLM's figures and `--goodput`, and the report's new
sections, over hand-built data (no servers)."""

from __future__ import annotations

import pytest

from benchmarks.busy import busy_fractions
from benchmarks.report import render_markdown
from benchmarks.summary import build_results, summarize_mode
from benchmarks.vllm_compat import VLLM_KEYS, parse_goodput
from shared.messages import ClusterStatus, InstanceInfo
from tests.bench.test_summary_report import SETTINGS, make_record, pdd_records


def info(iid: str, role: str, busy_s: float, updated_at: float, started_at: float = 1.0) -> InstanceInfo:
    return InstanceInfo(id=iid, role=role, dc="A", busy_s=busy_s, updated_at=updated_at, started_at=started_at)


def test_busy_fraction_is_busy_time_over_the_heartbeats_span() -> None:
    first = [info("prefill-0", "prefill", 10.0, 100.0), info("md-0", "md", 2.0, 100.5)]
    first += [info("rld-0", "rld", 0.0, 100.0), info("gone", "md", 0.0, 100.0)]
    last = [info("prefill-0", "prefill", 28.0, 120.0), info("md-0", "md", 7.0, 120.5)]
    last += [info("rld-0", "rld", 0.0, 120.0, started_at=50.0), info("new", "md", 1.0, 120.0)]
    before, after = ClusterStatus(first), ClusterStatus(last)
    busy = busy_fractions(before, after)
    assert busy == {
        "md-0": {"role": "md", "dc": "A", "busy_s": 5.0, "wall_s": 20.0, "busy_fraction": 0.25},
        "prefill-0": {"role": "prefill", "dc": "A", "busy_s": 18.0, "wall_s": 20.0, "busy_fraction": 0.9},
    }  # rld-0 restarted in between, "gone" left, "new" came: none of them has a figure
    assert busy_fractions(None, after) is None and busy_fractions(before, None) is None
    late = ClusterStatus([info("prefill-0", "prefill", 31.0, 121.0)])  # a step begun before the first view
    assert busy_fractions(before, late)["prefill-0"]["busy_fraction"] == 1.0


def test_parse_goodput_takes_vllms_syntax() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:9000.5"]) == {"ttft_ms": 500, "tpot_ms": 50, "e2el_ms": 9000.5}
    assert parse_goodput(None) is None and parse_goodput([]) is None
    for bad in ("ttft", "ttft:", "ttft:fast", "itl:5", "tpot:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_vllm_figures_hand_computed() -> None:
    s = summarize_mode(pdd_records(), {**SETTINGS, "goodput": {"ttft_ms": 150.0}}, "pdd")
    assert set(VLLM_KEYS) <= set(s)
    # completed A, B, C, D: ttft [100, 500, 200, 100], tpot [100, 100, 400], e2e [300, 600, 200, 500]
    assert (s["completed"], s["duration"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 1800.0, 400, 8)
    assert s["request_throughput"] == pytest.approx(4 / 1800) and s["output_throughput"] == pytest.approx(8 / 1800)
    assert s["total_token_throughput"] == pytest.approx(408 / 1800)
    assert s["median_ttft_ms"] == pytest.approx(150) and s["mean_ttft_ms"] == pytest.approx(225)
    assert s["std_ttft_ms"] == pytest.approx(26875**0.5)  # population std of [100, 500, 200, 100]
    assert s["p99_tpot_ms"] == pytest.approx(394) and s["median_e2el_ms"] == pytest.approx(400)
    assert s["mean_itl_ms"] == pytest.approx(175)  # gaps [100, 100, 100, 400]
    assert s["request_goodput"] == pytest.approx(2 / 1800)  # A and D (TTFT 100 ms) meet ttft:150
    assert summarize_mode(pdd_records(), SETTINGS, "pdd")["request_goodput"] is None  # no --goodput given


def test_a_server_without_the_pdd_object_leaves_pdd_figures_missing() -> None:
    records = [make_record(f"r{i}", "vllm", i, [i + 0.1, i + 0.2], 2) for i in range(3)]
    for r in records:
        r["pdd"] = {}
    s = summarize_mode(records, {**SETTINGS, "duration_s": {"vllm": 3.0}}, "vllm")
    assert (s["wan_kv_bytes"], s["tokens_by_role"], s["hit_rate"], s["cost"], s["bcr"]) == (None,) * 5
    assert s["completed"] == 3 and s["median_ttft_ms"] == pytest.approx(100)
    empty = summarize_mode([], SETTINGS, "pdd")  # a PDD mode that completed nothing: zeros, as before
    assert empty["wan_kv_bytes"] == 0 and empty["tokens_by_role"] == {"prefill": 0, "rld": 0, "md": 0}


def test_results_and_report_carry_busy_fractions() -> None:
    busy = {"pdd": {"prefill-0": {"role": "prefill", "dc": "A", "busy_s": 9.0, "wall_s": 10.0, "busy_fraction": 0.9}}}
    records = pdd_records() + [make_record("X", "pd-wan", 0.0, [0.5], 1)]
    results = build_results({"name": "unit"}, SETTINGS, records, busy)
    assert results["modes"]["pdd"]["busy"] == busy["pdd"] and results["modes"]["pd-wan"]["busy"] is None
    report = render_markdown(results, {})
    assert "## Busy fraction per instance" in report and "| prefill-0 (prefill, A) | 0.9 |" in report
    assert "| median_ttft_ms |" in report
    assert "Busy fraction" not in render_markdown(build_results({}, SETTINGS, records), {})
