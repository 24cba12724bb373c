"""How fast the scheduler answers "how many prefix tokens does instance X hold" from Redis alone.

Starts a real redis-server, indexes a 4096-token request's 256 chained block hashes for a few
instances (each holding a different share of the prefix), then times what the scheduler does
per request: hash the prompt into blocks and one pipelined SMISMEMBER per instance.

    .venv/bin/python benchmarks/prefix_lookup_bench.py [--tokens 4096] [--instances 4] [--reps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from benchmarks.summary import latency_stats
from pdd.servers import EmbeddedServer
from shared.messages import IndexEvent
from shared.prefix_hash import block_hashes
from shared.registry import Registry, connect


async def run(tokens: int, instances: int, reps: int) -> dict[str, float]:
    server = EmbeddedServer("redis").start()
    registry = Registry(connect(server.url), ttl_s=60)
    try:
        prompt = [random.randrange(50_000) for _ in range(tokens)]
        hashes = block_hashes(prompt, 16, "default")
        ids = [f"md-{i}" for i in range(instances)]
        for i, iid in enumerate(ids):  # instance i holds the first (i+1)/n of the prefix
            held = hashes[: len(hashes) * (i + 1) // instances]
            await registry.apply_kv_events(
                iid, [IndexEvent("stored", held[:1], first=True), IndexEvent("stored", held[1:])]
            )
        hash_ms, lookup_ms = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            h = block_hashes(prompt, 16, "default")
            t1 = time.perf_counter()
            hits = await registry.prefix_blocks(ids, h)
            t2 = time.perf_counter()
            hash_ms.append((t1 - t0) * 1000)
            lookup_ms.append((t2 - t1) * 1000)
        assert hits == {iid: len(hashes) * (i + 1) // instances for i, iid in enumerate(ids)}
        await registry.r.aclose()
        lookup = latency_stats(lookup_ms)
        return {
            "hash_p50": latency_stats(hash_ms)["p50"],
            "lookup_p50": lookup["p50"],
            "lookup_p99": lookup["p99"],
            "total_p50": latency_stats([a + b for a, b in zip(hash_ms, lookup_ms)])["p50"],
        }
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--reps", type=int, default=300)
    a = p.parse_args()
    r = asyncio.run(run(a.tokens, a.instances, a.reps))
    print(f"{a.tokens}-token request, {a.tokens // 16} blocks, {a.instances} instances, {a.reps} reps:")
    print(f"  hash the prompt        p50 {r['hash_p50']:.3f} ms")
    print(f"  Redis lookup (1 RTT)   p50 {r['lookup_p50']:.3f} ms   p99 {r['lookup_p99']:.3f} ms")
    print(f"  total per request      p50 {r['total_p50']:.3f} ms")


if __name__ == "__main__":
    main()
