"""`pdd sim experiments`: the report's four experiments at datacenter scale (docs/sim/README.md).

1. `scale`: 88 chip-A intra-DC PD vs naive cross-DC PD vs PDD on 43 A + 32 B + a line, on the
   Mooncake trace: cost, SLA goodput, BCR, TTFT P50/P90/P99, WAN bytes.
2. `bathtub`: BCR of PDD over the 88-A baseline against the average prefix hit (`hitmix:H`).
3. `oscillation` (sim/oscillation.py): a small relay pool; PDD with the guard, without it,
   with `p-rld` for low-hit traffic, and without DRC: relay load, the prefill-vs-MD hit gap
   and TTFT over time.
4. `wan_bytes`: WAN KV bytes with and without DRC at ~90% hit.
5-7. `headline`, `sensitivity`, `relay` (sim/headline.py): the report's headline at fleet scale
   on sized lines, BCR against line capacity / B's price / prefix hit, and the relay's share.
Each writes its PNG and a JSON of its figures into `--out` (default docs/sim); `sensitivity` and
`relay` read `headline`'s figures from experiments.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.trace import MOONCAKE_TRACE
from shared.pipelines import Role
from sim import headline
from sim.config import SimConfig, load_sim_config
from sim.oscillation import oscillation
from sim.plotting import plt, save
from sim.records import cost_per_hour
from sim.run import summarize
from sim.workload import hitmix, trace_requests

FLEET = "configs/sim/report-fleet.yaml"


def scale(cfg: SimConfig, out: Path, trace: str) -> dict:
    reqs = trace_requests(trace, block_tokens=512, time_scale=0.5, max_context=131072, loops=2)
    rows = {}
    for mode in ("pd-local", "pd-wan", "pd-wan-drc", "pdd"):
        t0 = time.perf_counter()
        s, _, _ = summarize(cfg, mode, reqs)
        rate = cost_per_hour(cfg, mode)
        rows[mode] = {
            "cost_per_hour": rate,
            "goodput_rps": s["goodput_rps"],
            "bcr": s["bcr"],
            "ttft_ms": s["ttft_ms"],
            "tpot_p50_ms": s["tpot_ms"]["p50"],
            "wan_kv_bytes": s["wan_kv_bytes"],
            "rld_share": s["tokens_by_role"][Role.RLD] / max(sum(s["tokens_by_role"].values()), 1),
            "wall_s": time.perf_counter() - t0,
        }
        print(f"  scale {mode}: {len(reqs)} requests in {rows[mode]['wall_s']:.1f}s", file=sys.stderr)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    modes = list(rows)
    axes[0].bar(modes, [rows[m]["cost_per_hour"] for m in modes], color="tab:gray")
    axes[0].set_title("hardware cost per hour (chip-A hours)")
    for k, p in enumerate(("p50", "p90", "p99")):
        axes[1].bar(
            [i + 0.27 * (k - 1) for i in range(len(modes))],
            [rows[m]["ttft_ms"][p] / 1000 for m in modes],
            0.27,
            label=p,
        )
    axes[1].set_xticks(range(len(modes)), modes)
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    axes[2].bar(modes, [rows[m]["bcr"] for m in modes], color="tab:green")
    axes[2].set_title("BCR (SLA goodput / hourly cost)")
    fig.suptitle(f"88 A intra-DC vs 43 A + 32 B + line: Mooncake trace x2, {len(reqs)} requests")
    save(fig, out / "scale.png")
    return {"requests": len(reqs), "modes": rows}


def bathtub(cfg: SimConfig, out: Path) -> dict:
    hits = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
    rows = []
    for h in hits:
        reqs = hitmix(1200, 0, 10.0, h, prompt_tokens=8192, output_tokens=256)
        row = {"hit": h}
        for mode in ("pd-local", "pd-wan", "pdd"):
            s, cluster, _ = summarize(cfg, mode, reqs)
            row[mode] = {
                "bcr": s["bcr"],
                "ttft_p90": s["ttft_ms"]["p90"],
                "wan_gbps": s["wan_kv_bytes"] * 8 / 1e9 / max(reqs[-1].arrival_ms / 1000, 1),
            }
        rows.append(row)
        print(
            f"  bathtub hit {h:.2f}: pdd/pd-local BCR {row['pdd']['bcr'] / max(row['pd-local']['bcr'], 1e-9):.2f}",
            file=sys.stderr,
        )
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    xs = [r["hit"] * 100 for r in rows]
    for mode in ("pdd", "pd-wan"):
        ax.plot(xs, [r[mode]["bcr"] / max(r["pd-local"]["bcr"], 1e-9) for r in rows], "o-", label=f"{mode} / pd-local")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("BCR relative to 88 A intra-DC")
    ax.legend()
    ax.set_title("The bathtub: benefit against average prefix hit (hitmix, 8K in / 256 out, 10 req/s)")
    ax2.plot(xs, [r["pdd"]["wan_gbps"] for r in rows], "o-", color="tab:red", label="PDD WAN demand (Gbps, mean)")
    ax2.plot(xs, [r["pdd"]["ttft_p90"] / 1000 for r in rows], "s-", color="tab:blue", label="PDD TTFT P90 (s)")
    ax2.set_xlabel("average prefix hit (%)")
    ax2.legend()
    save(fig, out / "bathtub.png")
    return {"rows": rows}


def wan_bytes(cfg: SimConfig, out: Path) -> dict:
    reqs = hitmix(1500, 1, 10.0, 0.9, prompt_tokens=8192, output_tokens=256)
    figures = {m: summarize(cfg, m, reqs)[0] for m in ("pd-wan", "pd-wan-drc", "pdd")}
    gb = {m: s["wan_kv_bytes"] / 1e9 for m, s in figures.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(gb), list(gb.values()), color=["tab:red", "tab:orange", "tab:green"])
    for i, v in enumerate(gb.values()):
        ax.text(i, v, f"{v:,.0f} GB ({v / gb['pd-wan']:.0%})", ha="center", va="bottom")
    ax.set_ylabel("WAN KV bytes (GB)")
    ax.set_title("WAN KV at ~90% prefix hit: DRC sends only the increment")
    save(fig, out / "wan_bytes.png")
    return {m: {"wan_gb": gb[m], "md_hit": s["hit_rate"][Role.MD], "ttft_ms": s["ttft_ms"]} for m, s in figures.items()}


def _with_table(out: Path, head: dict) -> dict:
    (out / "headline.md").write_text(headline.markdown(head))
    return head


def main(args: argparse.Namespace) -> int:
    cfg = load_sim_config(args.config if args.config != "configs/sim/single-host-cpu.yaml" else FLEET)
    out = Path(args.out if args.out != "sim-out" else "docs/sim")
    out.mkdir(parents=True, exist_ok=True)
    trace = args.workload[6:] if args.workload.startswith("trace:") else str(MOONCAKE_TRACE)
    path = out / "experiments.json"
    results = json.loads(path.read_text()) if path.exists() else {}  # a partial rerun keeps the others
    only = set(args.only.split(",")) if args.only else None
    for name, fn in (
        ("wan_bytes", lambda: wan_bytes(cfg, out)),
        ("scale", lambda: scale(cfg, out, trace)),
        ("oscillation", lambda: oscillation(cfg, out, trace)),
        ("bathtub", lambda: bathtub(cfg, out)),
        ("headline", lambda: _with_table(out, headline.headline(out, trace))),
        ("sensitivity", lambda: headline.sensitivity(out, results["headline"])),
        ("relay", lambda: headline.relay(out, trace, cfg, results["headline"])),
    ):
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        results[name] = fn()
        print(f"pdd sim experiments: {name} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        (out / "experiments.json").write_text(json.dumps(results, indent=1, default=float))
    return 0
