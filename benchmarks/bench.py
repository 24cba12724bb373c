"""`pdd bench`: PDD and its baselines side by side on one machine and one workload.

For each mode: start a fresh cluster on free ports with the launcher (the same code path as
`pdd up`), warm it up, replay the workload open-loop, record client-side SSE timestamps and
each response's `pdd` object, stop the cluster. Then summarise every mode and write
`results.json`, `requests.jsonl`, `report.md` and the plots into `--out`.

    pdd bench --workload agentic --modes pd-local,pd-wan,pdd --out bench-out [--quick]
    pdd bench --workload trace:benchmarks/data/mooncake_synthetic_trace.jsonl --max-requests 40 ...
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.modes import SLO_TTFT_MS, instance_counts, mode, mode_config, parse_modes
from benchmarks.report import write_report
from benchmarks.runner import replay, warm_up
from benchmarks.summary import build_results
from benchmarks.workloads import load_workload
from pdd.launcher import Cluster
from shared.runtime.models import load_tokenizer
from shared.runtime.provision import provision_default_model

SLO = {"ttft_ms": SLO_TTFT_MS, "tpot_ms": 400.0}
PRICES = {"chip_a": 1.0, "chip_b": 1.25, "wan_line": 0.5}  # chip B at the report's 1.2-1.3x of A


def _workload(args: argparse.Namespace):
    tokenizer = load_tokenizer(provision_default_model())
    n = min(args.requests, 12) if args.quick else args.requests
    trace_opts = {
        "block_tokens": args.block_tokens,
        "time_scale": args.time_scale,
        "output_scale": args.output_scale,
        "max_requests": args.max_requests or n,
    }
    return load_workload(
        args.workload, n_requests=n, seed=args.seed, rate_rps=args.rate, tokenizer=tokenizer, **trace_opts
    )


def run_mode(name: str, base: dict[str, Any] | None, workload) -> tuple[list[dict], float, dict]:
    cfg = mode_config(name, base)
    print(f"pdd bench: {name}: starting a cluster", file=sys.stderr)
    with Cluster(cfg, log=lambda m: None) as cluster:
        asyncio.run(warm_up(cluster.url))
        records, duration = asyncio.run(replay(cluster.url, workload, name))
    return records, duration, cfg


def main(args: argparse.Namespace) -> int:
    try:
        modes = parse_modes(args.modes)
    except ValueError as e:
        print(f"pdd bench: {e}", file=sys.stderr)
        return 2
    base = yaml.safe_load(Path(args.config).read_text()) if args.config else None
    workload = _workload(args)
    print(f"pdd bench: {workload.name}, {len(workload.requests)} requests, modes {modes}", file=sys.stderr)
    records, settings = (
        [],
        {
            "slo": SLO,
            "prices": PRICES,
            "instances": {},
            "duration_s": {},
            "wan": {},
            "md_in_other_dc": {},
            "seed": args.seed,
            "quick": args.quick,
        },
    )
    t0 = time.perf_counter()
    for name in modes:
        recs, duration, cfg = run_mode(name, base, workload)
        records += recs
        settings["instances"][name] = instance_counts(cfg)
        settings["duration_s"][name] = duration
        settings["wan"][name] = cfg["wan"]
        settings["md_in_other_dc"][name] = mode(name).wan
    results = build_results(workload.describe(), settings, records)
    paths = write_report(Path(args.out), results, records)
    print(
        f"pdd bench: done in {time.perf_counter() - t0:.0f}s; wrote {', '.join(str(p) for p in paths)}", file=sys.stderr
    )
    print(Path(args.out, "report.md").read_text())
    return 0
