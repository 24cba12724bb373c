"""Experiments 5-7 (docs/sim/README.md): the report's headline at fleet scale, when PDD pays, and
why the relay streams what it streams.

5. `headline`: both chip pairs (`PAIRS`) and both workloads that match the report's (agent
   sessions at fleet scale, `agents`; the Mooncake trace at 2x its rate), each on a line sized
   for PDD (sim/sizing.py): every mode, PDD without the scheduler's relay-finishes and
   line-backlog rules (services/scheduler/policy.py; `pdd` has them, as the scheduler does by
   default), and naive cross-DC PD on a line sized for it.
6. `sensitivity`: BCR of PDD over 88 A intra-DC against (a) the line's capacity (its price
   scales with it), (b) B's price relative to A (arithmetic on experiment 5's goodputs), (c) the
   average prefix hit (`hitmix`, agent-sized requests), each pair on its experiment-5 line.
7. `relay`: experiment 1 request by request (`anatomy`: did the relay stream the whole answer,
   and did the policy know it would?) without the two rules, with relay-finishes alone and with
   both, the trace on its sized line, and the report's 64K-in / 1K-out set-up at ~90% hit for
   the relay's share, each with and without the rules.
Each writes its PNGs into `--out` and returns its figures for experiments.json.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from shared.pipelines import Pipeline, Role
from sim.config import SimConfig, load_sim_config
from sim.plotting import plt, save
from sim.records import cost_per_hour
from sim.request import RequestRun, SimRequest
from sim.run import simulate, summarize
from sim.sizing import smallest_line_gbps
from sim.workload import agents, hitmix, reuse, trace_requests

PAIRS = {"H100 + H200": "configs/sim/report-fleet.yaml", "H100 + H20": "configs/sim/report-fleet-h20.yaml"}
AGENT_REQUESTS, AGENT_RATE = 12_000, 60.0  # offered rate: 512 agents keep ~40 req/s going, 88 A saturate
UNBOUNDED_MBPS = 1e7  # 10 Tbps: a line that holds nothing back, to measure demand
MODES = ("pd-local", "pd-wan", "pd-wan-drc", "pdd")
RULES_OFF = "pdd, rules off"  # without relay-finishes and line-backlog (services/scheduler/policy.py)
LINE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
PRICES = tuple(round(0.3 + 0.05 * k, 2) for k in range(28))  # B's price / A's: 0.3 .. 1.65
HITS = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
HIT_REQUESTS, HIT_RATE = 3000, 20.0
LONG = {"prompt_tokens": 65536, "output_tokens": 1024, "hit": 0.9, "rate": 8.0, "requests": 2000}


def with_line(cfg: SimConfig, gbps: float) -> SimConfig:
    return dataclasses.replace(cfg, wan={**cfg.wan, "bandwidth_mbps": gbps * 1000.0})


def with_rules(cfg: SimConfig, **knobs: bool) -> SimConfig:
    """`cfg` with the scheduler's `relay_finishes` / `line_backlog` knobs set (both off by default:
    on the live agentic bench relay-finishes starves main-decode's cache, docs/sim/README.md)."""
    return dataclasses.replace(cfg, scheduler={**cfg.scheduler, **knobs})


def rules_on(cfg: SimConfig) -> SimConfig:
    """PDD as this page's headline runs it at fleet scale: both rules on."""
    return with_rules(cfg, relay_finishes=True, line_backlog=True)


def rules_off(cfg: SimConfig) -> SimConfig:
    return with_rules(cfg, relay_finishes=False, line_backlog=False)


def figures(cfg: SimConfig, mode: str, reqs: list[SimRequest], label: str = "") -> tuple[dict, list[RequestRun]]:
    """One mode's row: price, SLA goodput, BCR, latency, WAN, relay share, hits."""
    t0 = time.perf_counter()
    s, _, runs = summarize(cfg, mode, reqs)
    span = max((r.token_times[-1] for r in runs if r.token_times), default=1.0) / 1000.0
    row = {
        "line_gbps": float(cfg.wan["bandwidth_mbps"]) / 1000.0,
        "cost_per_hour": cost_per_hour(cfg, mode),
        "goodput_rps": s["goodput_rps"],
        "bcr": s["bcr"],
        "slo_share": s["goodput_rps"] * span / max(s["requests"], 1),
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "wan_kv_bytes": s["wan_kv_bytes"],
        "wan_gbps": s["wan_kv_bytes"] * 8 / 1e9 / span,
        "rld_share": s["tokens_by_role"][Role.RLD] / max(sum(s["tokens_by_role"].values()), 1),
        "hit_rate": s["hit_rate"],
        "failed": s["failed"],
    }
    print(
        f"  {label or mode}: {len(reqs)} requests, {time.perf_counter() - t0:.0f}s, BCR {s['bcr']:.4f}", file=sys.stderr
    )
    return row, runs


def size(cfg: SimConfig, mode: str, reqs: list[SimRequest]) -> dict:
    """The line an operator would buy for `mode` on this workload (sim/sizing.py)."""
    runs, _ = simulate(with_line(cfg, UNBOUNDED_MBPS / 1000.0), mode, reqs)
    return smallest_line_gbps(runs, cfg.bandwidth())


def workloads(trace: str) -> dict[str, tuple[list[SimRequest], dict]]:
    reqs, info = agents(AGENT_REQUESTS, 0, AGENT_RATE)
    moon = trace_requests(trace, block_tokens=512, time_scale=0.5, max_context=131072, loops=2)
    return {"agents": (reqs, info), "mooncake x2": (moon, {"name": trace, "requests": len(moon), "time_scale": 0.5})}


# -- 5. the headline ------------------------------------------------------------------------------
def headline(out: Path, trace: str) -> dict:
    result: dict = {}
    for wname, (reqs, info) in workloads(trace).items():
        result[wname] = {"workload": {**info, "reuse": reuse(reqs)}}
        for pair, path in PAIRS.items():
            cfg = rules_on(load_sim_config(path))
            sized, naive = size(cfg, "pdd", reqs), size(cfg, "pd-wan", reqs)
            line = with_line(cfg, sized["line_gbps"])
            rows = {m: figures(line, m, reqs, f"{wname} {pair} {m}")[0] for m in MODES}
            rows[RULES_OFF] = figures(rules_off(line), "pdd", reqs, f"{wname} {pair} {RULES_OFF}")[0]
            own = with_line(cfg, naive["line_gbps"])
            rows["pd-wan, own line"] = figures(own, "pd-wan", reqs, f"{wname} {pair} pd-wan on its line")[0]
            result[wname][pair] = {"line": sized, "naive_line": naive, "modes": rows}
    _plot_headline(out / "headline.png", result)
    return result


def _plot_headline(path: Path, result: dict) -> None:
    shown = ("pd-wan", "pd-wan-drc", "pdd", RULES_OFF, "pd-wan, own line")
    fig, axes = plt.subplots(1, len(result), figsize=(6.5 * len(result), 4.2), squeeze=False)
    for ax, (wname, w) in zip(axes[0], result.items()):
        pairs = [p for p in PAIRS if p in w]
        for k, mode in enumerate(shown):
            ys = [w[p]["modes"][mode]["bcr"] / max(w[p]["modes"]["pd-local"]["bcr"], 1e-12) for p in pairs]
            ax.bar([i + 0.16 * (k - 2) for i in range(len(pairs))], ys, 0.16, label=mode)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(pairs)), [f"{p}\n{w[p]['line']['line_gbps']:.0f} Gbps line" for p in pairs])
        ax.set_title(f"{wname}: BCR relative to 88 A intra-DC")
        ax.legend(fontsize=7)
    save(fig, path)


# -- 6. when PDD pays -----------------------------------------------------------------------------
def sensitivity(out: Path, head: dict) -> dict:
    reqs, _ = agents(AGENT_REQUESTS, 0, AGENT_RATE)
    result: dict = {"line": {}, "price": {}, "hit": {}}
    for pair, path in PAIRS.items():
        cfg = rules_on(load_sim_config(path))
        base = head["agents"][pair]
        sized, local = base["line"]["line_gbps"], base["modes"]["pd-local"]
        rows = []
        for f in LINE_FACTORS:
            row, _ = figures(with_line(cfg, sized * f), "pdd", reqs, f"line x{f} {pair}")
            off, _ = figures(rules_off(with_line(cfg, sized * f)), "pdd", reqs, f"line x{f} {pair} {RULES_OFF}")
            rows.append(
                {
                    "factor": f,
                    **row,
                    "vs_local": row["bcr"] / local["bcr"],
                    "rules_off": off,
                    "rules_off_vs_local": off["bcr"] / local["bcr"],
                }
            )
        result["line"][pair] = rows
        result["price"][pair] = {
            w: _price_curve(head[w][pair], rules_on(load_sim_config(path))) for w in head if pair in head[w]
        }
        result["hit"][pair] = _hit_sweep(with_line(cfg, sized), pair)
    _plot_sensitivity(out, result)
    return result


def _price_curve(h: dict, cfg: SimConfig) -> list[dict]:
    """BCR ratio at B's price p: goodputs unchanged, only PDD's hourly cost moves (32 B chips)."""
    local, pdd = h["modes"]["pd-local"], h["modes"]["pdd"]
    n_b = cfg.fleet("pdd")[Role.MD]
    rows = []
    for p in PRICES:
        cost = pdd["cost_per_hour"] + n_b * (p - cfg.chip("B", Role.MD).price_per_hour)
        rows.append({"price": p, "cost_per_hour": cost, "vs_local": (pdd["goodput_rps"] / cost) / local["bcr"]})
    return rows


def _hit_sweep(cfg: SimConfig, pair: str) -> list[dict]:
    rows = []
    for h in HITS:
        reqs = hitmix(HIT_REQUESTS, 0, HIT_RATE, h, prompt_tokens=20480, output_tokens=512, block_tokens=256)
        local, _ = figures(cfg, "pd-local", reqs, f"hit {h} {pair} pd-local")
        pdd, _ = figures(cfg, "pdd", reqs, f"hit {h} {pair} pdd")
        off, _ = figures(rules_off(cfg), "pdd", reqs, f"hit {h} {pair} {RULES_OFF}")
        base = max(local["bcr"], 1e-12)
        rows.append(
            {
                "hit": h,
                "pd-local": local,
                "pdd": pdd,
                "vs_local": pdd["bcr"] / base,
                "rules_off": off,
                "rules_off_vs_local": off["bcr"] / base,
            }
        )
    return rows


def _plot_sensitivity(out: Path, r: dict) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, (pair, rows) in enumerate(r["line"].items()):
        xs = [x["line_gbps"] for x in rows]
        ax.plot(xs, [x["vs_local"] for x in rows], "o-", color=f"C{k}", label=f"{pair}, pdd")
        ax.plot(xs, [x["rules_off_vs_local"] for x in rows], "s--", color=f"C{k}", label=f"{pair}, {RULES_OFF}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("line capacity (Gbps, nominal; price scales with it)")
    ax.set_ylabel("BCR of PDD / BCR of 88 A intra-DC")
    ax.set_title("(a) agent sessions: line capacity")
    ax.legend()
    save(fig, out / "sensitivity_line.png")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for pair, curves in r["price"].items():
        for w, rows in curves.items():
            ax.plot([x["price"] for x in rows], [x["vs_local"] for x in rows], label=f"{pair}, {w}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axvspan(1.2, 1.3, color="tab:orange", alpha=0.15, label="the report's B premium")
    ax.set_xlabel("chip B's hourly price / chip A's")
    ax.set_ylabel("BCR of PDD / BCR of 88 A intra-DC")
    ax.set_title("(b) B's price (goodputs of experiment 5)")
    ax.legend(fontsize=8)
    save(fig, out / "sensitivity_price.png")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, (pair, rows) in enumerate(r["hit"].items()):
        xs = [x["hit"] * 100 for x in rows]
        ax.plot(xs, [x["vs_local"] for x in rows], "o-", color=f"C{k}", label=f"{pair}, pdd")
        ax.plot(xs, [x["rules_off_vs_local"] for x in rows], "s--", color=f"C{k}", label=f"{pair}, {RULES_OFF}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("average prefix hit (%)")
    ax.set_ylabel("BCR of PDD / BCR of 88 A intra-DC")
    ax.set_title(f"(c) hitmix, 20K in / 512 out, {HIT_RATE:g} req/s, on the agents' line")
    ax.legend()
    save(fig, out / "sensitivity_hit.png")


# -- 7. the relay's share -------------------------------------------------------------------------
def fate(r: RequestRun) -> str:
    """What became of one request's plan, as far as the relay is concerned."""
    if r.pipeline != Pipeline.P_RLD_MD:
        return f"{r.pipeline} [{r.reason}]"
    if r.tokens_by_role[Role.MD] > 0:
        return "handed off to MD"
    if "kv_wan" in r.marks and r.marks["kv_wan"] < r.token_times[-1]:
        return "MD's KV in before the end, no handoff"
    return "relay streamed it all: MD's KV still on the line"


def anatomy(runs: list[RequestRun]) -> dict:
    """Request by request: each plan's fate, the relay's tokens by fate, and whether the policy knew."""
    fates = Counter(fate(r) for r in runs)
    tokens = Counter()
    for r in runs:
        tokens[fate(r)] += r.tokens_by_role[Role.RLD]
    relayed = [r for r in runs if r.pipeline == Pipeline.P_RLD_MD]
    whole = [r for r in relayed if fate(r).startswith("relay streamed")]

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    total = sum(sum(r.tokens_by_role.values()) for r in runs)
    return {
        "requests": fates,
        "relay_tokens": tokens,
        "rld_share": sum(tokens.values()) / max(total, 1),
        "relayed": len(relayed),
        "knew": sum(r.estimates.get("backlog_tokens", 0) >= r.req.output_len for r in relayed) / max(len(relayed), 1),
        "whole_median_output": med([r.req.output_len for r in whole]),
        "whole_median_stream_s": med([(r.token_times[-1] - r.token_times[0]) / 1000 for r in whole]),
        "whole_median_lead_s": med(
            [(r.estimates["ttft_ms"][Pipeline.P_MD] - r.estimates["ttft_ms"][Pipeline.P_RLD_MD]) / 1000 for r in whole]
        ),
        "whole_median_wan_est_mbps": med([r.estimates["wan_mbps"] for r in whole]),
    }


def relay(out: Path, trace: str, fleet: SimConfig, head: dict) -> dict:
    moon = trace_requests(trace, block_tokens=512, time_scale=0.5, max_context=131072, loops=2)
    result: dict = {}
    variants = (
        ("experiment 1, rules off", rules_off(fleet)),
        ("experiment 1, relay-finishes alone", with_rules(fleet, relay_finishes=True, line_backlog=False)),
        ("experiment 1", with_rules(fleet, relay_finishes=True, line_backlog=True)),
    )
    for label, cfg in variants:
        row, runs = figures(cfg, "pdd", moon, label)
        result[label] = {**row, "anatomy": anatomy(runs)}
    sized = head["mooncake x2"]["H100 + H200"]["line"]["line_gbps"]
    for label, cfg in (("", rules_on(with_line(fleet, sized))), (", rules off", rules_off(with_line(fleet, sized)))):
        row, runs = figures(cfg, "pdd", moon, f"mooncake on its line{label}")
        result[f"mooncake x2 on its line{label}"] = {**row, "anatomy": anatomy(runs)}
    cfg = rules_on(load_sim_config(PAIRS["H100 + H200"]))
    long = hitmix(
        LONG["requests"],
        0,
        LONG["rate"],
        LONG["hit"],
        prompt_tokens=LONG["prompt_tokens"],
        output_tokens=LONG["output_tokens"],
        block_tokens=256,
    )
    line = size(cfg, "pdd", long)
    local, _ = figures(with_line(cfg, line["line_gbps"]), "pd-local", long, "64K/1K pd-local")
    for label, c in (("", cfg), (", rules off", rules_off(cfg))):
        row, runs = figures(with_line(c, line["line_gbps"]), "pdd", long, f"64K/1K pdd{label}")
        result[f"64K in / 1K out, 90% hit{label}"] = {**row, "line": line, "pd-local": local, "anatomy": anatomy(runs)}
    return result


def _pct(a: float, b: float) -> str:
    return f"{a / b - 1:+.1%}" if b else "n/a"


def markdown(head: dict) -> str:
    """Experiment 5 as tables: each workload and pair against 88 A intra-DC and naive cross-DC PD."""
    lines = []
    for wname, w in head.items():
        reuse_ = w["workload"]["reuse"]
        lines += [
            f"### {wname}: prompts seen before {reuse_['prompts_and_answers_mean']:.1%} on average "
            f"({reuse_['prompts_and_answers_over_95']:.0%} of requests over 95%, "
            f"{reuse_['prompts_and_answers_token_weighted']:.1%} of prompt tokens; prompts alone "
            f"{reuse_['prompts_mean']:.1%})",
            "",
            "| pair | line (mean / p99 demand it is sized for) | mode | cost /h | goodput | BCR | TTFT P50 | P90 "
            "| P99 | TPOT P50 | WAN | RLD share | hit prefill / MD |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for pair in PAIRS:
            if pair not in w:
                continue
            for mode, r in w[pair]["modes"].items():
                gbps, line = r["line_gbps"], w[pair]["naive_line" if mode == "pd-wan, own line" else "line"]
                t = r["ttft_ms"]
                lines.append(
                    f"| {pair} | {gbps:,.0f} Gbps ({line['demand_mean_gbps']:.0f} / {line['demand_p99_gbps']:.0f}) "
                    f"| {mode} | {r['cost_per_hour']:.1f} | {r['goodput_rps']:.2f} | {r['bcr']:.4f} "
                    f"| {t['p50'] / 1000:,.2f} s | {t['p90'] / 1000:,.2f} s | {t['p99'] / 1000:,.2f} s "
                    f"| {r['tpot_ms']['p50']:.1f} ms | {r['wan_gbps']:.0f} Gbps | {r['rld_share']:.1%} "
                    f"| {r['hit_rate'][Role.PREFILL]:.0%} / {r['hit_rate'][Role.MD]:.0%} |"
                )
        lines.append("")
        lines += [
            "| pair | PDD vs 88 A: cost | goodput | BCR | TTFT P50 / P90 vs pd-wan, same line | vs pd-wan, own line |",
            "|---|---|---|---|---|---|",
        ]
        for pair in PAIRS:
            if pair not in w:
                continue
            m = w[pair]["modes"]
            pdd, local, naive, own = m["pdd"], m["pd-local"], m["pd-wan"], m["pd-wan, own line"]
            lines.append(
                f"| {pair} | {_pct(pdd['cost_per_hour'], local['cost_per_hour'])} "
                f"| {_pct(pdd['goodput_rps'], local['goodput_rps'])} | {_pct(pdd['bcr'], local['bcr'])} "
                f"| {_pct(pdd['ttft_ms']['p50'], naive['ttft_ms']['p50'])} / "
                f"{_pct(pdd['ttft_ms']['p90'], naive['ttft_ms']['p90'])} "
                f"| {_pct(pdd['ttft_ms']['p50'], own['ttft_ms']['p50'])} / "
                f"{_pct(pdd['ttft_ms']['p90'], own['ttft_ms']['p90'])} ({own['line_gbps']:,.0f} Gbps) |"
            )
        lines.append("")
    return "\n".join(lines)
