"""`pdd sim validate`: the simulator against one or several real `pdd bench` runs on this host.

1. Read each real run (`--real`, once per run; results.json, and requests.jsonl when it kept one):
   its workload (generator, request count, seed, rate), its modes, each request's actual output
   length (the simulator cannot know where the model stopped, so it is given the lengths the
   model produced), and the knobs whose real default changed since (sim/real.py `as_recorded`:
   e.g. `handoff.warm_md_cache` off for a run recorded before it existed; `--as-config` keeps
   the config's).
2. Rebuild the same workload with the same generator and seed, simulate each mode on the
   single-host config (CPU profile measured by `pdd sim profile`, the same WAN settings). Runs
   with the same workload, output lengths and knobs share one simulation.
3. Compare per mode: TTFT P50/P90/P99, TPOT P50 and WAN KV bytes. Each figure is taken per run
   and averaged over the runs that have the mode: error = sim / mean(real) - 1 (sim: the mean
   over the runs' simulations, one figure when they share one), and the real runs' spread
   (min..max) is shown beside it. Targets: |error| <= 15% on P50 and <= 25% on P90.
   Written to `--out` as validation.md, validation.json (every run's own figures too) and
   validation_ttft.png (CDF, each real run solid, simulated dashed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import fmean

from benchmarks.summary import request_latencies
from sim import calibrate
from sim.config import load_sim_config
from sim.real import as_recorded, load_real, simulate_real

DEFAULT_REAL = "docs/bench-agentic"
METRICS = (
    ("TTFT P50", "ttft_ms", "p50", 0.15),
    ("TTFT P90", "ttft_ms", "p90", 0.25),
    ("TTFT P99", "ttft_ms", "p99", None),
    ("TPOT P50", "tpot_ms", "p50", 0.15),
    ("WAN KV bytes", "wan_kv_bytes", None, 0.15),
)


def _value(summary: dict, key: str, stat: str | None) -> float:
    return float(summary[key][stat] if stat else summary[key])


def compare(reals: list[dict], sims: list[dict]) -> list[dict]:
    """One row per mode and metric: the mean of the real runs (and each run's figure, min, max)
    against the simulator's (the mean of the runs' simulations; each run's too). `sims[k]` is
    the simulation of `reals[k]`; a mode counts the runs that have it."""
    rows = []
    modes = dict.fromkeys(m for r in reals for m in r["modes"])
    for mode in modes:
        pairs = [(r["modes"][mode], s["modes"][mode]) for r, s in zip(reals, sims, strict=True) if mode in r["modes"]]
        for name, key, stat, bound in METRICS:
            real_runs = [_value(r, key, stat) for r, _ in pairs]
            sim_runs = [_value(s, key, stat) for _, s in pairs]
            rv, sv = fmean(real_runs), fmean(sim_runs)
            err = sv / rv - 1 if rv else (0.0 if sv == 0 else None)
            ok = None if bound is None or err is None else abs(err) <= bound
            rows.append(
                {
                    "mode": mode,
                    "metric": name,
                    "real": rv,
                    "real_min": min(real_runs),
                    "real_max": max(real_runs),
                    "runs": len(real_runs),
                    "real_runs": real_runs,
                    "sim": sv,
                    "sim_runs": sim_runs,
                    "error": err,
                    "bound": bound,
                    "ok": ok,
                }
            )
    return rows


def markdown(rows: list[dict], cmd: str, runs: list[dict] | None = None) -> str:
    several = any(r.get("runs", 1) > 1 for r in rows)
    lines = [f"Command: `{cmd}`", ""]
    if runs:
        lines += [f"Real runs ({len(runs)}), each simulated with:"]
        lines += [f"- `{r['real']}`: {_knobs(r['settings'])} ({r['how']})" for r in runs]
        lines += [""]
    if several:
        lines += [
            "| mode | metric | real (mean) | real runs (min..max) | simulated | error | target | |",
            "|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines += ["| mode | metric | real | simulated | error | target | |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = (lambda v: f"{v / 1e6:,.1f} MB") if r["metric"] == "WAN KV bytes" else (lambda v: f"{v:,.0f} ms")
        err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
        bound = "" if r["bound"] is None else f"±{r['bound']:.0%}"
        mark = "" if r["ok"] is None else ("PASS" if r["ok"] else "MISS")
        spread = f" {fmt(r['real_min'])}..{fmt(r['real_max'])} ({r['runs']}) |" if several else ""
        lines.append(
            f"| {r['mode']} | {r['metric']} | {fmt(r['real'])} |{spread} {fmt(r['sim'])} | {err} | {bound} | {mark} |"
        )
    return "\n".join(lines) + "\n"


def _knobs(settings: dict) -> str:
    return ", ".join(f"{s}.{k} {str(v).lower()}" for s, values in settings.items() for k, v in values.items()) or (
        "the config as it is"
    )


def plot(path: Path, real_runs: list[list[dict]], sim_runs: list[list[dict]]) -> None:
    """TTFT CDFs per mode: every real run solid, every distinct simulation dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    modes = dict.fromkeys(r["mode"] for recs in real_runs for r in recs)
    for i, mode in enumerate(modes):
        color = f"C{i}"
        for runs, style, label in ((real_runs, "-", "real"), (sim_runs, "--", "sim")):
            for k, recs in enumerate(runs):
                xs = sorted(x.ttft_ms for x in (request_latencies(r) for r in recs if r["mode"] == mode) if x)
                if not xs:
                    continue
                ys = [(j + 1) / len(xs) for j in range(len(xs))]
                alpha = 1.0 if len(runs) == 1 else 0.6
                ax.step(xs, ys, style, color=color, alpha=alpha, lw=1.2, label=f"{mode} {label}" if k == 0 else None)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    n = len(real_runs)
    ax.set_title(f"Real pdd bench (solid{f', {n} runs' if n > 1 else ''}) vs simulated (dashed)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sim_key(real: dict, records: list[dict], knobs: dict) -> str:
    """What a simulation of this run depends on besides the config: runs equal here share one."""
    w = real["workload"]
    outputs = sorted((r["request_id"], int(r["output_tokens"])) for r in records if r["ok"])
    what = [w["name"], w["requests"], w["seed"], w["params"], sorted(real["modes"]), outputs, knobs]
    return json.dumps(what, sort_keys=True)


def real_dirs(args: argparse.Namespace) -> list[str]:
    """The --real folders (the option may be given several times; a single string is one run)."""
    real = getattr(args, "real", None)
    return [real] if isinstance(real, str) else list(real or [DEFAULT_REAL])


def main(args: argparse.Namespace) -> int:
    reals = real_dirs(args)
    if args.calibrate:
        if len(reals) != 1:
            print("pdd sim validate --calibrate: one --real run (the calibration run)", file=sys.stderr)
            return 2
        return calibrate.main(argparse.Namespace(**{**vars(args), "real": reals[0]}))
    cfg = load_sim_config(args.config)
    runs, real_results, sim_results, real_records = [], [], [], []
    shared: dict[str, tuple[dict, list[dict]]] = {}
    for folder in reals:
        real, records = load_real(Path(folder))
        as_config = getattr(args, "as_config", False)
        run_cfg, knobs, how = (cfg, {}, "--as-config") if as_config else as_recorded(cfg, real)
        print(f"pdd sim validate: {folder}: {_knobs(knobs)} ({how})", file=sys.stderr)
        key = _sim_key(real, records, knobs)
        if key not in shared:
            shared[key] = simulate_real(real, records, run_cfg)
        simulated, _ = shared[key]
        runs.append({"real": folder, "settings": knobs, "how": how, "simulation": list(shared).index(key)})
        real_results.append(real)
        sim_results.append(simulated)
        real_records.append(records)
    rows = compare(real_results, sim_results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = " --as-config" if getattr(args, "as_config", False) else ""
    cmd = f"pdd sim validate {' '.join(f'--real {r}' for r in reals)} --config {args.config}{flags} --out {args.out}"
    text = markdown(rows, cmd, runs)
    (out / "validation.md").write_text(text)
    doc = {
        "command": cmd,
        "config": args.config,
        "runs": runs,
        "rows": rows,
        "simulated": [s for s, _ in shared.values()],
    }
    (out / "validation.json").write_text(json.dumps(doc, indent=1))
    if any(real_records):
        plot(out / "validation_ttft.png", [r for r in real_records if r], [recs for _, recs in shared.values()])
    print(text)
    return 0
