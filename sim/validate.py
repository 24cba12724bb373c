"""`pdd sim validate`: the simulator against a real `pdd bench` run on this host.

1. Read the real run (results.json, and requests.jsonl when it kept one): its workload (generator, request count,
   seed, rate), its modes, and each request's actual output length (the simulator cannot know
   where the model stopped, so it is given the lengths the model produced).
2. Rebuild the same workload with the same generator and seed, simulate each mode on the
   single-host config (CPU profile measured by `pdd sim profile`, the same WAN settings).
3. Compare per mode: TTFT P50/P90/P99, TPOT P50 and WAN KV bytes; error = sim / real - 1.
   Targets: |error| <= 15% on P50 and <= 25% on P90. Written to `--out` as validation.md,
   validation.json and validation_ttft.png (CDF, real solid, simulated dashed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.summary import request_latencies
from sim import calibrate
from sim.config import load_sim_config
from sim.real import load_real, simulate_real

METRICS = (
    ("TTFT P50", "ttft_ms", "p50", 0.15),
    ("TTFT P90", "ttft_ms", "p90", 0.25),
    ("TTFT P99", "ttft_ms", "p99", None),
    ("TPOT P50", "tpot_ms", "p50", 0.15),
    ("WAN KV bytes", "wan_kv_bytes", None, 0.15),
)


def _value(summary: dict, key: str, stat: str | None) -> float:
    return float(summary[key][stat] if stat else summary[key])


def compare(real: dict, simulated: dict) -> list[dict]:
    rows = []
    for mode, r in real["modes"].items():
        s = simulated["modes"][mode]
        for name, key, stat, bound in METRICS:
            rv, sv = _value(r, key, stat), _value(s, key, stat)
            err = sv / rv - 1 if rv else (0.0 if sv == 0 else None)
            ok = None if bound is None or err is None else abs(err) <= bound
            rows.append({"mode": mode, "metric": name, "real": rv, "sim": sv, "error": err, "bound": bound, "ok": ok})
    return rows


def markdown(rows: list[dict], cmd: str) -> str:
    lines = [
        f"Command: `{cmd}`",
        "",
        "| mode | metric | real | simulated | error | target | |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = (lambda v: f"{v / 1e6:,.1f} MB") if r["metric"] == "WAN KV bytes" else (lambda v: f"{v:,.0f} ms")
        err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
        bound = "" if r["bound"] is None else f"±{r['bound']:.0%}"
        mark = "" if r["ok"] is None else ("PASS" if r["ok"] else "MISS")
        lines.append(f"| {r['mode']} | {r['metric']} | {fmt(r['real'])} | {fmt(r['sim'])} | {err} | {bound} | {mark} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, real_records: list[dict], sim_records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in real_records)):
        color = f"C{i}"
        for recs, style, label in ((real_records, "-", "real"), (sim_records, "--", "sim")):
            xs = sorted(x.ttft_ms for x in (request_latencies(r) for r in recs if r["mode"] == mode) if x)
            ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], style, color=color, label=f"{mode} {label}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("Real pdd bench (solid) vs simulated (dashed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate.main(args)
    real, real_records = load_real(Path(args.real))
    simulated, sim_records = simulate_real(real, real_records, load_sim_config(args.config))
    rows = compare(real, simulated)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = f"pdd sim validate --real {args.real} --config {args.config} --out {args.out}"
    (out / "validation.md").write_text(markdown(rows, cmd))
    (out / "validation.json").write_text(json.dumps({"rows": rows, "simulated": simulated}, indent=1))
    if real_records:
        plot(out / "validation_ttft.png", real_records, sim_records)
    print(markdown(rows, cmd))
    return 0
