"""`pdd bench --base-url` against the running session cluster: it measures TTFT as the bench's
own replay does on the same cluster, finds the cluster's NATS for the busy fractions, and
replays a Mooncake-format trace. (A `pdd bench` that starts its own clusters per mode:
tests/bench/test_bench_run.py.)

The two replays send the same workload (prompts and arrival times), with every prefix cache
flushed between them. Their TTFT is compared request by request with the server's own (the
gateway's `timings_ms.ttft`), not run against run: near saturation queueing alone moved the
median of one run of 8 requests 2x from another's on a slow machine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from benchmarks.bench import measure
from benchmarks.busy import BusyProbe
from benchmarks.runner import Target
from benchmarks.summary import build_results, request_latencies
from benchmarks.workloads import load_workload
from pdd.control import write_state
from tests.bench.test_workloads import _trace_file

pytestmark = pytest.mark.slow

N, RATE, INPUT, OUTPUT = 8, 2.0, 128, 16


@pytest.fixture
def bench_cli(cluster, tmp_path, monkeypatch):
    """`pdd bench ... --base-url` against the session cluster, which it finds as `pdd up`'s."""
    monkeypatch.setenv("PDD_STATE_DIR", str(tmp_path / "state"))  # the bench finds this cluster, no other
    write_state(cluster.url, cluster.cfg.port, cluster.config_path)

    def run(out, *args: str) -> dict:
        cmd = [sys.executable, "-m", "pdd.cli", "bench", *args, "--base-url", cluster.url, "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((out / "results.json").read_text())

    return run


def test_base_url_against_a_running_cluster_matches_the_bench_replay(cluster, operator, bench_cli, tmp_path):
    shape = {"n_requests": N, "rate_rps": RATE, "random_input_len": INPUT, "random_output_len": OUTPUT}
    workload = load_workload("random", seed=0, **shape)
    probe = BusyProbe(cluster.nats_url(), cluster.secrets)
    records, duration, busy = asyncio.run(measure(Target(cluster.url), workload, "cluster", probe))
    for instance in cluster.cfg.instances:
        assert operator.flush(instance.id).figures.engine.cached_blocks == 0
    args = ["--workload", "random", "--requests", str(N), "--rate", str(RATE), "--seed", "0"]
    results = bench_cli(tmp_path, *args, "--random-input-len", str(INPUT), "--random-output-len", str(OUTPUT))
    counts = {r: len(cluster.cfg.of_role(r)) for r in ("prefill", "rld", "md")}
    settings = {"duration_s": {"cluster": duration}, "instances": {"cluster": counts}}
    own = build_results(workload.describe(), settings, records, {"cluster": busy})["modes"]["cluster"]
    other = results["modes"]["base-url"]

    print(f"\nTTFT ms (N={N}, {INPUT} in / {OUTPUT} out, {RATE} req/s), bench replay vs --base-url:", file=sys.stderr)
    for stat in ("p50", "p90", "p99", "mean"):
        print(f"  {stat:<5} {own['ttft_ms'][stat]:8.1f} {other['ttft_ms'][stat]:8.1f}", file=sys.stderr)
    for iid in sorted(busy or {}):
        print(
            f"  busy {iid:<10} {busy[iid]['busy_fraction']:.3f} {other['busy'][iid]['busy_fraction']:.3f}",
            file=sys.stderr,
        )

    assert own["completed"] == other["completed"] == N
    cli_records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    for recs in (records, cli_records):
        _ttft_is_the_servers_plus_the_trip(recs)
    assert other["median_ttft_ms"] == other["ttft_ms"]["p50"] and other["total_output_tokens"] <= N * OUTPUT
    # a PDD server sends the pdd object through the OpenAI path, and the bench found its NATS
    assert other["tokens_by_role"] is not None and other["hit_rate"] is not None
    assert results["settings"]["target"]["pdd_cluster_on_this_host"] is True
    assert set(busy) == set(other["busy"]) == {"prefill-0", "rld-0", "md-0"}
    assert busy["prefill-0"]["busy_fraction"] > 0 and other["busy"]["prefill-0"]["busy_fraction"] > 0


def _ttft_is_the_servers_plus_the_trip(records: list[dict]) -> None:
    """Each request's TTFT as the bench measured it spans the server's own (the gateway's
    `timings_ms.ttft`, from admission to the first token) plus the HTTP trip, and ends before
    the server finished the request: the first token, not the role chunk or the last token."""
    long_ones = 0
    for r in records:
        client = request_latencies(r).ttft_ms
        server = r["pdd"]["timings_ms"]
        print(f"  {r['request_id']}: client {client:7.1f} ms, server {server['ttft']:7.1f} ms", file=sys.stderr)
        assert server["ttft"] <= client, r
        if r["output_tokens"] >= 12:  # the last token comes many decode steps after the first
            long_ones += 1
            assert client < server["e2e"], r
    assert long_ones >= len(records) // 2, [r["output_tokens"] for r in records]


def test_a_mooncake_trace_replays_against_the_cluster(bench_cli, tmp_path):
    trace = _trace_file(tmp_path)
    # 4 tokens per 512-token block: prompts of ~190-320 tokens (16 made ~750-1,250: 25 s of the suite)
    args = ["--workload", f"trace:{trace}", "--max-requests", "3", "--time-scale", "0.01", "--block-tokens", "4"]
    results = bench_cli(tmp_path / "out", *args)
    assert results["workload"]["name"].startswith("trace") and results["workload"]["requests"] == 3
    run = results["modes"]["base-url"]
    assert run["requests"] == run["completed"] == 3 and run["failed"] == 0, run
    assert run["ttft_ms"]["p50"] > 0 and run["total_output_tokens"] > 0
    assert run["tokens_by_role"] is not None and run["busy"]["prefill-0"]["busy_fraction"] > 0
