"""Bounded state under churn: thousands of short requests, completed or walked away from at
random points, plus a flood of aborts for ids nobody knows. After warm-up, every service's
memory and Redis's must stay flat, and every per-request map must be empty once idle.

    .venv/bin/python -m benchmarks.bounded_state [--requests 2000] [--aborts 20000] [--concurrency 16]

The warm-up runs the same mix as the churn (`--warmup` requests and `--warmup-aborts` unknown
aborts at once), so that what is capped by design is at its cap before the first snapshot:
the remembered-id memories (shared/recent.py, 10,000 ids), the scheduler's recent plans (a time
window), the prefix caches and their Redis index (a pool's worth of blocks), and the allocator's
high-water mark under a burst of messages. What still grows after that is a leak.

Prints, per process: resident memory after warm-up, half-way and at the end (the churn runs in
two halves: a leak keeps growing, a cache settles), the size of each decoder's decode mirror (a
cache capped by its budget, which grows with the most sequences decoded at once), its
per-request maps and capped memories (Inspect), and Redis's used memory. Exit status 1 when a
process grew more than `--tolerance` (5%) net of its mirror's growth, or a per-request map is
not empty.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid

import httpx
import psutil
import redis

from pdd.launcher import Cluster
from shared import subjects
from shared.bus import Bus
from shared.messages import Abort, Inspect, InstanceState

REQUEST_MAPS = ("requests", "parked", "receiving", "bus_handlers")  # must be 0 when idle; the rest are capped


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> str:
    words = " ".join(f"w{rng.randrange(500)}" for _ in range(rng.randrange(8, 60)))
    body = {
        "prompt": f"[{uuid.uuid4().hex[:6]}] {words}",
        "max_tokens": rng.randrange(4, 16),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    leave = rng.randrange(1, 4) if rng.random() < 0.2 else None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: {")
            if leave is not None and seen >= leave:
                return "left"
    return "done"


async def _traffic(url: str, n: int, concurrency: int, seed: int) -> dict[str, int]:
    rng, outcomes = random.Random(seed), {}
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with sem:
            out = await _one(client, url, rng, i)
            outcomes[out] = outcomes.get(out, 0) + 1
            if (i + 1) % 100 == 0:
                print(f"  {i + 1}/{n} requests", file=sys.stderr, flush=True)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(run(i) for i in range(n)))
    return outcomes


async def _unknown_aborts(cluster: Cluster, n: int) -> None:
    bus = await Bus.connect(cluster.nats_url(), "bounded-state", "operator", cluster.secrets)
    for i in range(n):
        await bus.publish(subjects.ABORT, Abort(f"nobody-{uuid.uuid4().hex}", reason="flood"))
        if i % 1000 == 999:
            await bus.nc.flush()
    await bus.nc.flush()
    await bus.close()


async def _churn(cluster: Cluster, requests: int, aborts: int, concurrency: int, seed: int) -> dict[str, int]:
    """`requests` requests and `aborts` unknown aborts at once; the requests' outcomes."""
    outcomes, _ = await asyncio.gather(
        _traffic(cluster.url, requests, concurrency, seed), _unknown_aborts(cluster, aborts)
    )
    return outcomes


async def _states(cluster: Cluster) -> dict[str, InstanceState]:
    bus = await Bus.connect(cluster.nats_url(), "bounded-state", "operator", cluster.secrets)
    try:
        return {
            i.id: await bus.request(subjects.inspect(i.id), Inspect(i.id), InstanceState, 10)
            for i in cluster.cfg.instances
        }
    finally:
        await bus.close()


def _snapshot(cluster: Cluster, r: redis.Redis) -> dict[str, float]:
    rss = {name: psutil.Process(p.pid).memory_info().rss / 2**20 for name, p in cluster.procs.items()}
    return {**rss, "redis": r.info("memory")["used_memory"] / 2**20}


async def _idle(cluster: Cluster, timeout: float = 60) -> dict[str, InstanceState]:
    deadline = time.monotonic() + timeout
    while True:
        states = await _states(cluster)
        if all(not any(s.state.get(k) for k in REQUEST_MAPS) for s in states.values()):
            return states
        if time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--aborts", type=int, default=20000, help="aborts for ids nobody knows")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=400, help="requests before the first snapshot")
    p.add_argument("--warmup-aborts", type=int, default=10_000, help="unknown aborts during the warm-up")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    with Cluster(port=0, max_queue=256, log=lambda m: print(m, file=sys.stderr)) as cluster:
        r = redis.Redis.from_url(cluster.cfg.redis_url, password=cluster.secrets.redis_password)
        print(f"warm-up: {a.warmup} requests and {a.warmup_aborts} unknown aborts", file=sys.stderr)
        asyncio.run(_churn(cluster, a.warmup, a.warmup_aborts, a.concurrency, a.seed))
        asyncio.run(_idle(cluster))
        points = [("after warm-up", _snapshot(cluster, r), asyncio.run(_states(cluster)))]
        t0, outcomes = time.monotonic(), {}
        for half, label in ((0, "at half"), (1, "at the end")):  # a leak keeps growing; a cache settles
            churned = _churn(cluster, a.requests // 2, a.aborts // 2, a.concurrency, a.seed + 1 + half)
            for k, v in asyncio.run(churned).items():
                outcomes[k] = outcomes.get(k, 0) + v
            states = asyncio.run(_idle(cluster))
            points.append((label, _snapshot(cluster, r), states))
        return _report(a, outcomes, time.monotonic() - t0, points)


def _mirror_mib(states: dict[str, InstanceState]) -> dict[str, float]:
    """Each decoder's decode mirror (shared/runtime/mirror.py): a cache that grows to its budget
    with the most sequences and longest contexts it has decoded at once, and keeps that size."""
    return {i: s.figures.engine.mirror_bytes / 2**20 for i, s in states.items()}


def _report(a, outcomes, elapsed, points) -> int:
    """Per process: MiB after warm-up, at half, at the end; the change over the run and over its
    second half; and the change net of its decode mirror's growth (a capped cache, reported apart).
    A process is judged on that net change."""
    print(f"\n{a.requests} requests ({outcomes}) and {a.aborts} unknown aborts in {elapsed:.0f} s")
    (_, first, s0), (_, mid, _), (_, last, states) = points
    mirror0, mirror1 = _mirror_mib(s0), _mirror_mib(states)
    print(
        f"{'process':<12} {'MiB warm':>9} {'at half':>9} {'at end':>9} {'change':>8} {'2nd half':>9}"
        f" {'mirror MiB':>14} {'net change':>11}"
    )
    grown = []
    for name in first:
        change, second = (last[name] - first[name]) / first[name], (last[name] - mid[name]) / mid[name]
        m0, m1 = mirror0.get(name, 0.0), mirror1.get(name, 0.0)
        net = (last[name] - first[name] - (m1 - m0)) / first[name]
        grown += [name] if net > a.tolerance else []
        print(
            f"{name:<12} {first[name]:>9.1f} {mid[name]:>9.1f} {last[name]:>9.1f} {change:>+8.1%} {second:>+9.1%}"
            f" {f'{m0:.0f} -> {m1:.0f}':>14} {net:>+11.1%}"
        )
    leftover = {i: {k: v for k, v in s.state.items() if k in REQUEST_MAPS and v} for i, s in states.items()}
    for iid, s in states.items():
        print(f"{iid}: {s.state}")
    leftover = {i: v for i, v in leftover.items() if v}
    ok = not grown and not leftover
    print("bounded: yes" if ok else f"bounded: NO (grew: {grown}; per-request state left: {leftover})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
