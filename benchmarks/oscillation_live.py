"""The oscillation guard on live processes: a burst of low-hit requests against a 1-slot relay.

    .venv/bin/python -m benchmarks.oscillation_live [--requests 20] [--gap-ms 400] [--out DIR]

Two fresh clusters, one after the other, identical but for the scheduler's `guard`: prefill and a
relay holding one request (`max_running: 1`) in datacenter A, main-decode in B behind a WAN whose
one-way delay (default 1.5 s) puts every fresh prompt's p-md TTFT over the SLO, so the policy
wants the relay for all of them. Each request is a fresh random prompt (no prefix hit anywhere),
sent open loop every `gap_ms`: far faster than one relay slot turns over (its residency is the
WAN time it hides).

While the burst runs the relay is asked for its figures every 100 ms (NATS `Inspect`): its
queue is what it holds beyond its one running slot (engine waiting + accepted tasks whose KV is
still coming). Printed per side: max and mean relay queue, TTFT P50/P99, time to the second
token (the relay's queue shows there: prefill's first token streams at admission, the second
waits for a slot), the worst gap between tokens, plans by reason, and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.modes import mode_config
from benchmarks.runner import replay, warm_up
from benchmarks.summary import latency_stats, request_latencies
from benchmarks.workloads import FIRST_TOKEN_ID, BenchRequest, Workload
from pdd.launcher import Cluster
from shared import subjects
from shared.bus import Bus
from shared.messages import Inspect, InstanceState
from shared.pipelines import Role

RELAY = "rld-0"
SAMPLE_S = 0.1


def cluster_config(guard: bool, wan_delay_ms: float) -> dict[str, Any]:
    cfg = mode_config("pdd")
    for inst in cfg["instances"]:
        if inst["role"] == Role.RLD:
            inst["max_running"] = 1
    cfg["wan"] = {**cfg["wan"], "bandwidth_mbps": 1000.0, "delay_ms": wan_delay_ms, "jitter_ms": 0.0}
    cfg["scheduler"] = {**cfg["scheduler"], "guard": guard, "ttft_slo_ms": 1000.0, "wan_mbps": 1000.0}
    return cfg


def burst(n: int, gap_ms: float, prompt_tokens: int, max_tokens: int, seed: int) -> Workload:
    """Fresh random prompts, evenly spaced: a burst no prefix cache can soften."""
    requests = []
    for i in range(n):
        rng = random.Random(f"{seed}:burst:{i}")
        prompt = [rng.randrange(FIRST_TOKEN_ID, 49152) for _ in range(prompt_tokens)]
        requests.append(BenchRequest(f"osc-{i:03d}", "", 0, i * gap_ms / 1000, max_tokens, "random", prompt_ids=prompt))
    return Workload("burst", requests, seed, {"gap_ms": gap_ms, "prompt_tokens": prompt_tokens}, {})


async def sample_relay(nats_url: str, stop: asyncio.Event) -> list[dict[str, Any]]:
    """The relay's running / queued figures every `SAMPLE_S` until `stop`."""
    bus = await Bus.connect(nats_url, "oscillation-probe")
    samples, t0 = [], time.perf_counter()
    try:
        while not stop.is_set():
            s = await bus.request(subjects.inspect(RELAY), Inspect(), InstanceState, 5.0)
            f = s.figures
            samples.append(
                {"t_s": time.perf_counter() - t0, "running": f.engine.running, "queue": f.engine.waiting + f.pending}
            )
            await asyncio.sleep(SAMPLE_S)
    finally:
        await bus.close()
    return samples


async def run_burst(cluster: Cluster, workload: Workload, label: str) -> tuple[list[dict], list[dict]]:
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_relay(cluster.cfg.nats_url, stop))
    try:
        records, _ = await replay(cluster.url, workload, label)
    finally:
        stop.set()
    return records, await sampler


def figures(records: list[dict], samples: list[dict]) -> dict[str, Any]:
    lats = [x for x in map(request_latencies, records) if x is not None]
    reasons: dict[str, int] = {}
    for r in records:
        reason = r["pdd"].get("plan_reason", "failed")
        reasons[reason] = reasons.get(reason, 0) + 1
    queue = [s["queue"] for s in samples]
    return {
        "requests": len(records),
        "failed": sum(not r["ok"] for r in records),
        "max_rld_queue": max(queue, default=0),
        "mean_rld_queue": sum(queue) / max(len(queue), 1),
        "ttft_ms": latency_stats([x.ttft_ms for x in lats]),
        "ttst_ms": latency_stats([x.ttst_ms for x in lats if x.ttst_ms is not None]),
        "max_gap_ms": latency_stats([max(x.gaps_ms, default=0.0) for x in lats]),
        "reasons": reasons,
    }


def run_side(guard: bool, args: argparse.Namespace) -> dict[str, Any]:
    label = "guard on" if guard else "guard off"
    print(f"\n== {label}: starting a cluster (prefill, 1-slot relay, main-decode behind the WAN)")
    workload = burst(args.requests, args.gap_ms, args.prompt_tokens, args.max_tokens, args.seed)
    with Cluster(cluster_config(guard, args.wan_delay_ms)) as cluster:
        asyncio.run(warm_up(cluster.url))
        records, samples = asyncio.run(run_burst(cluster, workload, label))
    return {"figures": figures(records, samples), "samples": samples, "records": records}


def print_table(sides: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.requests} fresh {args.prompt_tokens}-token prompts every {args.gap_ms:.0f} ms, "
        f"{args.max_tokens} tokens each, onto a 1-slot relay; WAN delay {args.wan_delay_ms:.0f} ms"
    )
    print(
        f"{'':<10} {'max RLD queue':>13} {'mean':>6} {'TTFT P50':>9} {'TTFT P99':>9} "
        f"{'2nd tok P99':>11} {'gap P99':>8} {'failed':>6}  plans"
    )
    for label, side in sides.items():
        f = side["figures"]
        print(
            f"{label:<10} {f['max_rld_queue']:>13} {f['mean_rld_queue']:>6.1f} {f['ttft_ms']['p50']:>7.0f}ms "
            f"{f['ttft_ms']['p99']:>7.0f}ms {f['ttst_ms']['p99']:>9.0f}ms {f['max_gap_ms']['p99']:>6.0f}ms "
            f"{f['failed']:>6}  {f['reasons']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--gap-ms", type=float, default=400.0, help="time between arrivals")
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--wan-delay-ms", type=float, default=1500.0, help="one way")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write oscillation.json here")
    args = p.parse_args()
    sides = {"guard off": run_side(False, args), "guard on": run_side(True, args)}
    print_table(sides, args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "oscillation.json").write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, **sides}, indent=1)
        )
        print(f"wrote {args.out / 'oscillation.json'}")


if __name__ == "__main__":
    main()
