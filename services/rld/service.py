"""Relay-decode (datacenter A, a small pool): hide the WAN by streaming at once, then let go.

Lifecycle of a request here (what both decoders run is `shared/decoder.py`; this module is
what only the relay does: the sending side of the handoff, finishing alone; the receiving side
is `services/md/service.py`, the messages' order `shared/messages.py`'s handoff section):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill arrives in-DC (tens of ms) -> imported; decoding starts at once and tokens
   stream to the user ("eager tokens") while main-decode's copy is still on the WAN.
3. `KVReady` from main-decode starts the handoff, token ids only (`HandoffChunk`):
   - one-shot: stop, send every token main-decode lacks as the final chunk, let go;
   - catch-up: while the backlog is over `final_tokens`, send up to `chunk_tokens` and keep
     streaming; main-decode acks once it has extended them; then stop and send the rest.
4. A handoff chunk (or its ack) lost on the bus is sent again after a few round trips, until
   `handoff.ack_timeout_s` (main-decode takes a chunk twice as once). If it cannot be
   delivered, the relay keeps the request (recomputing its
   tokens if it had stopped) and finishes it itself: the user's stream never breaks.
5. `p-rld` requests (anomalous traffic, or no main-decode reachable), requests that end before
   main-decode is ready, and requests main-decode will never get (`FinishOnRelay`) finish here;
   main-decode is then told to drop its copy.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time

from shared import failpoints, subjects
from shared.bus import BusTimeout
from shared.decode_state import DecodeRequest, End, Phase
from shared.decoder import DecoderService
from shared.instance import service_main
from shared.messages import Abort, Ack, FinishOnRelay, HandoffChunk, KVReady
from shared.pipelines import Handoff, Role
from shared.runtime.engine import TokenOutput
from shared.runtime.sequence import Sequence

log = logging.getLogger(__name__)
ROLE = Role.RLD
HANDOFF_RESEND_S = 2.0  # a handoff chunk with no ack for this long (at least) is sent again


class RelayDecoder(DecoderService):
    """The relay: streams at once, hands over when main-decode is ready, then lets go."""

    role = ROLE

    async def serve_role(self) -> None:
        iid = self.inst.id
        await self.bus.serve(subjects.handoff_ready(iid), KVReady, self.on_ready)
        await self.bus.serve(subjects.finish_on_relay(iid), FinishOnRelay, self.on_finish_here)

    def count_hit(self, req: DecodeRequest, tokens: int) -> None:
        req.stats.rld_hit_tokens = tokens

    async def on_admitted(self, req: DecodeRequest, done: str | None) -> None:
        if done is None and req.md_ready:  # main-decode was ready before the relay
            self._start(req)

    async def on_ready(self, msg: KVReady) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.md_ready or req.alone:
            return  # finished here already, a duplicate, or a late one
        req.md_ready = True
        if req.phase == Phase.RUNNING:
            self._start(req)

    async def on_finish_here(self, msg: FinishOnRelay) -> None:
        req = self.requests.get(msg.request_id)
        if req is not None and not req.md_ready:
            log.info("%s: %s: main-decode will not get it (%s); finishing on relay", self.inst.id, req.id, msg.reason)
            req.alone = True

    def on_emit(self, req: DecodeRequest, out: TokenOutput) -> None:
        if out.finish_reason is not None and req.task.plan.md and not req.alone:  # ends here, before the handoff
            keep = self.cfg.handoff.warm_md_cache  # md's KV still lands, into its cache only
            self.spawn(self.bus.publish(subjects.ABORT, Abort(req.id, reason="finished on relay", keep_kv=keep)))

    # -- the handoff ----------------------------------------------------------------------
    def _start(self, req: DecodeRequest) -> None:
        req.phase = Phase.HANDING_OFF
        self.spawn_for(req, self._handoff(req))

    async def _handoff(self, req: DecodeRequest) -> None:
        sent = await self._catch_up(req) if req.task.plan.handoff == Handoff.CATCHUP else self._md_holds(req)
        if sent is None:
            req.phase = Phase.RUNNING  # md is gone: the relay finishes the request
            return
        await self._final(req, sent)

    async def _catch_up(self, req: DecodeRequest) -> int | None:
        """Send chunks while the relay keeps decoding; returns how many tokens md holds, or
        None when the request ended here meanwhile or md stopped answering."""
        cfg = self.cfg.handoff
        chunk_tokens = req.task.plan.chunk_tokens or cfg.chunk_tokens
        sent = self._md_holds(req)
        while True:
            generated = await self.worker.call(lambda e: e.generated(req.id))
            if generated is None:
                return None
            if len(generated) - sent <= cfg.final_tokens:
                return sent
            chunk = HandoffChunk(req.id, sent, generated[sent : sent + chunk_tokens])
            if not await self._send(req, chunk):
                return None
            sent += len(chunk.token_ids)

    @staticmethod
    def _md_holds(req: DecodeRequest) -> int:
        """Output tokens main-decode's shadow holds before any chunk: prefill's first token, which
        travelled with the KV; none for a migrated attempt, whose next token is sampled here."""
        return 0 if req.task.sampling.resumed else 1

    async def _final(self, req: DecodeRequest, sent: int) -> None:
        if self._overlaps(req):
            return await self._final_overlapped(req, sent)
        t0 = time.perf_counter()
        seq = await self.worker.call(lambda e: e.abort(req.id))  # stop decoding; frees the blocks
        self.room_freed()  # KV parked for want of blocks may fit now
        if seq is None:
            return  # it finished here first
        stats = copy.copy(req.stats)
        stats.handoff_stop_ms = (time.perf_counter() - t0) * 1000
        generated = seq.token_ids[seq.prompt_len :]
        if await self._send(req, HandoffChunk(req.id, sent, generated[sent:], final=True, stats=stats)):
            self.end(req.id, End.HANDED_OFF)
            return
        log.warning("%s: final handoff of %s failed; finishing it on relay", self.inst.id, req.id)
        req.phase = Phase.RUNNING
        again = Sequence(req.id, list(seq.token_ids), seq.params, prompt_len=seq.prompt_len)
        await self.worker.call(lambda e: e.add(again))

    def _overlaps(self, req: DecodeRequest) -> bool:
        """Whether main-decode's next tokens are the relay's, bit for bit: the request's tokens
        are a function of its ids (greedy, or seeded per step), and both decoders run the
        batch-invariant kernels in one precision. Then the relay may keep streaming while its
        final chunk crosses: the gateway keeps one copy of each index."""
        sampling = req.task.sampling
        md = next((i for i in self.cfg.instances if i.id == req.task.plan.md), None)
        deterministic = sampling.greedy or sampling.seed is not None
        same_kernels = self.worker.engine.runner.invariant and md is not None and md.dtype == self.inst.dtype
        return deterministic and same_kernels

    async def _final_overlapped(self, req: DecodeRequest, sent: int) -> None:
        """The final chunk holds the tokens so far; the relay keeps decoding and streaming while
        it crosses and main-decode extends it, and stops once main-decode acked: main-decode's
        first token is then about one step behind the relay's last, not a round trip."""
        t0 = time.perf_counter()
        generated = await self.worker.call(lambda e: _generated(e.find(req.id)))  # running, or not yet stepped
        if generated is None:
            return  # it finished here first
        stats = copy.copy(req.stats)
        stats.handoff_stop_ms = (time.perf_counter() - t0) * 1000
        taken = await self._send(req, HandoffChunk(req.id, sent, generated[sent:], final=True, stats=stats))
        if not taken:
            log.warning("%s: final handoff of %s failed; finishing it on relay", self.inst.id, req.id)
            req.phase = Phase.RUNNING  # it never stopped decoding here
            return
        await self.worker.call(lambda e: e.abort(req.id))  # main-decode streams from here
        self.room_freed()
        self.end(req.id, End.HANDED_OFF)

    async def _send(self, req: DecodeRequest, chunk: HandoffChunk) -> bool:
        subject = subjects.handoff_chunk(req.task.plan.md)
        deadline = time.monotonic() + self.cfg.handoff.ack_timeout_s
        wait = max(HANDOFF_RESEND_S, 8 * self.cfg.wan.delay_ms / 1000)  # a few round trips of the line
        while True:
            sent = time.monotonic()
            left = deadline - sent
            try:
                if failpoints.hit("rld.handoff_chunk"):  # lost on purpose: as if no ack came in time
                    await asyncio.sleep(min(wait, max(left, 0)))
                    raise BusTimeout("handoff chunk lost (failpoint)")
                ack = await self.bus.request(subject, chunk, Ack, min(wait, max(left, 0.001)))
                break
            except BusTimeout as e:
                if time.monotonic() >= deadline:
                    log.warning("%s: handoff chunk for %s got no ack: %s", self.inst.id, chunk.request_id, e)
                    return False
                # "no responders" comes back at once (main-decode restarting): resend after the
                # wait, not in a tight loop of requests until the deadline
                await asyncio.sleep(max(0.0, min(sent + wait, deadline) - time.monotonic()))
                log.info("%s: handoff chunk for %s got no ack yet; sending it again", self.inst.id, req.id)
                wait = min(wait * 2, self.cfg.handoff.ack_timeout_s)
        if not ack.ok:
            log.warning("%s: main-decode refused a handoff chunk of %s: %s", self.inst.id, req.id, ack.error)
        return ack.ok


def _generated(seq: Sequence | None) -> list[int] | None:
    """On the engine thread: the tokens a sequence generated so far (a copy), None without one."""
    return None if seq is None else seq.token_ids[seq.prompt_len :]


def main(argv: list[str] | None = None) -> None:
    service_main(RelayDecoder, ROLE, argv)
