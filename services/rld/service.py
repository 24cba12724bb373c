"""Relay-decode (datacenter A, a small pool): hide the WAN by streaming at once, then let go.

Lifecycle of a request here (the decode side is shared with main-decode, `shared/decoder.py`):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill arrives in-DC (tens of ms) -> imported; decoding starts at once and tokens
   stream to the user ("eager tokens") while main-decode's copy is still on the WAN.
3. `KVReady` from main-decode starts the handoff, token ids only (`HandoffChunk`):
   - one-shot: stop, send every token main-decode lacks as the final chunk, free the request;
   - catch-up: while the backlog is over `final_tokens`, send up to `chunk_tokens` and keep
     streaming; main-decode acks once it has extended them; then stop and send the rest.
4. If the final handoff fails, relay takes the request back (recomputing its tokens) and
   finishes it itself: the user's stream never breaks.
5. `p-rld` (anomalous traffic) and requests that end before main-decode is ready finish here;
   main-decode and prefill are then told to drop their copy. So do requests whose KV could not
   reach main-decode (`KVReady` with no md): the user's stream goes on from the relay.
"""

from __future__ import annotations

import logging
import time

from shared import subjects
from shared.bus import BusTimeout
from shared.decoder import DecoderService, DecodeState
from shared.messages import Abort, Ack, HandoffChunk, KVReady
from shared.runtime.engine import Engine, TokenOutput
from shared.runtime.sequence import Sequence

log = logging.getLogger(__name__)


class RelayDecoder(DecoderService):
    role = "rld"

    def __init__(self, cfg, inst) -> None:
        super().__init__(cfg, inst)
        self.md_ready: set[str] = set()  # KVReady seen for these requests
        self.handing: set[str] = set()  # a handoff is in progress

    async def setup(self) -> None:
        await super().setup()
        await self.bus.serve(subjects.handoff_ready(self.inst.id), KVReady, self.on_ready)

    async def load(self) -> dict[str, int]:
        return {**await super().load(), "handing": len(self.handing)}

    async def after_admit(self, state: DecodeState, first: int, done: str | None) -> None:
        await super().after_admit(state, first, done)
        if state.task.request_id in self.md_ready:
            self.spawn(self._handoff(state))

    async def on_ready(self, msg: KVReady) -> None:
        state = self.requests.get(msg.request_id)
        if state is None or msg.request_id in self.md_ready:
            return  # finished here already, or a duplicate
        if not msg.md:  # main-decode will not get this request: finish it here
            log.info("%s: %s: no main-decode copy; finishing on relay", self.inst.id, msg.request_id)
            state.task.plan.md = ""
            return
        self.md_ready.add(msg.request_id)
        if state.running:
            self.spawn(self._handoff(state))

    def emit(self, out: TokenOutput) -> None:
        state = self.requests.get(out.seq_id)
        if out.finish_reason is not None:
            self.md_ready.discard(out.seq_id)
            if state is not None and state.task.plan.md:  # finished before the handoff
                self.spawn(self.bus.publish(subjects.ABORT, Abort(out.seq_id, reason="finished on relay")))
        super().emit(out)

    # -- 3. handoff ---------------------------------------------------------------------
    async def _handoff(self, state: DecodeState) -> None:
        rid = state.task.request_id
        if rid in self.handing:
            return
        self.handing.add(rid)
        try:
            sent = await self._catch_up(state) if state.task.plan.handoff == "catchup" else 1
            if sent is not None:
                await self._final(state, sent)
        finally:
            self.handing.discard(rid)

    async def _catch_up(self, state: DecodeState) -> int | None:
        """Send chunks while relay keeps decoding; returns how many tokens md holds, or None
        when the request ended here meanwhile (or the handoff failed and relay carries on)."""
        rid, cfg = state.task.request_id, self.cfg.handoff
        chunk_tokens = state.task.plan.chunk_tokens or cfg.chunk_tokens
        sent = 1  # prefill's first token travelled with the KV
        while True:
            generated = await self.worker.call(lambda e: _generated(e, rid))
            if generated is None:
                return None
            if len(generated) - sent <= cfg.final_tokens:
                return sent
            chunk = HandoffChunk(rid, sent, generated[sent : sent + chunk_tokens])
            if not await self._send(state, chunk):
                return None  # md is gone: relay keeps the request and finishes it
            sent += len(chunk.token_ids)

    async def _final(self, state: DecodeState, sent: int) -> None:
        rid = state.task.request_id
        t0 = time.perf_counter()
        seq = await self.worker.call(lambda e: e.abort(rid))  # stop decoding; frees the blocks
        self._room.set()  # KV parked for want of blocks may fit now
        if seq is None:
            return  # it finished here first
        generated = seq.token_ids[seq.prompt_len :]
        stats = {**state.stats, "handoff_stop_ms": (time.perf_counter() - t0) * 1000}
        final = HandoffChunk(rid, sent, generated[sent:], final=True, stats=stats)
        if await self._send(state, final):
            self.requests.pop(rid, None)
            self.md_ready.discard(rid)
            return
        log.warning("%s: final handoff of %s failed; finishing it on relay", self.inst.id, rid)
        again = Sequence(rid, list(seq.token_ids), seq.params, prompt_len=seq.prompt_len)
        await self.worker.call(lambda e: e.add(again))

    async def _send(self, state: DecodeState, chunk: HandoffChunk) -> bool:
        subject = subjects.handoff_chunk(state.task.plan.md)
        try:
            ack = await self.bus.request(subject, chunk, Ack, self.cfg.handoff.ack_timeout_s)
        except BusTimeout as e:
            log.warning("%s: handoff chunk for %s got no ack: %s", self.inst.id, chunk.request_id, e)
            return False
        return ack.ok


def _generated(engine: Engine, rid: str) -> list[int] | None:
    seq = engine.running.get(rid)
    return None if seq is None else seq.token_ids[seq.prompt_len :]
