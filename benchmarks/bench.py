"""`pdd bench`: PDD and its baselines side by side on one machine and one workload, or one
workload against any running OpenAI-compatible server.

For each mode: start a fresh cluster on free ports with the launcher (the same code path as
`pdd up`), warm it up, read the scheduler's registry view, replay the workload open-loop, read it
again (each instance's busy fraction, benchmarks/busy.py), record client-side SSE timestamps and
each response's `pdd` object, stop the cluster. Then summarise every mode and write
`results.json`, `requests.jsonl`, `report.md` and the plots into `--out`.

With `--base-url` no cluster is started: the workload is replayed against that server (another
PDD deployment, vLLM, SGLang), as one run named `--label`. The `pdd` object is used when the
server sends one; without it the figures that need it are missing (None), not zeros. Busy
fractions come when the URL is a `pdd up` cluster on this host, and are left out otherwise.

    pdd bench --workload agentic --modes pd-local,pd-wan,pdd --out bench-out [--quick]
    pdd bench --workload trace:benchmarks/data/mooncake_synthetic_trace.jsonl --max-requests 40 ...
    pdd bench --base-url http://127.0.0.1:8000 --workload random --random-input-len 512 \\
              --random-output-len 64 --goodput ttft:2000 tpot:400 --max-concurrency 8 --out vllm-out
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.busy import BusyProbe, local_cluster_probe
from benchmarks.environment import environment
from benchmarks.modes import NATIVE, SLO_TTFT_MS, instance_counts, mode, mode_config, parse_modes
from benchmarks.report import write_report
from benchmarks.runner import Target, replay, served_model, warm_up
from benchmarks.summary import build_results
from benchmarks.vllm_compat import parse_goodput
from benchmarks.workloads import load_workload

SLO = {"ttft_ms": SLO_TTFT_MS, "tpot_ms": 400.0}
PRICES = {"chip_a": 1.0, "chip_b": 1.25, "wan_line": 0.5}  # chip B at the report's 1.2-1.3x of A


def _workload(args: argparse.Namespace):
    tokenizer = None
    if args.workload.startswith("agentic"):  # its prompts are sized in the default model's tokens
        from shared.runtime.models import load_tokenizer
        from shared.runtime.provision import provision_default_model

        tokenizer = load_tokenizer(provision_default_model())
    n = min(args.requests, 12) if args.quick else args.requests
    trace_opts = {
        "block_tokens": args.block_tokens,
        "time_scale": args.time_scale,
        "output_scale": args.output_scale,
        "max_requests": args.max_requests or n,
    }
    return load_workload(
        args.workload,
        n_requests=n,
        seed=args.seed,
        rate_rps=args.rate,
        tokenizer=tokenizer,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        **trace_opts,
    )


async def measure(target: Target, workload, label: str, probe: BusyProbe | None = None):
    """Warm up, then replay with the registry view read before and after (when `probe`).
    Returns (records, duration_s, busy fractions or None)."""
    await warm_up(target)
    if probe is not None:
        await probe.start()
    records, duration = await replay(target, workload, label)
    busy = await probe.stop() if probe is not None else None
    return records, duration, busy


def run_mode(name: str, base: dict[str, Any] | None, workload, args: argparse.Namespace | None = None):
    """One mode on a fresh cluster: (records, duration_s, cluster config, busy fractions)."""
    from pdd.launcher import Cluster

    cfg = mode_config(name, base, getattr(args, "kv_wire", NATIVE), getattr(args, "decode_dtype", "float32"))
    print(f"pdd bench: {name}: starting a cluster", file=sys.stderr)
    with Cluster(cfg, log=lambda m: None) as cluster:
        target = _target(cluster.url, args)
        probe = BusyProbe(
            cluster.nats_url(), cluster.secrets, cluster.cfg.wan.name if cluster.cfg.wan.enabled else None
        )
        records, duration, busy = asyncio.run(measure(target, workload, name, probe))
    if probe.line_bytes is not None:
        cfg["line_bytes"] = probe.line_bytes  # what the line carried during the replay (benchmarks/busy.py)
    cfg["instance_threads"] = {i.id: i.threads for i in cluster.cfg.instances}  # "auto" resolved for this host
    return records, duration, cfg, busy


def _target(url: str, args: argparse.Namespace | None, model: str | None = None) -> Target:
    if args is None:
        return Target(url)
    return Target(url, args.api_key, model, args.ignore_eos, args.max_concurrency)


def server_root(base_url: str) -> str:
    """What `vllm bench serve --base-url` takes: the server's root; a trailing `/` or `/v1` goes."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def run_base_url(args: argparse.Namespace, workload, settings: dict[str, Any]):
    """The workload against a running server: (records, busy fractions or None)."""
    url = server_root(args.base_url)
    target = _target(url, args)
    model = args.model or asyncio.run(served_model(target))
    target = _target(url, args, model)
    probe = local_cluster_probe(url)
    settings["target"] = {"base_url": url, "model": model, "pdd_cluster_on_this_host": probe is not None}
    print(f"pdd bench: {args.label}: {url} (model {model or 'not named'})", file=sys.stderr)
    records, duration, busy = asyncio.run(measure(target, workload, args.label, probe))
    settings["duration_s"][args.label] = duration
    return records, {args.label: busy} if busy is not None else None


def _problem(args: argparse.Namespace) -> str:
    try:
        parse_goodput(args.goodput)
    except ValueError as e:
        return str(e)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return f"--max-concurrency {args.max_concurrency} must be >= 1"
    if args.random_input_len < 1 or args.random_output_len < 1:
        return "--random-input-len and --random-output-len must be >= 1"
    return ""


def main(args: argparse.Namespace) -> int:
    try:
        modes = [] if args.base_url else parse_modes(args.modes)
    except ValueError as e:
        print(f"pdd bench: {e}", file=sys.stderr)
        return 2
    if problem := _problem(args):
        print(f"pdd bench: {problem}", file=sys.stderr)
        return 2
    base = yaml.safe_load(Path(args.config).read_text()) if args.config else None
    workload = _workload(args)
    what = f"against {args.base_url}" if args.base_url else f"modes {modes}"
    print(f"pdd bench: {workload.name}, {len(workload.requests)} requests, {what}", file=sys.stderr)
    settings: dict[str, Any] = {
        "slo": SLO,
        "goodput": parse_goodput(args.goodput),
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "prices": PRICES,
        "instances": {},
        "duration_s": {},
        "wan": {},
        "md_in_other_dc": {},
        "seed": args.seed,
        "quick": args.quick,
    }
    t0 = time.perf_counter()
    records: list[dict] = []
    busy: dict[str, Any] = {}
    threads: dict[str, int] = {}
    if args.base_url:
        records, measured = run_base_url(args, workload, settings)
        busy |= measured or {}
    for name in modes:
        recs, duration, cfg, measured = run_mode(name, base, workload, args)
        records += recs
        settings["instances"][name] = instance_counts(cfg)
        settings["duration_s"][name] = duration
        settings["wan"][name] = cfg["wan"]
        settings["md_in_other_dc"][name] = mode(name).wan
        if "line_bytes" in cfg:
            settings.setdefault("line_bytes", {})[name] = cfg.pop("line_bytes")
        threads |= cfg["instance_threads"]
        if measured is not None:
            busy[name] = measured
    results = build_results(workload.describe(), settings, records, busy)
    results["environment"] = environment(threads)
    paths = write_report(Path(args.out), results, records)
    print(
        f"pdd bench: done in {time.perf_counter() - t0:.0f}s; wrote {', '.join(str(p) for p in paths)}", file=sys.stderr
    )
    print(Path(args.out, "report.md").read_text())
    return 0
