"""The pieces of one plan, timed alone at the fleet bench's size (benchmarks/fleet_bench.py):
what the scheduler reads from Redis for each request, and the CPU it spends around the policy.

- `time_registry`: `Registry.alive()`, hashing the prompt into blocks, `Registry.prefix_blocks()`
  over every instance (one Lua call), and the three in a row, as `_plan_and_dispatch` does them.
- `time_pieces`: decoding the `Submit`, `choose_plan` over the whole fleet's views, and encoding
  the tasks (prefill's and each decoder's carry the prompt) and the plan, as the scheduler does.
- `time_plan_path`: the scheduler's whole `on_submit` in this process, one plan after another,
  against the real Redis, its live view fed the fleet's heartbeats and a bus that acks at once
  (each message still encoded and the ack decoded): CPU seconds per plan of this process alone,
  which other processes on the host barely move (the phases' figures move with them).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

from benchmarks.fleet_index import BLOCK, with_load
from benchmarks.fleet_load import PLACEHOLDER
from benchmarks.stats import latency_stats
from services.scheduler.inputs import cluster_policy_config, instance_view
from services.scheduler.live_view import LiveView
from services.scheduler.policy import PlanRequest, choose_plan
from services.scheduler.registrar import Liveness
from services.scheduler.service import Scheduler
from shared.config import ClusterConfig
from shared.messages import (
    Ack,
    DecodeTask,
    Heartbeat,
    InstanceInfo,
    KVTarget,
    Message,
    Plan,
    PrefillTask,
    Sampling,
    Submit,
)
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


class AckingBus:
    """The scheduler's bus with every instance acking at once: each message encoded, each ack decoded."""

    async def publish(self, subject: str, msg: Message) -> None:
        msg.encode()

    async def request(self, subject: str, msg: Message, reply_type: type, timeout: float):
        msg.encode()
        return reply_type.decode(Ack(msg.request_id).encode())


async def time_plan_path(
    cfg: ClusterConfig, infos: list[InstanceInfo], submits: list[bytes], registry: Registry, plans: int
) -> dict:
    """CPU ms per plan of `Scheduler.on_submit` (with the Submit's decode and the plan's encode),
    over batches of 100 after one to warm up; `submits`: encoded with `fleet_load.PLACEHOLDER` ids."""
    scheduler = Scheduler(cfg)
    scheduler.bus, scheduler.registry = AckingBus(), registry
    scheduler.view = LiveView(Liveness(cfg.heartbeat_ttl_s, heartbeat_s=cfg.heartbeat_s), now=0.0)
    rng, run = random.Random(5), os.urandom(2).hex()  # ids no earlier run planned (their plans are kept)
    per_plan_ms = []
    for batch in range(1 + max(1, plans // 100)):  # the first warms up, untimed
        for info in infos:  # every instance heartbeats between batches: alive, its dispatches seen
            beat = Heartbeat(with_load(dataclasses.replace(info), rng, 100_000))
            scheduler.view.heard(Heartbeat.decode(beat.encode()), now=time.time() + 3600)
        started = time.process_time()
        for n in range(batch * 100, batch * 100 + 100):
            rid = f"fleet-{run}-99-{n:09d}".encode()
            sub = Submit.decode(submits[n % len(submits)].replace(PLACEHOLDER.encode(), rid))
            if (plan := await scheduler.on_submit(sub)).error:
                raise RuntimeError(f"the plan path refused a plan: {plan.error}")
            plan.encode()
        if batch:
            per_plan_ms.append((time.process_time() - started) * 1000 / 100)
    return latency_stats(per_plan_ms)
