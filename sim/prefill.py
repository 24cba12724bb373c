"""A simulated prefill instance (datacenter A).

Lifecycle of a request here:
1. `submit`: queued (`queued_tokens` counts the uncached tokens that wait, as the instance
   knows them; the real heartbeat does not report them, see sim/views.py).
2. Start: the prefix cache is matched; at least one token is always computed, to sample the
   first token.
3. Done when its last token is computed: the prompt's blocks enter the cache, the measured
   throughput is updated, and the caller's callback pushes the KV out.

Two engines:
- One prompt at a time (the default, GPU fleets): the cache is matched when the prompt starts
  (earlier prompts may have filled it) and it takes `profile.prefill_ms(new, cached)`.
- Chunked steps (the host's `interleave_prefill`, sim/host.py), as shared/runtime/engine.py
  runs them: the cache is matched on arrival, and each step is ONE forward over at most
  `prefill_step_tokens` tokens taken from the prompts it holds, oldest first. A step costs
  `prefill_fixed_ms` once (weights read, launch) plus each chunk's tokens and its attention
  over what that prompt has computed so far. So two cold prompts sent 1 s apart both compute
  their system prompt and share the forwards, while a short prompt that arrives behind a long
  one waits until the long one's last chunk leaves room in the budget.
The work runs on a `Processor`, so a shared host's contention slows it. The instance's first
forward also pays the host's `cold_start_ms` (a fresh process warming up; sim/host.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.pipelines import Role
from sim.cache import BlockCache, PrefixIndex
from sim.events import EventLoop
from sim.host import Processor, SharedHost
from sim.profiles import ChipProfile
from sim.request import RequestRun, RunState

EWMA = 0.2  # weight of the newest prefill in the measured throughput


@dataclass(eq=False)
class _Prompt:
    run: RequestRun
    on_done: Callable[[RequestRun], None]
    estimate: int  # uncached tokens counted in `queued_tokens` at submission
    computed: int = 0  # [0, computed) has KV: the cached prefix, then chunks
    chunk: int = 0  # tokens in the current step


class PrefillInstance:
    role = Role.PREFILL

    def __init__(
        self,
        iid: str,
        dc: str,
        profile: ChipProfile,
        loop: EventLoop,
        index: PrefixIndex,
        block_tokens: int,
        host: SharedHost,
    ) -> None:
        self.id, self.dc, self.profile, self.loop = iid, dc, profile, loop
        self.proc = Processor(loop, host, iid)
        self.chunked = host.spec.interleave_prefill
        self.step_tokens = host.spec.prefill_step_tokens
        self.cache = BlockCache(iid, profile.kv_tokens // block_tokens, index)
        self.queue: deque[_Prompt] = deque()  # one at a time: waiting to start
        self.held: list[_Prompt] = []  # chunked: every prompt the engine holds, oldest first
        self.busy = False
        self.queued_tokens = 0
        self.tok_s = profile.prefill_tok_s()
        self.busy_ms = 0.0
        self.cold_ms = host.spec.cold_start_ms  # a fresh process's first forward warms it up

    def _warm(self) -> float:
        ms, self.cold_ms = self.cold_ms, 0.0
        return ms

    def submit(self, run: RequestRun, on_done: Callable[[RequestRun], None]) -> None:
        run.state = RunState.PREFILL_QUEUED
        uncached = run.req.prompt_len - run.req.hit_tokens(self.cache.match(run.req.blocks))
        self.queued_tokens += uncached
        prompt = _Prompt(run, on_done, uncached)
        if self.chunked:
            self.held.append(prompt)
            self._match(prompt)
            if not self.busy:  # the step starts once this instant's arrivals are all in
                self.busy = True
                self.loop.after(0.0, self._step)
            return
        self.queue.append(prompt)
        if not self.busy:
            self._start()

    @property
    def running(self) -> int:
        return len(self.held) if self.chunked else len(self.proc.jobs)

    def _match(self, p: _Prompt) -> None:
        req = p.run.req
        hit = req.hit_tokens(self.cache.match(req.blocks))
        if hit >= req.prompt_len:  # keep one token to compute: prefill samples the first token
            hit = (req.prompt_len - 1) // req.block_tokens * req.block_tokens
        self.cache.touch(req.blocks[: hit // req.block_tokens])
        p.run.hit[Role.PREFILL] = p.computed = hit

    # -- one prompt at a time -------------------------------------------------------------------
    def _start(self) -> None:
        if not self.queue:
            self.busy = False
            return
        p = self.queue.popleft()
        self._match(p)
        p.run.state = RunState.PREFILLING
        p.run.marks["prefill_start"] = self.loop.now
        self.busy = True
        ms = self.profile.prefill_ms(p.run.req.prompt_len - p.computed, p.computed) + self._warm()
        self.busy_ms += ms
        self.proc.start(ms, lambda: self._finish(p, then=self._start))

    # -- chunked steps --------------------------------------------------------------------------
    def _step(self) -> None:
        budget, ms, batch = self.step_tokens or float("inf"), 0.0, []
        for p in self.held:
            p.chunk = int(min(p.run.req.prompt_len - p.computed, budget))
            if p.chunk <= 0:
                continue
            if "prefill_start" not in p.run.marks:
                p.run.state = RunState.PREFILLING
                p.run.marks["prefill_start"] = self.loop.now
            ms += self.profile.prefill_ms(p.chunk, p.computed) - self.profile.prefill_fixed_ms
            budget -= p.chunk
            batch.append(p)
        if not batch:
            self.busy = False
            return
        ms += self.profile.prefill_fixed_ms + self._warm()  # one forward for the whole batch
        self.busy, self.busy_ms = True, self.busy_ms + ms
        self.proc.start(ms, lambda: self._stepped(batch))

    def _stepped(self, batch: list[_Prompt]) -> None:
        for p in batch:
            p.computed += p.chunk
            if p.computed >= p.run.req.prompt_len:
                self.held.remove(p)
                self._finish(p)
        self._step()

    def _finish(self, p: _Prompt, then: Callable[[], None] | None = None) -> None:
        run, req = p.run, p.run.req
        self.queued_tokens -= p.estimate
        self.cache.insert(req.blocks)
        new = req.prompt_len - run.hit[Role.PREFILL]
        took = self.loop.now - run.marks["prefill_start"]  # what the instance measures: shared, slowed
        if took > 0 and new >= 64:  # tiny prefills say more about overhead than throughput
            self.tok_s = (1 - EWMA) * self.tok_s + EWMA * new / took * 1000.0
        run.marks["prefill_end"] = self.loop.now
        p.on_done(run)
        if then is not None:
            then()
