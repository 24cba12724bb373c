"""The pieces of one plan, timed alone at the fleet bench's size (benchmarks/fleet_bench.py):
what the scheduler reads from Redis for each request, and the CPU it spends around the policy.

- `time_registry`: `Registry.alive()`, hashing the prompt into blocks, `Registry.prefix_blocks()`
  over every instance (one Lua call), and the three in a row, as `_plan_and_dispatch` does them.
- `time_pieces`: decoding the `Submit`, `choose_plan` over the whole fleet's views, and encoding
  the tasks (prefill's and each decoder's carry the prompt) and the plan, as the scheduler does.
"""

from __future__ import annotations

import dataclasses
import time

from benchmarks.fleet_index import BLOCK
from benchmarks.stats import latency_stats
from services.scheduler.inputs import cluster_policy_config, instance_view
from services.scheduler.policy import PlanRequest, choose_plan
from shared.config import ClusterConfig
from shared.messages import DecodeTask, InstanceInfo, KVTarget, Plan, PrefillTask, Sampling, Submit
from shared.pipelines import Role
from shared.prefix_hash import block_hashes
from shared.registry import Registry


async def time_registry(
    registry: Registry, ids: list[str], prompts: list[list[int]], namespace: str, reps: int
) -> dict:
    """Each read `reps` times over the prompts; also how many prompts hit some instance."""
    alive, hashing, lookup, together, hits = [], [], [], [], []
    for n in range(reps):
        prompt = prompts[n % len(prompts)]
        t0 = time.perf_counter()
        found = await registry.alive()
        t1 = time.perf_counter()
        hashes = block_hashes(prompt, BLOCK, namespace)
        t2 = time.perf_counter()
        blocks = await registry.prefix_blocks(ids, hashes)
        t3 = time.perf_counter()
        if len(found) != len(ids):
            raise RuntimeError(f"alive() found {len(found)} of {len(ids)} instances: heartbeats lapsed")
        alive.append((t1 - t0) * 1000)
        hashing.append((t2 - t1) * 1000)
        lookup.append((t3 - t2) * 1000)
        together.append((t3 - t0) * 1000)
        if n < len(prompts):
            hits.append(blocks)
    hit = [h for h in hits if any(h.values())]
    return {
        "timings": {
            "alive()": latency_stats(alive),
            "block_hashes(prompt)": latency_stats(hashing),
            f"prefix_blocks({len(ids)} instances)": latency_stats(lookup),
            "alive + hash + prefix_blocks": latency_stats(together),
        },
        "hit_share": len(hit) / max(len(hits), 1),
        "instances_hit": sum(sum(1 for n in h.values() if n) for h in hit) / max(len(hit), 1),
        "keys": await registry.r.dbsize(),
        "hits_sample": hits,
    }


def time_pieces(
    cfg: ClusterConfig, infos: list[InstanceInfo], prompts: list[list[int]], hits: list[dict[str, int]], reps: int
) -> dict:
    """The scheduler's CPU per plan outside Redis and NATS, `reps` times over the prompts."""
    policy = cluster_policy_config(cfg)
    decode, choose, encode = [], [], []
    for n in range(reps):
        prompt, hit = prompts[n % len(prompts)], hits[n % len(hits)]
        data = Submit(f"r-{n}", prompt, Sampling(max_tokens=256)).encode()
        t0 = time.perf_counter()
        sub = Submit.decode(data)
        t1 = time.perf_counter()
        views = [instance_view(i, hit.get(i.id, 0) * BLOCK, 0) for i in infos]
        req = PlanRequest(sub.request_id, prompt_len=len(sub.prompt_ids), max_tokens=sub.sampling.max_tokens)
        d = choose_plan(req, views, policy)
        t2 = time.perf_counter()
        plan = Plan(sub.request_id, pipeline=d.pipeline, prefill=d.prefill, rld=d.rld, md=d.md, estimates=d.estimates)
        decoders = [i for i in (d.rld, d.md) if i]
        targets = [KVTarget(i, role=Role.MD if i == d.md else Role.RLD, host="127.0.0.1", port=1) for i in decoders]
        prompt_ids, sampling = sub.prompt_ids, sub.sampling
        PrefillTask(sub.request_id, prompt_ids=prompt_ids, sampling=sampling, targets=targets, plan=plan).encode()
        for _ in decoders:
            DecodeTask(sub.request_id, prompt_ids=prompt_ids, sampling=sampling, plan=plan).encode()
        dataclasses.replace(plan, queue_ms=1.0).encode()
        t3 = time.perf_counter()
        decode.append((t1 - t0) * 1000)
        choose.append((t2 - t1) * 1000)
        encode.append((t3 - t2) * 1000)
    return {
        "Submit.decode (the prompt's ids checked)": latency_stats(decode),
        f"views + choose_plan ({len(infos)} instances)": latency_stats(choose),
        "encode the tasks and the plan": latency_stats(encode),
    }
