"""The relay -> main-decode handoff, both sides in one place (token ids only, never KV).

A `p-rld-md` request runs on both decoders at once: the relay streams to the user while
main-decode's copy of the prompt KV crosses the WAN; main-decode holds it as a *shadow*
(computes KV, samples nothing). Then:

    md  -> rld   KVReady(request, md)        the shadow holds the prompt KV: hand over
    rld -> md    HandoffChunk(start, ids)    catch-up only: a chunk of the relay's tokens, while
                 <- Ack once extended        the relay keeps streaming; repeated until the gap
                                             is at most `final_tokens`
    rld -> md    HandoffChunk(..., final)    the relay stops; every token md lacks; acked at once
                 <- Ack                      md samples from the next index on; the relay lets go

One-shot is the final chunk alone. If a chunk cannot be delivered (md died or dropped its
copy) the relay keeps the request and finishes it: the user's stream never breaks. When
main-decode will never get the request (its KV push failed, or never came), `FinishOnRelay`
tells the relay so; a request that ends on the relay tells md (an abort) it is over: md lets
the KV on its way land into its prefix cache (`handoff.warm_md_cache`: the session's next turn
hits it there, as under p-md) and drops the rest.

`RelaySide` and `MainSide` plug into `DecoderService` (shared/decoder.py) at five points:
`serve()` (their subjects), `shadows(task)`, `admitted(req, done)`, `emitting(req, out)` and
`kv_never_came(req)`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time

from shared import subjects
from shared.bus import BusTimeout
from shared.decode_state import Decoder, DecodeRequest, End, Phase
from shared.messages import Abort, Ack, DecodeTask, FinishOnRelay, HandoffChunk, KVReady, token_problem
from shared.pipelines import Handoff, hands_off
from shared.runtime.engine import TokenOutput
from shared.runtime.sequence import Sequence

log = logging.getLogger(__name__)


class RelaySide:
    """The relay: streams at once, hands over when main-decode is ready, then lets go."""

    def __init__(self, decoder: Decoder) -> None:
        self.d = decoder

    async def serve(self) -> None:
        iid = self.d.inst.id
        await self.d.bus.serve(subjects.handoff_ready(iid), KVReady, self.on_ready)
        await self.d.bus.serve(subjects.finish_on_relay(iid), FinishOnRelay, self.on_finish_here)

    def shadows(self, task: DecodeTask) -> bool:
        return False

    async def admitted(self, req: DecodeRequest, done: str | None) -> None:
        if done is None and req.md_ready:  # main-decode was ready before the relay
            self._start(req)

    async def on_ready(self, msg: KVReady) -> None:
        req = self.d.requests.get(msg.request_id)
        if req is None or req.md_ready or req.alone:
            return  # finished here already, a duplicate, or a late one
        req.md_ready = True
        if req.phase == Phase.RUNNING:
            self._start(req)

    async def on_finish_here(self, msg: FinishOnRelay) -> None:
        req = self.d.requests.get(msg.request_id)
        if req is not None and not req.md_ready:
            log.info("%s: %s: main-decode will not get it (%s); finishing on relay", self.d.inst.id, req.id, msg.reason)
            req.alone = True

    def emitting(self, req: DecodeRequest, out: TokenOutput) -> None:
        if out.finish_reason is not None and req.task.plan.md and not req.alone:  # ends here, before the handoff
            keep = self.d.cfg.handoff.warm_md_cache  # md's KV still lands, into its cache only
            self.d.spawn(self.d.bus.publish(subjects.ABORT, Abort(req.id, reason="finished on relay", keep_kv=keep)))

    def kv_never_came(self, req: DecodeRequest) -> bool:
        return False

    # -- the handoff ----------------------------------------------------------------------
    def _start(self, req: DecodeRequest) -> None:
        req.phase = Phase.HANDING_OFF
        self.d.spawn_for(req, self._handoff(req))

    async def _handoff(self, req: DecodeRequest) -> None:
        sent = await self._catch_up(req) if req.task.plan.handoff == Handoff.CATCHUP else 1
        if sent is None:
            req.phase = Phase.RUNNING  # md is gone: the relay finishes the request
            return
        await self._final(req, sent)

    async def _catch_up(self, req: DecodeRequest) -> int | None:
        """Send chunks while the relay keeps decoding; returns how many tokens md holds, or
        None when the request ended here meanwhile or md stopped answering."""
        cfg = self.d.cfg.handoff
        chunk_tokens = req.task.plan.chunk_tokens or cfg.chunk_tokens
        sent = 1  # prefill's first token travelled with the KV
        while True:
            generated = await self.d.worker.call(lambda e: e.generated(req.id))
            if generated is None:
                return None
            if len(generated) - sent <= cfg.final_tokens:
                return sent
            chunk = HandoffChunk(req.id, sent, generated[sent : sent + chunk_tokens])
            if not await self._send(req, chunk):
                return None
            sent += len(chunk.token_ids)

    async def _final(self, req: DecodeRequest, sent: int) -> None:
        t0 = time.perf_counter()
        seq = await self.d.worker.call(lambda e: e.abort(req.id))  # stop decoding; frees the blocks
        self.d.room_freed()  # KV parked for want of blocks may fit now
        if seq is None:
            return  # it finished here first
        stats = copy.copy(req.stats)
        stats.handoff_stop_ms = (time.perf_counter() - t0) * 1000
        generated = seq.token_ids[seq.prompt_len :]
        if await self._send(req, HandoffChunk(req.id, sent, generated[sent:], final=True, stats=stats)):
            self.d.end(req.id, End.HANDED_OFF)
            return
        log.warning("%s: final handoff of %s failed; finishing it on relay", self.d.inst.id, req.id)
        req.phase = Phase.RUNNING
        again = Sequence(req.id, list(seq.token_ids), seq.params, prompt_len=seq.prompt_len)
        await self.d.worker.call(lambda e: e.add(again))

    async def _send(self, req: DecodeRequest, chunk: HandoffChunk) -> bool:
        subject = subjects.handoff_chunk(req.task.plan.md)
        try:
            ack = await self.d.bus.request(subject, chunk, Ack, self.d.cfg.handoff.ack_timeout_s)
        except BusTimeout as e:
            log.warning("%s: handoff chunk for %s got no ack: %s", self.d.inst.id, chunk.request_id, e)
            return False
        if not ack.ok:
            log.warning("%s: main-decode refused a handoff chunk of %s: %s", self.d.inst.id, req.id, ack.error)
        return ack.ok


class MainSide:
    """Main-decode: holds a `p-rld-md` request as a shadow until the relay hands it over."""

    def __init__(self, decoder: Decoder) -> None:
        self.d = decoder

    async def serve(self) -> None:
        await self.d.bus.serve(subjects.handoff_chunk(self.d.inst.id), HandoffChunk, self.on_chunk)

    def shadows(self, task: DecodeTask) -> bool:
        return hands_off(task.plan.pipeline)

    async def admitted(self, req: DecodeRequest, done: str | None) -> None:
        if req.phase != Phase.SHADOW:
            return
        if done is not None:  # prefill's token ended it: the relay reports that, nothing to hand over
            self.d.end(req.id, End.DROPPED)
            return
        await self.d.bus.publish(subjects.handoff_ready(req.task.plan.rld), KVReady(req.id, self.d.inst.id))

    def emitting(self, req: DecodeRequest, out: TokenOutput) -> None:
        if req.extend_started:  # the first token after the final chunk: its extend is done
            req.stats.extend_ms += (time.perf_counter() - req.extend_started) * 1000
            req.extend_started = 0.0

    def kv_never_came(self, req: DecodeRequest) -> bool:
        """A shadow whose KV never came: the relay is serving the user and finishes the request."""
        if not self.shadows(req.task):
            return False
        self.d.end(req.id, End.DROPPED)
        msg = FinishOnRelay(req.id, reason="its KV did not reach main-decode in time")
        self.d.spawn(self.d.bus.publish(subjects.finish_on_relay(req.task.plan.rld), msg))
        return True

    async def on_chunk(self, chunk: HandoffChunk) -> Ack:
        rid = chunk.request_id
        req = self.d.requests.get(rid)
        if req is None or req.phase != Phase.SHADOW:
            return Ack(rid, ok=False, error=f"{self.d.inst.id} holds no shadow of {rid}")
        budget = req.task.sampling.max_tokens
        if problem := token_problem(chunk.token_ids, self.d.vocab_size, "handoff chunk", budget):
            return Ack(rid, ok=False, error=problem)
        if not 0 <= chunk.start_index < budget:
            return Ack(rid, ok=False, error=f"handoff chunk starts at {chunk.start_index}, outside [0, {budget})")
        t0 = time.perf_counter()
        req.caught_up.clear()
        try:
            added = await self.d.worker.call(
                lambda e: e.extend_shadow(rid, chunk.start_index, chunk.token_ids, chunk.final)
            )
        except ValueError as e:
            return Ack(rid, ok=False, error=str(e))
        if self.d.requests.get(rid) is not req:
            return Ack(rid, ok=False, error=f"{rid} ended on {self.d.inst.id}")
        req.stats.handoff_chunks += 1
        if chunk.final:
            req.stats.merge(chunk.stats)
            req.phase, req.extend_started = Phase.RUNNING, t0
            return Ack(rid)
        if added:  # ack once the extend is done, so the relay's next chunk starts from there
            try:
                await asyncio.wait_for(req.caught_up.wait(), self.d.cfg.handoff.ack_timeout_s)
            except TimeoutError:
                return Ack(rid, ok=False, error=f"{rid}: extend did not finish in time")
            if self.d.requests.get(rid) is not req:  # `end` woke us: aborted meanwhile
                return Ack(rid, ok=False, error=f"{rid} ended on {self.d.inst.id}")
        req.stats.extend_ms += (time.perf_counter() - t0) * 1000
        return Ack(rid)
