"""A simulated prefill instance (datacenter A).

Lifecycle of a request here:
1. `submit`: queued first come, first served (`queued_tokens` counts the uncached tokens that
   wait, as the real instance reports them to the scheduler).
2. Start: the prefix cache is matched now (earlier prompts in the queue may have filled it);
   at least one token is always computed, to sample the first token.
3. Done after `profile.prefill_ms(new, cached)`: the prompt's blocks enter the cache, the
   measured throughput is updated, and the caller's callback pushes the KV out.
One prompt at a time by default. With the host's `interleave_prefill` (sim/host.py) every
submitted prompt starts at once (its cache matched then) and all share the instance's speed:
the real engine batches chunks of several prompts per forward, so two cold prompts sent 1 s
apart both compute their system prompt and both finish late. A prompt that joins while others
are computing does not pay `prefill_fixed_ms` again: that is the cost of a forward (weights
read, launch), which the batch's forwards already pay; it adds only its tokens' work. The work runs on a `Processor`,
so a shared host's contention slows it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sim.cache import BlockCache, PrefixIndex
from sim.events import EventLoop
from sim.host import Processor, SharedHost
from sim.profiles import ChipProfile
from sim.request import RequestRun, RunState

EWMA = 0.2  # weight of the newest prefill in the measured throughput


class PrefillInstance:
    role = "prefill"

    def __init__(self, iid: str, dc: str, profile: ChipProfile, loop: EventLoop, index: PrefixIndex,
                 block_tokens: int, host: SharedHost) -> None:  # fmt: skip
        self.id, self.dc, self.profile, self.loop = iid, dc, profile, loop
        self.proc = Processor(loop, host, iid)
        self.interleave = host.spec.interleave_prefill
        self.cache = BlockCache(iid, profile.kv_tokens // block_tokens, index)
        self.queue: deque[tuple[RequestRun, Callable[[RequestRun], None], int]] = deque()
        self.busy = False
        self.queued_tokens = 0
        self.tok_s = profile.prefill_tok_s()
        self.busy_ms = 0.0

    def submit(self, run: RequestRun, on_done: Callable[[RequestRun], None]) -> None:
        run.state = RunState.PREFILL_QUEUED
        uncached = run.req.prompt_len - run.req.hit_tokens(self.cache.match(run.req.blocks))
        self.queue.append((run, on_done, uncached))
        self.queued_tokens += uncached
        if self.interleave or not self.busy:
            self._start()

    @property
    def running(self) -> int:
        return len(self.proc.jobs)

    def _start(self) -> None:
        if not self.queue:
            self.busy = False
            return
        run, on_done, estimate = self.queue.popleft()
        req = run.req
        hit = req.hit_tokens(self.cache.match(req.blocks))
        if hit >= req.prompt_len:  # keep one token to compute: prefill samples the first token
            hit = (req.prompt_len - 1) // req.block_tokens * req.block_tokens
        self.cache.touch(req.blocks[: hit // req.block_tokens])
        run.hit["prefill"] = hit
        run.state = RunState.PREFILLING
        run.marks["prefill_start"] = self.loop.now
        joins = self.interleave and self.running > 0  # rides the forwards already under way
        self.busy = True
        ms = self.profile.prefill_ms(req.prompt_len - hit, hit) - (self.profile.prefill_fixed_ms if joins else 0.0)
        self.proc.start(ms, lambda: self._done(run, on_done, ms, estimate))

    def _done(self, run: RequestRun, on_done: Callable[[RequestRun], None], ms: float, estimate: int) -> None:
        req = run.req
        self.queued_tokens -= estimate
        self.busy_ms += ms
        self.cache.insert(req.blocks)
        new = req.prompt_len - run.hit["prefill"]
        took = self.loop.now - run.marks["prefill_start"]  # what the instance measures: shared, slowed
        if took > 0 and new >= 64:  # tiny prefills say more about overhead than throughput
            self.tok_s = (1 - EWMA) * self.tok_s + EWMA * new / took * 1000.0
        run.marks["prefill_end"] = self.loop.now
        on_done(run)
        if not self.interleave:
            self._start()
