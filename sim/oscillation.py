"""Experiment 3, the oscillation (services/scheduler/policy.py, rules 2 and 5): a small relay pool
under low-hit traffic.

The mechanism the scheduler guards against: low-hit requests routed to the small RLD pool
overload it; requests that finish on RLD leave their prompt and answer in RLD's cache, not in
MD's DRC, so MD's hit falls behind prefill's; with less hit at MD, more requests miss the TTFT
SLO via MD and bounce to RLD — the relay queue grows and TTFT explodes. The guard (RLD
admission control, `PolicyConfig.guard` with `rld_slots`) sends a request to `p-md` instead once
the relay holds `rld_slots` requests.

Setup: the report fleet with its RLD pool cut to `RLD` instances of `SLOTS` slots (the relay
small next to 32 MD), the first `N` Mooncake-trace requests at `TIME_SCALE` x their spacing.
Variants: PDD as configured (guard, DRC); no guard; `p-rld` for every low-hit request (the
anomalous rule with its output bound lifted: the routing policy.py's rule 2 forbids); no DRC. Sampled
every 2 s: relay held (running + queued + planned) / slots and its queue; per 30 s window of
sends: prefill hit - MD hit (share of prompt) and TTFT P90.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from benchmarks.summary import percentile
from shared.pipelines import Pipeline, Role
from sim.config import SimConfig
from sim.plotting import plt, save
from sim.run import summarize
from sim.workload import trace_requests

RLD, SLOTS = 1, 8
N, TIME_SCALE = 2500, 0.33
WINDOW_S = 30.0


def small_relay(cfg: SimConfig) -> SimConfig:
    fleets = {**cfg.fleets, "default": {**cfg.fleets.get("default", {}), Role.RLD: RLD}}
    roles = {**cfg.roles, Role.RLD: {**cfg.roles.get(Role.RLD, {}), "max_running": SLOTS}}
    return dataclasses.replace(cfg, fleets=fleets, roles=roles)


def variants(cfg: SimConfig) -> dict[str, SimConfig]:
    def sched(**knobs) -> SimConfig:
        return dataclasses.replace(cfg, scheduler={**cfg.scheduler, **knobs})

    return {
        "PDD (guard, DRC)": cfg,
        "no guard": sched(guard=False),
        f"{Pipeline.P_RLD.value} for low-hit": sched(anomalous_min_uncached=2048, anomalous_max_output=1_000_000),
        "no DRC": dataclasses.replace(cfg, drc=False),
    }


def windows(runs, window_s: float = WINDOW_S) -> list[dict]:
    """Per window of send time: mean (prefill hit - MD hit) share and TTFT P90 of finished requests."""
    buckets: dict[int, list] = {}
    for r in runs:
        buckets.setdefault(int(r.sent_ms / 1000 // window_s), []).append(r)
    out = []
    for k, rs in sorted(buckets.items()):
        ttfts = sorted(r.token_times[0] - r.sent_ms for r in rs if r.token_times)
        gap = sum((r.hit[Role.PREFILL] - r.hit[Role.MD]) / max(r.req.prompt_len, 1) for r in rs) / len(rs)
        p90 = percentile(ttfts, 90) if ttfts else float("nan")
        out.append({"t_s": (k + 0.5) * window_s, "hit_gap": gap, "ttft_p90_ms": p90})
    return out


def oscillation(cfg: SimConfig, out: Path, trace: str) -> dict:
    cfg = small_relay(cfg)
    reqs = trace_requests(trace, block_tokens=512, time_scale=TIME_SCALE, max_context=131072, max_requests=N)
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    figures = {"setup": {"rld_instances": RLD, "rld_slots": SLOTS, "requests": len(reqs), "time_scale": TIME_SCALE}}
    for name, c in variants(cfg).items():
        s, cluster, runs = summarize(c, "pdd", reqs, sample_every_ms=2000.0)
        t = [x["t_s"] for x in cluster.samples]
        axes[0].plot(t, [x["rld_busy"] / max(x["rld_slots"], 1) for x in cluster.samples], label=name, lw=1)
        axes[1].plot(t, [x["rld_waiting"] for x in cluster.samples], label=name, lw=1)
        w = windows(runs)
        axes[2].plot([x["t_s"] for x in w], [x["hit_gap"] for x in w], label=name, lw=1)
        axes[3].plot([x["t_s"] for x in w], [x["ttft_p90_ms"] / 1000 for x in w], label=name, lw=1)
        reasons: dict[str, int] = {}
        for r in runs:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        figures[name] = {
            "ttft_ms": s["ttft_ms"],
            "goodput_rps": s["goodput_rps"],
            "wan_kv_bytes": s["wan_kv_bytes"],
            "rld_share": s["tokens_by_role"][Role.RLD] / max(sum(s["tokens_by_role"].values()), 1),
            "hit_rate": s["hit_rate"],
            "reasons": reasons,
            "max_rld_load": max((x["rld_busy"] / x["rld_slots"] for x in cluster.samples), default=0),
            "max_rld_queue": max((x["rld_waiting"] for x in cluster.samples), default=0),
        }
        print(
            f"  oscillation {name}: TTFT P90 {s['ttft_ms']['p90']:.0f} ms, max RLD queue "
            f"{figures[name]['max_rld_queue']}",
            file=sys.stderr,
        )
    axes[0].set_ylabel("RLD held / slots")
    axes[0].set_title(f"{RLD} RLD x {SLOTS} slots, 32 MD: Mooncake trace x{1 / TIME_SCALE:.3g}, {len(reqs)} requests")
    axes[1].set_ylabel("RLD queue (requests)")
    axes[2].set_ylabel(f"prefill hit - MD hit\n(share of prompt, {WINDOW_S:g} s)")
    axes[3].set_ylabel(f"TTFT P90 (s, {WINDOW_S:g} s windows)")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("time (s)")
    axes[0].legend(fontsize=8)
    save(fig, out / "oscillation.png")
    return figures
