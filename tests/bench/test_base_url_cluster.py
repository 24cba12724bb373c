"""`pdd bench --base-url` against a running PDD cluster gives the TTFT the bench's own cluster
mode measures: one cluster, the bench's replay against it, then the `--base-url` command line
against the same cluster with the same workload shape.

The two replays draw their random prompts from different seeds: the same prompts twice would
hit prefill's prefix cache the second time and make that run look faster than it is."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from benchmarks.bench import measure
from benchmarks.busy import BusyProbe
from benchmarks.modes import instance_counts, mode_config
from benchmarks.runner import Target
from benchmarks.summary import build_results
from benchmarks.workloads import load_workload
from pdd.control import write_state
from pdd.launcher import Cluster

pytestmark = pytest.mark.slow

N, RATE, INPUT, OUTPUT = 8, 1.0, 128, 16


def test_base_url_against_a_running_cluster_matches_the_cluster_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("PDD_STATE_DIR", str(tmp_path / "state"))  # the bench finds this cluster, no other
    cfg = mode_config("pdd")
    shape = {"n_requests": N, "rate_rps": RATE, "random_input_len": INPUT, "random_output_len": OUTPUT}
    workload = load_workload("random", seed=0, **shape)
    cmd = [sys.executable, "-m", "pdd.cli", "bench", "--workload", "random", "--requests", str(N), "--rate", str(RATE)]
    cmd += ["--random-input-len", str(INPUT), "--random-output-len", str(OUTPUT), "--seed", "1"]
    with Cluster(cfg, log=lambda m: None) as cluster:
        write_state(cluster.url, cluster.cfg.port, cluster.config_path)  # as `pdd up` does
        probe = BusyProbe(cluster.nats_url(), cluster.secrets)
        records, duration, busy = asyncio.run(measure(Target(cluster.url), workload, "cluster", probe))
        run = subprocess.run(
            cmd + ["--base-url", cluster.url, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
        )
    assert run.returncode == 0, run.stderr[-3000:]
    settings = {"duration_s": {"cluster": duration}, "instances": {"cluster": instance_counts(cfg)}}
    own = build_results(workload.describe(), settings, records, {"cluster": busy})["modes"]["cluster"]
    results = json.loads((tmp_path / "results.json").read_text())
    other = results["modes"]["base-url"]

    print(f"\nTTFT ms (N={N}, {INPUT} in / {OUTPUT} out, {RATE} req/s), cluster mode vs --base-url:", file=sys.stderr)
    for stat in ("p50", "p90", "p99", "mean"):
        print(f"  {stat:<5} {own['ttft_ms'][stat]:8.1f} {other['ttft_ms'][stat]:8.1f}", file=sys.stderr)
    for iid in sorted(busy or {}):
        print(
            f"  busy {iid:<10} {busy[iid]['busy_fraction']:.3f} {other['busy'][iid]['busy_fraction']:.3f}",
            file=sys.stderr,
        )

    assert own["completed"] == other["completed"] == N
    a, b = own["ttft_ms"]["p50"], other["ttft_ms"]["p50"]
    assert 0 < max(a, b) / min(a, b) <= 2.0, (a, b)
    assert other["median_ttft_ms"] == b and other["total_output_tokens"] <= N * OUTPUT
    # a PDD server sends the pdd object through the OpenAI path, and the bench found its NATS
    assert other["tokens_by_role"] is not None and other["hit_rate"] is not None
    assert results["settings"]["target"]["pdd_cluster_on_this_host"] is True
    assert set(busy) == set(other["busy"]) == {"prefill-0", "rld-0", "md-0"}
    assert busy["prefill-0"]["busy_fraction"] > 0 and other["busy"]["prefill-0"]["busy_fraction"] > 0
