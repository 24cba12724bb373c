"""The fleet bench's figures (benchmarks/fleet_bench.py): pure functions from what its
processes recorded to the pooled phases and the printed report. Nothing here talks to a server.

- `pool`: one phase's figures over every load client (throughput, latency, errors, duplicates).
- `per_plan`: Redis's commandstats over a phase, per answered plan.
- `profile_top`: a cProfile'd scheduler's functions, per plan.
- `format_report`: the table, the registry's figures and the ratios to the targets.
"""

from __future__ import annotations

import pstats
from pathlib import Path

from benchmarks.stats import latency_stats

TARGET_PLANS_PER_S = 1000.0  # per scheduler
TARGET_P99_MS = 10.0
TARGET_SCALING = 1.7  # throughput, 2 schedulers over 1
SCRIPTED = {"sismember"}  # Redis counts a Lua script's calls apart, their time inside the script's too


def per_plan(commandstats: dict, plans: int) -> dict:
    """Redis's commands over a phase, per answered plan: calls, and Redis's own time (its
    commandstats; the bench's heartbeats, 200 a second, are among them)."""
    out = {}
    for key, st in sorted(commandstats.items(), key=lambda kv: -kv[1]["usec"]):
        out[key.removeprefix("cmdstat_")] = {
            "calls_per_plan": round(st["calls"] / max(plans, 1), 2),
            "us_per_call": round(st["usec_per_call"], 1),
            "us_per_plan": round(st["usec"] / max(plans, 1), 1),
        }
    return out


def pool(clients: list[dict]) -> dict:
    """One phase's figures over every client process."""
    window = max(c["window_s"] for c in clients)
    latency = [x for c in clients for x in c["latency_ms"]]
    queue = [x for c in clients for x in c["queue_ms"]]
    errors: dict[str, int] = {}
    pipelines: dict[str, int] = {}
    for c in clients:
        for key, n in c["errors"].items():
            errors[key] = errors.get(key, 0) + n
        for key, n in c["pipelines"].items():
            pipelines[key] = pipelines.get(key, 0) + n
    planned = sum(c["planned"] for c in clients)
    return {
        "seconds": window,
        "sent": sum(c["sent"] for c in clients),
        "planned": planned,
        "plans_per_s": planned / window if window else 0.0,
        "errors": errors,
        "first_error": next((c["first_error"] for c in clients if c["first_error"]), ""),
        "timeouts": sum(c["timeouts"] for c in clients),
        "client_cpu_s": sum(c["cpu_s"] for c in clients),
        "duplicates": sum(c["duplicates"] for c in clients),
        "pipelines": pipelines,
        "latency_ms": latency_stats(latency),
        "queue_ms": latency_stats(queue),
    }


def summary_line(phase: dict) -> str:
    lat = phase["latency_ms"]
    return (
        f"{phase['planned']} plans in {phase['seconds']:.0f} s: {phase['plans_per_s']:.0f}/s, "
        f"P50 {lat['p50']:.1f} ms, P99 {lat['p99']:.1f} ms, errors {sum(phase['errors'].values())}, "
        f"timeouts {phase['timeouts']}, duplicate answers {phase['duplicates']}, "
        f"scheduler CPU {phase['scheduler_cpu_ms_per_plan']:.1f} ms per plan"
    )


def profile_top(path: Path, plans: int, n: int = 25) -> list[dict]:
    """The profiled scheduler's functions with the most own time, per plan."""
    stats = pstats.Stats(str(path)).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [
        {
            "function": f"{Path(f).name}:{line}({name})",
            "calls_per_plan": round(nc / max(plans, 1), 2),
            "own_us_per_plan": round(tt / max(plans, 1) * 1e6, 1),
            "cumulative_us_per_plan": round(ct / max(plans, 1) * 1e6, 1),
        }
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


# -- the report -----------------------------------------------------------------------------
def ratio(value: float, target: float, higher_is_better: bool = True) -> str:
    if not target or not value:
        return "n/a"
    r = value / target
    met = r >= 1 if higher_is_better else r <= 1
    return f"{r:.2f}x target ({'met' if met else 'MISSED'})"


def format_report(r: dict) -> str:
    f, idx, s = r["fleet"], r["index"], r["settings"]
    roles = ", ".join(f"{n} {role}" for role, n in f["roles"].items())
    lines = [
        f"Fleet bench: {f['instances']} instances ({roles}), {f['blocks_each']:,} blocks each in Redis "
        f"({idx['used_memory_human']}), prompts of {s['min_tokens']}-{s['max_tokens']} tokens, "
        f"{s['hit_share']:.0%} opening with a cached prefix",
        f"Host: {r['host']}, load average {r['load_before']:.1f} before the run, {r['load_after']:.1f} after. "
        "Every process (NATS, Redis, the schedulers, the simulated instances, the load) shares these cores.",
        f"Code: {r['head']}",
        "",
        "Registry at this size, alone (ms):",
    ]
    for name, st in (*r["registry"]["timings"].items(), *r["pieces"].items()):
        lines.append(f"  {name:<40} p50 {st['p50']:8.3f}   p99 {st['p99']:8.3f}")
    reg = r["registry"]
    lines.append(
        f"  prompts with a hit on some instance: {reg['hit_share']:.0%}; instances hit per such prompt: "
        f"{reg['instances_hit']:.1f}; Redis keys: {reg['keys']}"
    )
    lines.append("  Redis's own time per (alive + hash + prefix_blocks): " + _redis_line(reg["redis_per_read"]))
    lines += ["", _table(r["runs"]), ""]
    for run in r["runs"]:
        lines.append(
            f"  Redis per plan, {run['schedulers']} scheduler(s): " + _redis_line(run["saturated"]["redis_per_plan"])
        )
    lines.append("")
    lines += _targets(r["runs"], r["cores"])
    if r.get("profile"):
        p = r["profile"]
        lines += ["", f"Profile (1 scheduler under cProfile, {p['plans_per_s']:.0f} plans/s; own time per plan):"]
        for row in p["top"][:15]:
            lines.append(
                f"  {row['own_us_per_plan']:8.1f} us own  {row['cumulative_us_per_plan']:9.1f} us cum  "
                f"{row['calls_per_plan']:6.2f} calls  {row['function']}"
            )
    return "\n".join(lines)


def _redis_line(commands: dict, top: int = 5) -> str:
    """Redis's own time per plan, the costliest commands first (a script's calls are in its time)."""
    total = sum(c["us_per_plan"] for name, c in commands.items() if name not in SCRIPTED)
    rows = [(name, c) for name, c in commands.items() if name not in SCRIPTED][:top]
    return f"{total:.0f} us: " + ", ".join(
        f"{name} {c['calls_per_plan']:g} x {c['us_per_call']:.0f} us" for name, c in rows
    )


def _table(runs: list[dict]) -> str:
    head = (
        f"{'sched':>5} {'plans/s':>8} {'/sched':>7} {'P50 ms':>7} {'P90 ms':>7} {'P99 ms':>7} "
        f"{'queue P50':>9} {'queue P99':>9} {'paced/s':>8} {'P50':>6} {'P99':>6} {'dup':>6} {'err':>4} "
        f"{'plans made':>10} {'CPU ms/plan':>11}  CPU s in the phase"
    )
    rows = [head]
    for run in runs:
        sat, k = run["saturated"], run["schedulers"]
        lat, q = sat["latency_ms"], sat["queue_ms"]
        paced = run.get("paced")
        p = paced["latency_ms"] if paced else {"p50": 0.0, "p99": 0.0}
        errors = (
            sum(sat["errors"].values())
            + sat["timeouts"]
            + (sum(paced["errors"].values()) + paced["timeouts"] if paced else 0)
        )
        cpu = ", ".join(f"{n} {c:.1f}" for n, c in sat.get("cpu_s", {}).items())
        rows.append(
            f"{k:>5} {sat['plans_per_s']:8.0f} {sat['plans_per_s'] / k:7.0f} {lat['p50']:7.1f} {lat['p90']:7.1f} "
            f"{lat['p99']:7.1f} {q['p50']:9.1f} {q['p99']:9.1f} {paced['rate'] if paced else 0:8.0f} "
            f"{p['p50']:6.1f} {p['p99']:6.1f} {sat['duplicates']:6d} {errors:4d} {sum(run['plans_logged']):10d} "
            f"{sat['scheduler_cpu_ms_per_plan']:11.1f}  {cpu}"
        )
    rows.append(
        "  plans/s, P50-P99: closed loop (saturated), client side; queue: the scheduler's own plan.queue_ms; "
        "paced: open loop below saturation; dup: answers beyond the first (several schedulers planning one "
        "request); plans made: by the schedulers' logs, every phase; CPU ms/plan: the schedulers' CPU per answered plan"
    )
    return "\n".join(rows)


def _targets(runs: list[dict], cores: int) -> list[str]:
    by_k = {run["schedulers"]: run for run in runs}
    out = ["Targets:"]
    for k, run in by_k.items():
        per = run["saturated"]["plans_per_s"] / k
        paced = run.get("paced") or run["saturated"]
        out.append(
            f"  {k} scheduler(s): {per:.0f} plans/s per scheduler: {ratio(per, TARGET_PLANS_PER_S)}; "
            f"P99 {paced['latency_ms']['p99']:.1f} ms{' (paced)' if run.get('paced') else ''}: "
            f"{ratio(paced['latency_ms']['p99'], TARGET_P99_MS, higher_is_better=False)}"
        )
    if 1 in by_k and 2 in by_k:
        growth = by_k[2]["saturated"]["plans_per_s"] / max(by_k[1]["saturated"]["plans_per_s"], 1e-9)
        out.append(f"  1 -> 2 schedulers: x{growth:.2f} throughput: {ratio(growth, TARGET_SCALING)}")
    for k, run in by_k.items():
        sat = run["saturated"]
        if k > 1 and sat["duplicates"]:
            out.append(
                f"  {k} schedulers answered {sat['planned']} submits {sat['planned'] + sat['duplicates']} times: "
                "each scheduler planned and dispatched every request (no queue group)"
            )
    if by_k and max(by_k) + 3 > cores:
        out.append(
            f"  on {cores} cores the schedulers share the CPU with NATS, Redis, the simulated instances "
            "and the load: more schedulers than free cores cannot scale"
        )
    return out
