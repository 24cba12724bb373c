"""`pdd sim`: the modes of `pdd bench`, simulated on a fleet described by a YAML file.

    pdd sim --config configs/sim/single-host-cpu.yaml --workload agentic --requests 24 --rate 0.4 \
            --modes pd-local,pd-wan,pd-wan-drc,pdd --out sim-out
    pdd sim --config configs/sim/report-fleet.yaml --workload trace:benchmarks/data/mooncake_synthetic_trace.jsonl \
            --block-tokens 512 --max-context 131072 --loops 4 --modes pd-local,pd-wan,pdd --out sim-out

Writes what `pdd bench` writes (results.json, requests.jsonl, report.md and its plots; the
plots are skipped above `--max-plot-requests`), computed by the same summary code.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from benchmarks.modes import parse_modes
from benchmarks.report import write_report
from benchmarks.summary import build_results
from sim.cluster import SimCluster
from sim.config import SimConfig, load_sim_config
from sim.output import write_plain
from sim.records import record, settings
from sim.request import RequestRun, SimRequest
from sim.workload import load_sim_workload


@functools.cache
def tokenizer_or_none(disabled: bool = False):
    """SmolLM2's tokenizer when the model folder is already provisioned (token counts as the bench)."""
    if disabled:
        return None
    try:
        from shared.runtime.models import load_tokenizer
        from shared.runtime.provision import default_model_dir

        folder = Path(default_model_dir())
        return load_tokenizer(folder) if (folder / "config.json").exists() else None
    except Exception as e:  # a tokenizer only sharpens token counts; the simulation runs without
        print(f"pdd sim: no tokenizer ({type(e).__name__}: {e}); estimating token counts", file=sys.stderr)
        return None


def simulate(
    cfg: SimConfig,
    mode: str,
    requests: list[SimRequest],
    seed: int = 0,
    progress: bool = False,
    sample_every_ms: float = 0.0,
) -> tuple[list[RequestRun], SimCluster]:
    horizon = (requests[-1].arrival_ms if requests else 0.0) * 2 + 600_000.0
    block_tokens = requests[0].block_tokens if requests else 16
    cluster = SimCluster(cfg, mode, block_tokens, horizon, seed)
    return cluster.run(requests, progress=progress, sample_every_ms=sample_every_ms), cluster


def summarize(cfg: SimConfig, mode: str, requests: list[SimRequest], **kw) -> tuple[dict, SimCluster, list[RequestRun]]:
    """Simulate one mode; its `pdd bench` summary (benchmarks/summary.py), the cluster and the runs."""
    runs, cluster = simulate(cfg, mode, requests, **kw)
    results = build_results({}, settings(cfg, [mode], {mode: runs}, 0), [record(r, mode) for r in runs])
    return results["modes"][mode], cluster, runs


def run_modes(
    cfg: SimConfig, modes: list[str], requests: list[SimRequest], info: dict, seed: int, progress: bool = True
) -> tuple[dict, list[dict]]:
    runs: dict[str, list[RequestRun]] = {}
    records: list[dict] = []
    for mode in modes:
        t0 = time.perf_counter()
        runs[mode], cluster = simulate(cfg, mode, requests, seed, progress)
        records += [record(r, mode) for r in runs[mode]]
        print(
            f"pdd sim: {mode}: {len(requests)} requests, {cluster.loop.events:,} events, "
            f"{time.perf_counter() - t0:.1f}s wall",
            file=sys.stderr,
        )
    return build_results(info, settings(cfg, modes, runs, seed), records), records


def main(args: argparse.Namespace) -> int:
    try:
        modes = parse_modes(args.modes)
    except ValueError as e:
        print(f"pdd sim: {e}", file=sys.stderr)
        return 2
    cfg = load_sim_config(args.config)
    tokenizer = tokenizer_or_none(args.no_tokenizer) if args.workload in ("agentic",) else None
    requests, info = load_sim_workload(
        args.workload,
        n_requests=args.requests,
        seed=args.seed,
        rate_rps=args.rate,
        tokenizer=tokenizer,
        block_tokens=args.block_tokens,
        time_scale=args.time_scale,
        output_scale=args.output_scale,
        max_requests=args.max_requests,
        max_context=args.max_context,
        loops=args.loops,
    )
    print(f"pdd sim: {info['name']}, {len(requests)} requests, modes {modes}, config {args.config}", file=sys.stderr)
    results, records = run_modes(cfg, modes, requests, info, args.seed)
    out = Path(args.out)
    if len(records) <= args.max_plot_requests * len(modes):
        write_report(out, results, records)
        print(Path(out, "report.md").read_text())
    else:
        write_plain(out, results, records)
    print(f"pdd sim: wrote {out}", file=sys.stderr)
    return 0
