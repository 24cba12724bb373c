"""`pdd bench` for real: the agentic workload through a fresh cluster per mode (three requests
each), and the files it writes with the results schema. The random and trace workloads replay
against the running session cluster (tests/cluster/test_bench_against_cluster.py): one bench
that starts its own clusters is enough for the suite."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.bench.test_summary_report import MODE_KEYS as SUMMARY_KEYS

pytestmark = pytest.mark.slow

LATENCY = {"mean", "p50", "p90", "p99", "max"}
MODE_KEYS = {*SUMMARY_KEYS, "wan_kv_bytes_attributed"}  # with the line's counters: the pdd objects' sum too


def _agentic(out: Path) -> tuple[list[str], dict[str, str]]:
    """`pdd bench` of the agentic workload, pd-wan against pdd: started at session start
    (tests/background.py), beside the unit tests."""
    argv = [sys.executable, "-m", "pdd.cli", "bench", "--workload", "agentic", "--modes", "pd-wan,pdd"]
    return [*argv, "--out", str(out), "--requests", "3", "--rate", "2"], {}


def _errors(out: Path) -> list[tuple[str, str, str]]:
    """Each failed request's mode, id and error, for an assertion's message (a CI log shows it)."""
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return [(r.get("mode", ""), r["request_id"], r["error"]) for r in records if r.get("error")]


def _check_schema(results: dict, modes: list[str], n: int, errors: list) -> None:
    assert set(results) == {"workload", "settings", "modes", "outputs_match_across_modes", "environment"}
    assert results["environment"]["git_commit"] and results["environment"]["packages"]["torch"]
    assert list(results["modes"]) == modes
    for mode, m in results["modes"].items():
        assert set(m) == MODE_KEYS, mode
        assert m["requests"] == n and m["completed"] == n and m["failed"] == 0, (mode, errors, m)
        for key in ("ttft_ms", "ttst_ms", "itl_ms", "tpot_ms", "e2e_ms", "max_gap_ms"):
            assert set(m[key]) == LATENCY
        assert m["ttft_ms"]["p50"] > 0 and set(m["tokens_by_role"]) == {"prefill", "rld", "md"}
        assert m["median_ttft_ms"] == m["ttft_ms"]["p50"] and m["total_output_tokens"] > 0
        # every engine of the mode's fleet; prefill ran every prompt
        fleet = results["settings"]["instances"][mode]
        assert sorted(b["role"] for b in m["busy"].values()) == sorted(r for r, k in fleet.items() for _ in range(k))
        assert all(0 <= b["busy_fraction"] <= 1 for b in m["busy"].values()), m["busy"]
        assert m["busy"]["prefill-0"]["busy_fraction"] > 0, m["busy"]


@pytest.mark.background.with_args(_agentic)
def test_agentic_pdd_against_naive_cross_dc(background_job):
    run, tmp_path = background_job
    assert run.returncode == 0, run.stderr[-3000:]
    assert "3/3" in run.stderr  # the progress bar reached the end
    results = json.loads((tmp_path / "results.json").read_text())
    _check_schema(results, ["pd-wan", "pdd"], 3, _errors(tmp_path))
    assert results["outputs_match_across_modes"] == 1.0
    pd_wan, pdd = results["modes"]["pd-wan"], results["modes"]["pdd"]
    assert pdd["wan_kv_bytes"] <= pd_wan["wan_kv_bytes"]
    # pdd streams each first token from prefill; the naive baseline, from main-decode once its KV crossed
    assert (pdd["tokens_by_role"]["prefill"], pd_wan["tokens_by_role"]["prefill"]) == (3, 0)
    # the line's own counters: pd-wan's every prompt KV crossed A -> B, and the NATS link carried the ids
    assert pd_wan["wan_kv_bytes"] >= pd_wan["wan_kv_bytes_attributed"] > 0, pd_wan
    assert sum(n for f, n in pd_wan["line_bytes"]["a-b"].items() if f.startswith("nats-")) > 0, pd_wan["line_bytes"]
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all("pdd" in json.loads(line) for line in lines)
    for name in ("report.md", "ttft_cdf.png", "timeline.png", "hit_buckets.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "vs pd-wan" in (tmp_path / "report.md").read_text()


def _agentic_tools(out: Path) -> tuple[list[str], dict[str, str]]:
    argv = [sys.executable, "-m", "pdd.cli", "bench", "--workload", "agentic-tools", "--modes", "pdd"]
    return [*argv, "--out", str(out), "--requests", "4", "--rate", "2"], {}


@pytest.mark.background.with_args(_agentic_tools)
def test_agentic_sessions_calling_tools(background_job):
    """Each session's first turn must call a tool, later ones call or answer; the result of a call
    goes back as a tool message answering it. Every call parses; the time to it is reported."""
    run, tmp_path = background_job
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    calls = results["modes"]["pdd"]["tool_calls"]
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    errors = [(r["request_id"], r["error"]) for r in records if r["error"]]
    assert results["modes"]["pdd"]["completed"] == 4 and calls["requests"] >= 1, (errors, results["modes"]["pdd"])
    assert calls["arguments_parse"] == 1.0 and 0 < calls["complete_ms"]["p50"] <= calls["complete_ms"]["max"]
    first = min(records, key=lambda r: r["sent_s"])
    assert first["tool_calls"] and first["tool_calls"][0]["function"]["name"] in (
        "read_file",
        "run_tests",
        "search_code",
    )
    assert "## Tool calls" in (tmp_path / "report.md").read_text()
