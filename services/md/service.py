"""Main-decode (datacenter B): receives KV across the WAN and finishes requests.

Lifecycle of a request here (the decode side is shared with relay-decode, see
`shared/decoder.py`):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill through the WAN link -> imported into the pool.
   - `p-md`: the sequence joins the batch and streams from prefill's first token on.
   - `p-rld-md`: relay-decode is already streaming. The sequence joins as a *shadow* (computes
     KV, samples nothing) and relay is told `KVReady`.
3. Handoff (`p-rld-md`), token ids only:
   - a non-final `HandoffChunk` is appended to the shadow; its KV is computed in one extend
     inside the running batch; the ack goes back once the shadow has caught up;
   - the final chunk is appended, the shadow becomes a normal sequence and is acked at once;
     its next step extends the last tokens and samples the next one from the last position.
4. Tokens stream to the gateway with their index; the final chunk carries the stats.
5. Abort or a KV deadline drops the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import time

from shared import subjects
from shared.decoder import DecoderService, DecodeState
from shared.messages import Ack, DecodeTask, HandoffChunk, KVReady
from shared.runtime.engine import Engine, TokenOutput


class MainDecoder(DecoderService):
    role = "md"

    def __init__(self, cfg, inst) -> None:
        super().__init__(cfg, inst)
        self.caught_up: dict[str, asyncio.Event] = {}
        self.extend_started: dict[str, float] = {}  # request -> when the final chunk arrived

    async def setup(self) -> None:
        await super().setup()
        await self.bus.serve(subjects.handoff_chunk(self.inst.id), HandoffChunk, self.on_chunk)

    def admits_as_shadow(self, task: DecodeTask) -> bool:
        return task.plan.pipeline == "p-rld-md"

    async def after_admit(self, state: DecodeState, first: int, done: str | None) -> None:
        if not self.admits_as_shadow(state.task):
            await super().after_admit(state, first, done)
            return
        if done is not None:  # prefill's token ended it; relay reports that, nothing to hand over
            self.requests.pop(state.task.request_id, None)
            return
        plan = state.task.plan
        await self.bus.publish(subjects.handoff_ready(plan.rld), KVReady(plan.request_id, self.inst.id))

    def on_kv_deadline(self, rid: str, state: DecodeState, error: str) -> None:
        if not self.admits_as_shadow(state.task):
            super().on_kv_deadline(rid, state, error)
            return
        self.requests.pop(rid, None)  # the relay is serving the user: it finishes the request
        self.spawn(self.bus.publish(subjects.handoff_ready(state.task.plan.rld), KVReady(rid, md="")))

    # -- 3. handoff ---------------------------------------------------------------------
    async def on_chunk(self, chunk: HandoffChunk) -> Ack:
        rid = chunk.request_id
        state = self.requests.get(rid)
        if state is None or not state.running:
            return Ack(rid, ok=False, error=f"{self.inst.id} holds no running request {rid}")
        t0 = time.perf_counter()
        event = self.caught_up.setdefault(rid, asyncio.Event())
        event.clear()
        try:
            added = await self.worker.call(lambda e: _append(e, rid, chunk))
        except ValueError as e:
            return Ack(rid, ok=False, error=str(e))
        stats = state.stats
        stats["handoff_chunks"] = stats.get("handoff_chunks", 0) + 1
        if chunk.final:
            for key, value in chunk.stats.items():
                stats.setdefault(key, value) if not isinstance(value, dict) else stats.setdefault(key, {}).update(value)
            self.extend_started[rid] = t0
            return Ack(rid)
        if added:
            await asyncio.wait_for(event.wait(), self.cfg.handoff.ack_timeout_s)
        _add_ms(stats, "extend", (time.perf_counter() - t0) * 1000)
        return Ack(rid)

    def on_caught_up(self, out: TokenOutput) -> None:
        event = self.caught_up.get(out.seq_id)
        if event is not None:
            event.set()

    def emit(self, out: TokenOutput) -> None:
        started = self.extend_started.pop(out.seq_id, None)
        state = self.requests.get(out.seq_id)
        if started is not None and state is not None:  # first token after the final chunk
            _add_ms(state.stats, "extend", (time.perf_counter() - started) * 1000)
        if out.finish_reason is not None:
            self.caught_up.pop(out.seq_id, None)
        super().emit(out)


def _add_ms(stats: dict, key: str, ms: float) -> None:
    timings = stats.setdefault("timings_ms", {})
    timings[key] = timings.get(key, 0.0) + ms


def _append(engine: Engine, rid: str, chunk: HandoffChunk) -> int:
    """On the engine thread: add the chunk's tokens the shadow lacks. Returns how many."""
    seq = engine.running.get(rid)
    if seq is None:
        raise ValueError(f"request {rid} is not running here")
    have = seq.num_generated
    if chunk.start_index > have:
        raise ValueError(f"handoff gap: have tokens [0, {have}), chunk starts at {chunk.start_index}")
    new = chunk.token_ids[have - chunk.start_index :]
    seq.token_ids.extend(new)
    if chunk.final:
        seq.shadow = False
    return len(new)
