"""What happens to a planned request: prefill, KV on two paths, decoding, the RLD -> MD handoff.

Lifecycle (`Serving.start` on a `Decision` from the scheduler's `choose_plan`):
1. Prefill on the chosen instance (its prefix cache first), first token sampled and (as the
   real `first_token: prefill`; not in the naive pd-wan baselines) streamed to the client at once.
2. KV leaves on every path at once, each decoder getting only what it lacks (its prefix hit):
   in-DC to RLD or to a same-DC decoder (`DirectLink`), across the WAN to MD in datacenter B
   (`SharedLink`, shared with every other transfer). Export + import cost (`kv_io_ms`, plus
   a fresh decoder process's `cold_start_ms`) is added on landing. Finished WAN transfers
   feed the bandwidth estimator the policy reads.
3. `p-md`: MD admits the request and streams it to the end. `p-rld`: RLD does.
4. `p-rld-md`: RLD admits and streams at once; MD admits its copy as a shadow and tells RLD
   (`KVReady`, a control message that pays the WAN delay). Then, token ids only:
   - one-shot: RLD stops after its current step and sends every token as the final chunk;
   - catch-up: while RLD's backlog is over `final_tokens`, it sends up to `chunk_tokens`, MD
     extends them inside its next step and acks; then RLD stops and sends the rest.
   The final chunk turns MD's shadow live: its next step extends the chunk and samples the
   next token. If RLD streams every token before the handoff, MD's copy of the request ends
   (the relay's abort). With `warm_md_cache` (the real `handoff.warm_md_cache`, on by default)
   MD's KV is not wasted: a KV still crossing the WAN keeps crossing (its bytes count, the line's
   backlog keeps it until it lands) and on landing its prompt blocks enter MD's DRC only, as a
   finished request's would, so the session's next turn hits them there; a copy that had landed
   is dropped and its prompt blocks kept the same way. Without it (the behaviour before commit
   009d61a) the copy is dropped and a KV still crossing is cancelled (the rest of its bytes never
   cross).
5. Finish: the finishing decoder's DRC keeps prompt plus answer (`done_blocks`); `on_finish`.

Control messages between the sites cross the line (`control_delay_ms`, the real NATS leafnode
since commit 0dac70d): prefill starts as the plan is made (the scheduler sends every stage its
task at once), but a plan with a decoder in the other datacenter reaches the gateway only after
that decoder's ack came back through the line, a round trip, and the gateway streams nothing
before it has the plan (`RequestRun.planned_ms`). Each token of a decoder there reaches the
client one delay later (`DecodeInstance.to_client_ms`). A KV
push across opens a fresh connection (TCP, then TLS 1.3): `connect_ms` of round trips before its
KV is usable, added on landing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.estimates import BandwidthEstimator
from services.scheduler.inputs import WanBacklog
from services.scheduler.policy import Decision
from shared.pipelines import ROLES_OF, Handoff, Pipeline, Role, decoders_of, hands_off
from sim.decoder import DecodeInstance, Slot
from sim.events import EventLoop
from sim.link import DirectLink, SharedLink
from sim.prefill import PrefillInstance
from sim.request import RequestRun, RunState


@dataclass
class Relayed:
    """One p-rld-md request's relay state: which slots, and how far MD has been brought."""

    rld: DecodeInstance
    md: DecodeInstance
    rld_slot: Slot | None = None
    md_slot: Slot | None = None
    handed: int = 0  # tokens MD has been sent
    started: bool = False
    wan_flow: int | None = None  # MD's KV on the line (cancelled if the relay finishes first, unless warming)


@dataclass
class Serving:
    loop: EventLoop
    instances: dict[str, PrefillInstance | DecodeInstance]
    wan: SharedLink
    local: DirectLink
    estimator: BandwidthEstimator
    kv_bytes_per_token: int
    chunk_tokens: int
    final_tokens: int
    on_finish: Callable[[RequestRun], None]
    warm_md_cache: bool = True  # relay finished first: MD's KV still lands, into its DRC only (handoff.warm_md_cache)
    control_delay_ms: float = 0.0  # one-way, for a control message between the sites
    connect_ms: float = 0.0  # a KV push across opens its connection first (TCP + TLS handshakes)
    first_token_from_prefill: bool = True  # prefill streams the first token (the real first_token: prefill)
    handoffs: dict[str, Relayed] = field(default_factory=dict)
    backlog: WanBacklog = field(default_factory=WanBacklog)  # KV planned across the WAN, not landed or cancelled

    def start(self, run: RequestRun, d: Decision) -> None:
        run.pipeline, run.handoff, run.reason, run.handoff_reason = d.pipeline, d.handoff, d.reason, d.handoff_reason
        run.instances = {role: getattr(d, role) for role in ROLES_OF[d.pipeline]}
        run.estimates = d.estimates.as_dict()
        run.hit[Role.MD] = d.md_cached_tokens
        for role in decoders_of(d.pipeline):
            self.instances[getattr(d, role)].pending += 1
        prefill_dc = self.instances[d.prefill].dc
        if d.md and self.instances[d.md].dc != prefill_dc:  # as the scheduler does
            owed = (run.req.prompt_len - d.starts.get(Role.MD, 0)) * self.kv_bytes_per_token
            self.backlog.add(run.req.request_id, owed, self.loop.now / 1000.0)
        if hands_off(d.pipeline):
            chunk = d.chunk_tokens or self.chunk_tokens
            self.handoffs[run.req.request_id] = Relayed(self.instances[d.rld], self.instances[d.md])
            run.marks["chunk"] = chunk
        prefill = self.instances[d.prefill]
        across = any(self.instances[getattr(d, role)].dc != prefill.dc for role in decoders_of(d.pipeline))
        # every stage's task at once: prefill starts now; the plan reaches the gateway once the
        # other site's decoder acked (a round trip through the line)
        run.planned_ms = self.loop.now + (2 * self.control_delay_ms if across else 0.0)
        prefill.submit(run, lambda r: self._prefilled(r, d))

    # -- 2. KV on every path ----------------------------------------------------------------
    def _prefilled(self, run: RequestRun, d: Decision) -> None:
        run.state = RunState.KV_IN_FLIGHT
        if self.first_token_from_prefill and run.emitted == 0:  # through site A's NATS: no line
            run.emit(self.loop.now, Role.PREFILL)
        prefill = self.instances[d.prefill]
        for role in decoders_of(d.pipeline):
            self._push(run, prefill, self.instances[getattr(d, role)], d.starts.get(role, 0))

    def _push(self, run: RequestRun, prefill: PrefillInstance, dec: DecodeInstance, start: int) -> None:
        tokens = run.req.prompt_len - start
        nbytes = tokens * self.kv_bytes_per_token
        across = dec.dc != prefill.dc
        link = self.wan if across else self.local
        if across:
            run.wan_bytes += nbytes
        else:
            run.local_bytes += nbytes
        io_ms = dec.import_ms(tokens)  # export + import (+ a fresh decoder's warm-up), on landing

        def landed(at_ms: float, seconds: float) -> None:
            if across:  # the receiver times first byte -> last (kv_transport `Transfer.elapsed_ms`): no delay
                self.estimator.add(nbytes, seconds - self.wan.delay_ms / 1000.0, at_ms / 1000.0)
                self._settle(run)
            # the connection's set-up is added on landing: its bytes are not held back on the line
            self.loop.after(
                io_ms + (self.connect_ms if across else 0.0), self._landed, run, dec, "kv_wan" if across else "kv_local"
            )

        flow = link.send(nbytes, landed)
        h = self.handoffs.get(run.req.request_id)
        if across and h is not None and dec is h.md:
            h.wan_flow = flow

    def _settle(self, run: RequestRun) -> None:  # the scheduler's WanSample (landed) or abort (cancelled)
        self.backlog.settle(run.req.request_id)

    def _landed(self, run: RequestRun, dec: DecodeInstance, path: str) -> None:
        run.marks[path] = self.loop.now
        dec.pending -= 1
        if run.state == RunState.FINISHED:  # the relay already streamed every token
            if self.warm_md_cache and dec.role == Role.MD:  # MD's push kept crossing: its prompt warms MD's DRC
                run.marks["md_cache_warmed"] = self.loop.now
                dec.cache.insert(run.req.blocks)
            return
        h = self.handoffs.get(run.req.request_id)
        if h is None:  # p-md or p-rld: this decoder streams to the end
            dec.admit(Slot(run, run.req.prompt_len, on_finish=self._finished))
        elif dec is h.rld:
            if h.started:  # MD was ready first and took the whole request
                return
            run.state = RunState.DECODING_RLD
            h.rld_slot = Slot(run, run.req.prompt_len, on_finish=self._finished, on_stop=self._rld_stopped)
            dec.admit(h.rld_slot)
        else:
            h.md_slot = Slot(
                run, run.req.prompt_len, emit=False, on_finish=self._finished, on_extended=self._chunk_extended
            )
            dec.admit(h.md_slot)
            self.wan.send(0, lambda at, s: self._md_ready(run))  # KVReady crosses to RLD

    # -- 4. the handoff -----------------------------------------------------------------------
    def _md_ready(self, run: RequestRun) -> None:
        h = self.handoffs[run.req.request_id]
        if run.state == RunState.FINISHED:
            h.md.drop(h.md_slot)
            return
        h.started = True
        run.state = RunState.HANDING_OFF
        if h.rld_slot is None:  # the relay never got going: MD takes the request whole
            self._send_final(run, h, 0)
        elif run.handoff == Handoff.CATCHUP:
            self._catchup_round(run, h)
        else:
            h.rld.request_stop(h.rld_slot)

    def _catchup_round(self, run: RequestRun, h: Relayed) -> None:
        if run.state == RunState.FINISHED:
            h.md.drop(h.md_slot)
            return
        backlog = run.emitted - h.handed
        if backlog <= self.final_tokens:
            h.rld.request_stop(h.rld_slot)
            return
        chunk = min(backlog, int(run.marks.get("chunk", self.chunk_tokens)))
        h.handed += chunk
        run.handoff_chunks += 1
        self.wan.send(0, lambda at, s: h.md.add_extend(h.md_slot, chunk, emit=False))

    def _chunk_extended(self, slot: Slot, t: float) -> None:
        run = slot.run
        self.wan.send(0, lambda at, s: self._catchup_round(run, self.handoffs[run.req.request_id]))  # the ack

    def _rld_stopped(self, slot: Slot, t: float) -> None:
        run = slot.run
        h = self.handoffs[run.req.request_id]
        h.rld.cache.insert(run.req.blocks)
        self._send_final(run, h, run.emitted - h.handed)

    def _send_final(self, run: RequestRun, h: Relayed, rest: int) -> None:
        h.handed += rest
        run.handoff_chunks += 1

        def final_at_md(at_ms: float, seconds: float) -> None:
            run.marks["final_chunk"] = at_ms
            run.state = RunState.DECODING_MD
            h.md.add_extend(h.md_slot, rest, emit=True)

        self.wan.send(0, final_at_md)

    # -- 5. finish ------------------------------------------------------------------------------
    def _finished(self, slot: Slot, t: float) -> None:
        run = slot.run
        if run.state == RunState.FINISHED:
            return
        run.state = RunState.FINISHED
        run.marks["finish"] = t
        on_md = run.pipeline == Pipeline.P_MD or run.tokens_by_role[Role.MD] > 0
        self.instances[run.instances[Role.MD if on_md else Role.RLD]].cache.insert(run.req.done_blocks)
        h = self.handoffs.get(run.req.request_id)
        if h is not None and not on_md:  # the relay streamed every token: MD's copy goes
            self._relay_finished(run, h, t)
        self.on_finish(run)

    def _relay_finished(self, run: RequestRun, h: Relayed, t: float) -> None:
        """MD's copy of a request the relay finished: with `warm_md_cache` its prompt stays in MD's DRC
        (a KV still on the line lands there, `_landed`); without, it is dropped and its KV cancelled."""
        if h.md_slot is not None:  # landed: a shadow, or waiting for room
            h.md.drop(h.md_slot)
            if self.warm_md_cache:
                run.marks["md_cache_warmed"] = t
                h.md.cache.insert(run.req.blocks)
        elif self.warm_md_cache:
            return  # still crossing (or about to be admitted): it lands into MD's DRC only
        elif (left := self.wan.cancel(h.wan_flow)) is not None:  # still crossing: stop it, as the real one did
            run.wan_bytes -= round(left)
            run.marks["kv_wan_cancelled"] = t
            h.md.pending -= 1
            self._settle(run)
