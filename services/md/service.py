"""Main-decode (datacenter B): receives KV across the WAN and finishes requests.

Lifecycle of a request here (what both decoders run is `shared/decoder.py`; this module is
what only main-decode does: shadows and the receiving side of the handoff; the decode-side
radix cache's stitching of arriving KV is the engine's `admit_with_kv`):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill through the WAN -> stitched onto what the decode-side radix cache (DRC)
   already holds, imported into the pool, and cached at once for the next turn.
   - `p-md`: the sequence joins the batch and streams from prefill's first token on.
   - `p-rld-md`: relay-decode is already streaming. The sequence joins as a *shadow* (computes
     KV, samples nothing) and the relay is told `KVReady`.
3. Handoff (`p-rld-md`), token ids only:
   - a non-final `HandoffChunk` is appended to the shadow; its KV is computed in one extend
     inside the running batch; the ack goes back once the shadow has caught up;
   - the final chunk is appended, the shadow becomes a normal sequence and is acked at once;
   - a chunk sent again (its ack was lost) is taken as once: only tokens it lacks are appended;
     its next step extends the last tokens and samples the next one from the last position.
4. Tokens stream to the gateway with their index; the final chunk carries the stats.
5. Abort or a KV deadline drops the request and frees its blocks (a shadow whose KV never came
   tells the relay to finish the request).
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared import subjects
from shared.decode_state import DecodeRequest, End, Phase
from shared.decoder import DecoderService
from shared.instance import service_main
from shared.messages import Ack, DecodeTask, FinishOnRelay, HandoffChunk, KVReady, token_problem
from shared.pipelines import Role, hands_off
from shared.runtime.engine import TokenOutput

log = logging.getLogger(__name__)
ROLE = Role.MD


class MainDecoder(DecoderService):
    """Main-decode: holds a `p-rld-md` request as a shadow until the relay hands it over."""

    role = ROLE

    async def serve_role(self) -> None:
        await self.bus.serve(subjects.handoff_chunk(self.inst.id), HandoffChunk, self.on_chunk)

    def shadows(self, task: DecodeTask) -> bool:
        return hands_off(task.plan.pipeline)

    async def on_admitted(self, req: DecodeRequest, done: str | None) -> None:
        if req.phase != Phase.SHADOW:
            return
        if done is not None:  # prefill's token ended it: the relay reports that, nothing to hand over
            self.end(req.id, End.DROPPED)
            return
        await self.bus.publish(subjects.handoff_ready(req.task.plan.rld), KVReady(req.id, self.inst.id))

    def on_emit(self, req: DecodeRequest, out: TokenOutput) -> None:
        if req.extend_started:  # the first token after the final chunk: its extend is done
            req.stats.extend_ms += (time.perf_counter() - req.extend_started) * 1000
            req.extend_started = 0.0

    def keeps_kv(self, req: DecodeRequest) -> bool:
        return req.phase in (Phase.PENDING, Phase.PARKED)  # its KV is still on its way: cache it

    def count_hit(self, req: DecodeRequest, tokens: int) -> None:
        req.stats.md_hit_tokens = tokens

    def kv_never_came(self, req: DecodeRequest) -> bool:
        """A shadow whose KV never came: the relay is serving the user and finishes the request."""
        if not self.shadows(req.task):
            return False
        self.end(req.id, End.DROPPED)
        msg = FinishOnRelay(req.id, reason="its KV did not reach main-decode in time")
        self.spawn(self.bus.publish(subjects.finish_on_relay(req.task.plan.rld), msg))
        return True

    def _streamed(self, rid: str) -> bool:
        """This decoder streamed tokens of the ended request `rid` (a shadow streams none until
        its final handoff chunk is taken)."""
        replay = self.replays.get(rid)
        return replay is not None and replay.start >= 0

    async def on_chunk(self, chunk: HandoffChunk) -> Ack:
        rid = chunk.request_id
        req = self.requests.get(rid)
        if req.handed_over if req is not None else chunk.final and self._streamed(rid):
            return Ack(rid)  # the relay sent it again (its ack was lost), maybe after it ended here
        if req is None or req.phase != Phase.SHADOW:
            return Ack(rid, ok=False, error=f"{self.inst.id} holds no shadow of {rid}")
        budget = req.task.sampling.max_tokens
        if problem := token_problem(chunk.token_ids, self.vocab_size, "handoff chunk", budget):
            return Ack(rid, ok=False, error=problem)
        if not 0 <= chunk.start_index < budget:
            return Ack(rid, ok=False, error=f"handoff chunk starts at {chunk.start_index}, outside [0, {budget})")
        t0 = time.perf_counter()
        req.caught_up.clear()
        try:
            added = await self.worker.call(
                lambda e: e.extend_shadow(rid, chunk.start_index, chunk.token_ids, chunk.final)
            )
        except ValueError as e:
            return Ack(rid, ok=False, error=str(e))
        if self.requests.get(rid) is not req:
            return Ack(rid, ok=False, error=f"{rid} ended on {self.inst.id}")
        req.stats.handoff_chunks += 1
        if chunk.final:
            req.stats.merge(chunk.stats)
            req.phase, req.extend_started, req.handed_over = Phase.RUNNING, t0, True
            return Ack(rid)
        if added:  # ack once the extend is done, so the relay's next chunk starts from there
            try:
                await asyncio.wait_for(req.caught_up.wait(), self.cfg.handoff.ack_timeout_s)
            except TimeoutError:
                return Ack(rid, ok=False, error=f"{rid}: extend did not finish in time")
            if self.requests.get(rid) is not req:  # `end` woke us: aborted meanwhile
                return Ack(rid, ok=False, error=f"{rid} ended on {self.inst.id}")
        req.stats.extend_ms += (time.perf_counter() - t0) * 1000
        return Ack(rid)


def main(argv: list[str] | None = None) -> None:
    service_main(MainDecoder, ROLE, argv)
