"""The fleet of the fleet bench (benchmarks/fleet_bench.py), in Redis: its instances' heartbeats
and their prefix indexes, and the prompts that hit them.

1. `fleet(n)`: n instances, half prefill and a quarter relay in datacenter A, the rest
   main-decode in B, with load figures as their heartbeats carry them.
2. `Corpus`: synthetic documents (1k-4k tokens each, seeded). Each instance caches a random
   set of whole documents until it holds `blocks` chained block hashes (shared/prefix_hash.py,
   the scheduler's own names), so a document sits on about `replicas` instances.
3. `fill_index`: each instance's `pdd:kv:<id>` set, pipelined SADDs in batches, with progress.
4. `prompts`: requests of 1k-4k tokens; a `hit_share` of them open with a cached document's
   first blocks (a prefix some instances hold), the rest are new text (no instance holds any).
5. `Heartbeats`: every instance's heartbeat refreshed each second, as the registrar writes them.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import numpy as np

from shared import subjects
from shared.bus import Bus
from shared.messages import Heartbeat, InstanceInfo
from shared.pipelines import Role
from shared.prefix_hash import block_hashes
from shared.registry import FIRST, KV, Registry

VOCAB = 49_152  # SmolLM2's: token ids are drawn below it
BLOCK = 16
SADD_BATCH = 10_000  # members per SADD


def fleet(n: int) -> list[InstanceInfo]:
    """Half prefill and a quarter relay in A, the rest main-decode in B (one of each at least)."""
    n_prefill = max(1, n // 2)
    n_rld = n // 4 if n >= 4 else 0
    n_md = max(1, n - n_prefill - n_rld)
    roles = [(Role.PREFILL, "A")] * n_prefill + [(Role.RLD, "A")] * n_rld + [(Role.MD, "B")] * n_md
    counters: dict[str, int] = {}
    out = []
    for k, (role, dc) in enumerate(roles):
        i = counters[role] = counters.get(role, -1) + 1
        dtype = "float32" if role == Role.PREFILL else "bfloat16"
        out.append(InstanceInfo(f"{role.value}-{i}", role, dc, kv_host="127.0.0.1", kv_port=20_000 + k, dtype=dtype))
    return out


def with_load(info: InstanceInfo, rng: random.Random, blocks: int) -> InstanceInfo:
    """`info` with a heartbeat's figures: a few requests running and waiting, most of the pool
    holding cached (reusable) blocks, measured speeds."""
    info.running, info.waiting = rng.randint(0, 8), rng.randint(0, 2)
    info.held = info.running + info.waiting
    # no capacity (never full): a simulated instance acks and holds nothing, so the live view's
    # count of dispatches since its last heartbeat would fill a real one's 96 (max_running 32 +
    # max_waiting 64) at ~300 plans/s, and the closed loop met 429s instead of the scheduler
    info.capacity = 0
    info.total_blocks = blocks + blocks // 5
    info.cached_blocks = blocks
    info.free_blocks = max(info.total_blocks - info.running * 200, 0)  # a small pool is full, never below
    info.step_ms = 0.0 if info.role == Role.PREFILL else 20.0 + rng.random() * 5
    info.prefill_tok_s = 20_000.0 if info.role == Role.PREFILL else 0.0
    return info


@dataclass(frozen=True)
class Corpus:
    """Seeded synthetic documents: document i's tokens are regenerated from (seed, i) on demand."""

    documents: int
    min_tokens: int = 1024
    max_tokens: int = 4096
    seed: int = 0

    @classmethod
    def sized(cls, instances: int, blocks: int, replicas: float, min_tokens: int, max_tokens: int) -> Corpus:
        """Enough documents that each sits on about `replicas` of the instances' indexes."""
        mean_blocks = (min_tokens + max_tokens) / 2 / BLOCK
        return cls(max(1, round(instances * blocks / (mean_blocks * replicas))), min_tokens, max_tokens)

    def tokens(self, i: int) -> list[int]:
        rng = np.random.default_rng((self.seed, i))
        return rng.integers(0, VOCAB, int(rng.integers(self.min_tokens, self.max_tokens + 1))).tolist()

    def hashes(self, i: int, namespace: str) -> list[str]:
        return block_hashes(self.tokens(i), BLOCK, namespace)


def picks(corpus: Corpus, instance: int, blocks: int) -> list[int]:
    """The documents instance number `instance` caches, in order: enough that whole ones reach
    `blocks` blocks (the caller cuts the last), fewer only when the corpus is smaller."""
    enough = blocks // max(1, corpus.min_tokens // BLOCK) + 1
    return random.Random(corpus.seed * 1_000_003 + instance).sample(
        range(corpus.documents), min(corpus.documents, enough)
    )


async def fill_index(
    registry: Registry, ids: list[str], corpus: Corpus, blocks: int, namespace: str, say=print
) -> dict[str, float]:
    """Write each instance's `pdd:kv:<id>` set: `blocks` hashes of the documents it caches; each
    document's first block also in the first blocks' index (`pdd:first:<hash>`, and the
    instance's `:firsts`), as the registrar writes a radix cache's events marked `first`."""
    t0, hashed, cache = time.monotonic(), 0.0, {}
    step = max(1, len(ids) // 10)
    for k, iid in enumerate(ids):
        th = time.monotonic()
        members: list[str] = []
        firsts: list[str] = []
        for doc in picks(corpus, k, blocks):
            if doc not in cache:
                cache[doc] = corpus.hashes(doc, namespace)
            members += cache[doc]
            firsts.append(cache[doc][0])
            if len(members) >= blocks:
                break
        members = members[:blocks]
        hashed += time.monotonic() - th
        async with registry.r.pipeline(transaction=False) as pipe:
            pipe.delete(KV + iid, KV + iid + ":firsts")
            for b in range(0, len(members), SADD_BATCH):
                pipe.sadd(KV + iid, *members[b : b + SADD_BATCH])
            pipe.sadd(KV + iid + ":firsts", *firsts)
            for h in firsts:
                pipe.sadd(FIRST + h, iid)
            pipe.set(KV + iid + ":seq", 1)
            await pipe.execute()
        if (k + 1) % step == 0 or k + 1 == len(ids):
            mem = (await registry.r.info("memory"))["used_memory_human"]
            say(
                f"  index: {k + 1}/{len(ids)} instances, {(k + 1) * blocks:,} blocks, "
                f"{time.monotonic() - t0:.0f} s, Redis {mem}"
            )
    return {"fill_s": time.monotonic() - t0, "hash_s": hashed, "documents_hashed": len(cache)}


def prompts(corpus: Corpus, count: int, hit_share: float, seed: int = 1) -> list[list[int]]:
    """`count` prompts of corpus-length: a `hit_share` of them open with some leading blocks of a
    random document (cached on the instances that picked it), then new tokens."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        length = rng.randint(corpus.min_tokens, corpus.max_tokens)
        head: list[int] = []
        if rng.random() < hit_share:
            doc = corpus.tokens(rng.randrange(corpus.documents))
            head = doc[: BLOCK * rng.randint(1, len(doc) // BLOCK)]
        out.append(head[:length] + [rng.randrange(VOCAB) for _ in range(max(0, length - len(head)))])
    return out


class Heartbeats:
    """Every instance's heartbeat, refreshed every `every_s` (the registrar's cadence) with fresh
    load figures, so they stay alive and their figures move as a fleet's do: written to Redis (so
    the fleet is there between phases, with no scheduler running) and, with `bus`, published as
    the instances send them (the schedulers' registrars write them too, and their live views
    plan from them: services/scheduler/live_view.py)."""

    def __init__(
        self, registry: Registry, infos: list[InstanceInfo], blocks: int, every_s: float = 1.0, bus: Bus | None = None
    ) -> None:
        self.registry, self.infos, self.blocks, self.every_s, self.bus = registry, infos, blocks, every_s, bus
        self.rng = random.Random(7)
        self.task: asyncio.Task | None = None
        self.stopping = asyncio.Event()

    async def beat(self, spread: bool = False) -> None:
        """One heartbeat of each instance; `spread`: over the period, as a fleet's clocks spread
        them (all at once, 200 handlers queue ahead of the plans in each registrar)."""
        for info in self.infos:
            beat = with_load(info, self.rng, self.blocks)
            await self.registry.heartbeat(beat)
            if self.bus is not None:
                await self.bus.publish(subjects.heartbeat(beat.id), Heartbeat(beat))
            if spread:
                await asyncio.sleep(self.every_s / len(self.infos) / 2)

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            await self.beat(spread=True)
            await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - started)))

    async def start(self) -> None:
        await self.beat()
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """A cancel that lands inside a redis-py pipeline can be swallowed there (the bench then
        beat on and never ended): the loop also checks `stopping`, and is cancelled until it ends."""
        self.stopping.set()
        while self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task], timeout=1.0)
        if self.bus is not None:  # a drain that does not end must not hold the report back
            await asyncio.wait_for(self.bus.close(), 5.0)
