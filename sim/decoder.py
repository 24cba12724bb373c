"""A simulated decoder: relay-decode (RLD, datacenter A) or main-decode (MD, with the DRC).

Lifecycle of a request here:
1. Planned: counted as `pending` (the scheduler committed it; its KV is on the way).
2. `admit`: its KV has landed. It joins the running batch at the next step boundary (at once
   when idle), if a slot and KV room are free; otherwise it waits, first come first served.
   An emitting sequence that has streamed nothing yet publishes token 0 (prefill's) on joining.
3. Every step: each emitting sequence gains one token; an extend (handoff chunk) adds its
   tokens to the same forward. A *shadow* (MD holding KV while RLD streams) computes only its
   chunks and emits nothing; `on_extended` fires when a chunk's KV is computed (MD's ack).
4. A sequence leaves when its request has all its tokens (`on_finish`: the DRC keeps prompt
   plus answer) or when a handoff stopped it (`on_stop`: RLD lets go at a step boundary).

Steps are continuous batching: step time = `profile.step_ms(batch, context, extra)`, times the
shared host's slowdown at the step's start (sim/host.py; 1 unless the host is shared). A KV that
lands mid-step waits for the step's end, as the real import waits for the engine thread (half a
step on average). Steps are
events on the shared loop, but a step that ends before the loop's next event runs inline in a
tight loop: nothing can observe the decoder in between, so the result is the same as one event
per step, at a fraction of the cost. KV: each running sequence reserves its prompt plus its
whole output; the DRC may use the rest of the pool and is evicted (LRU) as sequences arrive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sim.cache import BlockCache, PrefixIndex
from sim.events import EventLoop
from sim.host import SharedHost
from sim.profiles import ChipProfile
from sim.request import RequestRun

POOL_BLOCK = 16  # tokens per KV pool block, as the runtime allocates them


@dataclass(eq=False)
class Slot:
    run: RequestRun
    ctx: int  # tokens whose KV this instance holds
    emit: bool = True  # False: a shadow, computing handoff chunks only
    extend: int = 0  # tokens to compute in the next step (a handoff chunk)
    stop: bool = False  # a handoff asked this sequence to leave after the current step
    active: bool = False  # in the running batch
    on_finish: Callable[[Slot, float], None] | None = None
    on_stop: Callable[[Slot, float], None] | None = None
    on_extended: Callable[[Slot, float], None] | None = None

    @property
    def reserve(self) -> int:
        return self.run.req.prompt_len + self.run.req.output_len


class DecodeInstance:
    def __init__(
        self,
        iid: str,
        role: str,
        dc: str,
        profile: ChipProfile,
        loop: EventLoop,
        index: PrefixIndex,
        block_tokens: int,
        host: SharedHost,
        prefix_cache: bool = True,
    ) -> None:
        self.id, self.role, self.dc, self.profile, self.loop = iid, role, dc, profile, loop
        self.to_client_ms = 0.0  # a token's way to the gateway (the line's delay from the other site)
        self.host = host
        self.cold = host.spec.cold_start_ms > 0  # the first KV import pays the process's warm-up
        self.block_tokens = block_tokens
        self.cache_blocks = profile.kv_tokens // block_tokens if prefix_cache else 0
        self.cache = BlockCache(iid, self.cache_blocks, index)
        self.running: list[Slot] = []
        self.waiting: deque[Slot] = deque()
        self.pending = 0
        self.used_tokens = 0
        self.step_end: float | None = None
        self._batch: list[Slot] = []
        self.last_step_ms: float | None = None
        self.busy_ms = 0.0
        self.steps = 0

    # -- what the scheduler sees ------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return self.profile.kv_tokens // POOL_BLOCK

    @property
    def free_blocks(self) -> int:
        return max(self.profile.kv_tokens - self.used_tokens, 0) // POOL_BLOCK

    def import_ms(self, tokens: int) -> float:
        """Host-side cost of importing `tokens` of KV here (the first import also warms the process)."""
        ms = self.profile.kv_io_ms(tokens)
        if self.cold:
            self.cold = False
            ms += self.host.spec.cold_start_ms
        return ms

    # -- commands -----------------------------------------------------------------------------
    def admit(self, slot: Slot) -> None:
        self.waiting.append(slot)
        if self.step_end is None:
            self._start_step(self.loop.now)

    def request_stop(self, slot: Slot) -> None:
        """Leave at the end of the current step (or now, if it never started running)."""
        if slot in self.waiting:
            self.waiting.remove(slot)
            slot.on_stop(slot, self.loop.now)
        elif slot.active:
            slot.stop = True
            if self.step_end is None:
                self._start_step(self.loop.now)

    def add_extend(self, slot: Slot, tokens: int, emit: bool) -> None:
        """A handoff chunk: compute `tokens` more in the next step; `emit` turns a shadow live."""
        slot.extend += tokens
        slot.emit = slot.emit or emit
        if self.step_end is None:
            self._start_step(self.loop.now)

    def drop(self, slot: Slot) -> None:
        if slot in self.waiting:
            self.waiting.remove(slot)
        elif slot.active:
            self._leave(slot)

    # -- the step loop ------------------------------------------------------------------------
    def _fits(self, slot: Slot) -> bool:
        return not self.running or (
            len(self.running) < self.profile.max_running and self.used_tokens + slot.reserve <= self.profile.kv_tokens
        )

    def _join(self, now: float) -> None:
        while self.waiting and self._fits(self.waiting[0]):
            slot = self.waiting.popleft()
            self.running.append(slot)
            slot.active = True
            self.used_tokens += slot.reserve
            run = slot.run
            if slot.emit and run.emitted == 0:  # prefill's first token, unless prefill streamed it
                run.emit(now + self.to_client_ms, self.role)
            if slot.emit and run.done:
                self._leave(slot)
                slot.on_finish(slot, now)
        room = (self.profile.kv_tokens - self.used_tokens) // self.block_tokens
        self.cache.shrink_to(min(self.cache_blocks, room))

    def _start_step(self, now: float) -> None:
        self._join(now)
        if self._plan_step(now):
            self.loop.at(self.step_end, self._on_step_end)

    def _on_step_end(self) -> None:
        loop = self.loop
        while True:
            t = self.step_end
            loop.now = t
            self._finish_step(t)
            self._join(t)
            if not self._plan_step(t):
                return
            if self.step_end >= loop.next_time():
                loop.at(self.step_end, self._on_step_end)
                return

    def _plan_step(self, now: float) -> bool:
        """Set up the next step from the running set; False (and idle) when nothing computes."""
        batch = [s for s in self.running if s.emit or s.extend or s.stop]
        if not batch:
            self.step_end = None
            self.host.set_busy(self.id, False)
            return False
        self.host.set_busy(self.id, True)
        context = sum(s.ctx for s in batch)
        extra = sum(max(s.extend - 1, 0) if s.emit else s.extend for s in batch)
        ms = self.profile.step_ms(len(batch), context, extra) * self.host.slowdown()
        self._batch, self.last_step_ms = batch, ms
        self.busy_ms += ms
        self.steps += 1
        self.step_end = now + ms
        return True

    def _finish_step(self, t: float) -> None:
        for slot in self._batch:
            if not slot.active:  # dropped mid-step
                continue
            run = slot.run
            if slot.extend:
                slot.ctx += slot.extend
                slot.extend = 0
                if not slot.emit:
                    slot.on_extended(slot, t)
                    continue
            if slot.emit:
                run.emit(t + self.to_client_ms, self.role)
                slot.ctx += 1
                if run.done:
                    self._leave(slot)
                    slot.on_finish(slot, t)
                    continue
            if slot.stop:
                self._leave(slot)
                slot.on_stop(slot, t)

    def _leave(self, slot: Slot) -> None:
        self.running.remove(slot)
        slot.active = False
        self.used_tokens -= slot.reserve
