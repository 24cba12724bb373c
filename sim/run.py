"""`pdd sim`: the modes of `pdd bench`, simulated on a fleet described by a YAML file.

    pdd sim --config configs/sim/single-host-cpu.yaml --workload agentic --requests 24 --rate 0.4 \
            --modes pd-local,pd-wan,pd-wan-drc,pdd --out sim-out
    pdd sim --config configs/sim/report-fleet.yaml --workload trace:../shared/data/mooncake_synthetic_trace.jsonl \
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

from benchmarks.args import MODES, parse_modes
from benchmarks.report import write_report
from benchmarks.summary import build_results
from sim.cluster import SimCluster
from sim.config import SimConfig, load_sim_config
from sim.records import record, settings
from sim.request import RequestRun, SimRequest
from sim.workload import load_sim_workload


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", choices=["run", "profile", "validate", "experiments"], default="run")
    p.add_argument("--config", default="configs/sim/single-host-cpu.yaml", help="fleet YAML (configs/sim/)")
    p.add_argument("--workload", default="agentic", help="agentic | random | trace:FILE | hitmix:H")
    p.add_argument("--modes", default="pd-local,pd-wan,pdd", help=f"comma-separated: {','.join(MODES)}")
    p.add_argument("--out", default="sim-out")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5, help="arrivals per second (agentic, random, hitmix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=16, help="trace: tokens per 512-token block")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--output-scale", type=float, default=1.0, help="trace: multiply output lengths")
    p.add_argument("--max-requests", type=int, default=None, help="trace: take the first N lines")
    p.add_argument("--max-context", type=int, default=8192, help="trace: longest prompt + answer")
    p.add_argument("--loops", type=int, default=1, help="trace: replay it this many times back to back")
    p.add_argument("--max-plot-requests", type=int, default=5000)
    p.add_argument("--no-tokenizer", action="store_true", help="agentic: estimate token counts (chars/3)")
    p.add_argument("--real", default="docs/bench-agentic", help="validate: the real `pdd bench` run's folder")
    p.add_argument("--only", default="", help="experiments: a subset, e.g. oscillation,bathtub")
    p.add_argument("--calibrate", action="store_true",
                   help="validate: fit the config's host: costs to --real instead (sim/calibrate.py)")
    p.add_argument("--threads", type=int, default=1, help="profile: torch threads (the bench's instances use 1)")
    p.add_argument("--name", default="cpu-2core-smollm2-fp32", help="profile: its name in the YAML")
    p.add_argument("--profile-out", default="configs/sim/cpu-profile.yaml", help="profile: where to write it")


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


def simulate(cfg: SimConfig, mode: str, requests: list[SimRequest], seed: int = 0, progress: bool = False,
             sample_every_ms: float = 0.0) -> tuple[list[RequestRun], SimCluster]:  # fmt: skip
    horizon = (requests[-1].arrival_ms if requests else 0.0) * 2 + 600_000.0
    block_tokens = requests[0].block_tokens if requests else 16
    cluster = SimCluster(cfg, mode, block_tokens, horizon, seed)
    return cluster.run(requests, progress=progress, sample_every_ms=sample_every_ms), cluster


def run_modes(cfg: SimConfig, modes: list[str], requests: list[SimRequest], info: dict, seed: int,
              progress: bool = True) -> tuple[dict, list[dict]]:  # fmt: skip
    runs: dict[str, list[RequestRun]] = {}
    records: list[dict] = []
    for mode in modes:
        t0 = time.perf_counter()
        runs[mode], cluster = simulate(cfg, mode, requests, seed, progress)
        records += [record(r, mode) for r in runs[mode]]
        print(f"pdd sim: {mode}: {len(requests)} requests, {cluster.loop.events:,} events, "
              f"{time.perf_counter() - t0:.1f}s wall", file=sys.stderr)  # fmt: skip
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
        args.workload, n_requests=args.requests, seed=args.seed, rate_rps=args.rate, tokenizer=tokenizer,
        block_tokens=args.block_tokens, time_scale=args.time_scale, output_scale=args.output_scale,
        max_requests=args.max_requests, max_context=args.max_context, loops=args.loops)  # fmt: skip
    print(f"pdd sim: {info['name']}, {len(requests)} requests, modes {modes}, config {args.config}", file=sys.stderr)
    results, records = run_modes(cfg, modes, requests, info, args.seed)
    out = Path(args.out)
    if len(records) <= args.max_plot_requests * len(modes):
        write_report(out, results, records)
        print(Path(out, "report.md").read_text())
    else:
        from sim.output import write_plain

        write_plain(out, results, records)
    print(f"pdd sim: wrote {out}", file=sys.stderr)
    return 0
