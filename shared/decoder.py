"""DecoderService: what relay-decode (rld) and main-decode (md) both run.

Each role's own part is a subclass in its service (`RelayDecoder` in services/rld/service.py,
`MainDecoder` in services/md/service.py), filling in the hooks at the end of this class.

Lifecycle of a request on a decoder: one `DecodeRequest` in `requests`; its `phase` says where.
1. PENDING: the scheduler's `DecodeTask` is remembered (with a deadline) and acked. A duplicate
   is acked again; a task for an aborted request, or past the stage's capacity, is refused.
2. PARKED: its KV arrived on this instance's TCP listener (from prefill, in-DC or across the
   WAN) and waits in host memory for pool room, oldest first.
3. RUNNING: blocks allocated, KV imported (dtype converted), the sequence joined the batch; the
   sender gets its ACK and prefill's first token goes out as index 0. On md a `p-rld-md`
   request runs as a SHADOW instead: it computes the relay's tokens and streams nothing.
4. Each engine step's tokens are published on `pdd.tokens.<request>` in order, and kept: a
   gateway that lost a chunk (a leaf reconnect, a NATS restart) asks for them again by index
   (`Resend`), during the request and for `REPLAY_S` after it ended. The relay -> main handoff
   (HANDING_OFF on the relay) is the two roles' own part (their services).
5. The request ends one way (`End`): FINISHED (the final chunk carries finish_reason and
   stats), HANDED_OFF (relay: main-decode took it), ABORTED (broadcast), DROPPED (only this
   copy: its KV push failed, or the plan changed), FAILED (its KV never came, or could not be
   admitted). Ending removes it from `requests`, cancels every task it owns and frees its
   blocks: nothing of a request outlives it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections import deque

from shared import failpoints, subjects
from shared.decode_state import DecodeRequest, End, Phase
from shared.instance import InstanceFigures, InstanceService
from shared.kv_receive import KVReceiver, Verdict
from shared.kv_transport import Transfer
from shared.messages import Abort, Ack, DecodeTask, Drop, Resend, Resent, TokenChunk, WanSample
from shared.prefix_hash import namespace_of
from shared.recent import RecentIds
from shared.runtime.engine import TokenOutput
from shared.runtime.kv_payload import payload_from_parts, valid_start
from shared.runtime.sequence import FinishReason, Sequence
from shared.security import Secrets

log = logging.getLogger(__name__)
PUBLISH_ATTEMPTS = 4  # a token chunk's publish is tried this many times (0.1, 0.2, 0.4 s apart)
PUBLISH_RETRY_S = 0.1
REPLAY_S = 120.0  # a finished request's tokens can be sent again for this long (`Resend`)
REPLAY_REQUESTS = 4096  # ... for at most this many finished requests


class DecoderService(InstanceService):
    def __init__(self, cfg, inst) -> None:
        super().__init__(cfg, inst)
        self.requests: dict[str, DecodeRequest] = {}
        self.aborted = RecentIds()  # a task arriving after its abort is refused
        self.replays = RecentIds(REPLAY_REQUESTS, REPLAY_S)  # finished requests' `Replay`s
        self.receiver: KVReceiver | None = None
        self.parked: deque[str] = deque()  # requests whose KV waits for pool room, in arrival order
        self._out: asyncio.Queue[tuple[str, TokenChunk]] = asyncio.Queue()  # (its stream's subject, chunk)
        self._admitting = asyncio.Lock()
        self._room = asyncio.Event()  # set when blocks may have been freed
        # request id -> set when its task (or its abort) came: prefill is dispatched beside the
        # decoders, so its push may come first, and waits for the task (`vet`)
        self._awaited: dict[str, asyncio.Event] = {}

    async def serve(self) -> None:
        self.layout = self.worker.engine.pool.layout  # immutable: the KV layout transfers must match
        secrets = Secrets.of(self.cfg)
        tls = secrets.kv_server_context(self.inst.id) if secrets else None  # mutual TLS on the KV plane
        self.receiver = KVReceiver(self.on_transfer, self.cfg.timeouts.kv_stall_s, vet=self.vet, tls=tls)
        port = await self.receiver.start(self.cfg.host, self.inst.kv_port)
        self.info.kv_host, self.info.kv_port = self.cfg.kv_endpoint(dataclasses.replace(self.inst, kv_port=port))
        await self.bus.serve(subjects.decode_task(self.inst.id), DecodeTask, self.on_task)
        await self.bus.serve(subjects.decode_drop(self.inst.id), Drop, self.on_drop)
        await self.bus.serve(subjects.decode_resend(self.inst.id), Resend, self.on_resend)
        await self.serve_role()
        self.spawn(self._publisher())
        self.spawn(self._watchdog())
        self.spawn(self._unparker())

    async def shutdown(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
        await super().shutdown()

    def held_requests(self) -> list[str]:
        return sorted(self.requests)

    def state_sizes(self) -> dict[str, int]:
        receiving = len(self.receiver._receiving) if self.receiver else 0
        return {
            "requests": len(self.requests),
            "parked": len(self.parked),
            "receiving": receiving,
            "remembered_aborts": len(self.aborted),
            "replays": len(self.replays),
            # requests this decoder is streaming to a client now (not a shadow, not cache-only)
            "streaming": sum(r.phase is Phase.RUNNING and not r.cache_only for r in self.requests.values()),
        }

    def holding_since(self, older_than_s: float) -> dict[str, float]:
        now = time.monotonic()
        return {rid: now - r.accepted_at for rid, r in self.requests.items() if now - r.accepted_at > older_than_s}

    def figures(self) -> InstanceFigures:
        """With `pending` (tasks accepted whose KV has not landed: the scheduler's relay admission
        control counts them) and the relay's handoffs under way."""
        pending = sum(r.phase <= Phase.PARKED for r in self.requests.values())
        handing = sum(r.phase == Phase.HANDING_OFF for r in self.requests.values())
        return dataclasses.replace(super().figures(), pending=pending, handing=handing)

    # -- a request's tasks and its end ------------------------------------------------------
    def spawn_for(self, req: DecodeRequest, coro) -> asyncio.Task:
        task = self.spawn(coro)
        req.tasks.add(task)
        task.add_done_callback(req.tasks.discard)
        return task

    def end(self, rid: str, how: End) -> DecodeRequest | None:
        """The one way out of `requests`. The caller frees the engine's sequence if it has one."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req.phase == Phase.PARKED and rid in self.parked:
            self.parked.remove(rid)
        me = asyncio.current_task()
        for task in list(req.tasks):
            if task is not me:
                task.cancel()
        req.caught_up.set()  # a handoff chunk waiting for the shadow wakes and sees it gone
        if req.replay.start >= 0 or req.replay.final is not None:
            self.replays.add(rid, req.replay)  # a chunk the gateway lost can still be sent again
        log.info("%s: %s ended: %s (%s)", self.inst.id, rid, how.name, req.phase.name.lower())
        return req

    async def abort_engine(self, rid: str) -> None:
        await self.worker.call(lambda e: e.abort(rid))
        self.room_freed()

    def room_freed(self) -> None:
        """Blocks were freed outside a step: parked KV may fit now."""
        self._room.set()

    # -- 1. task ----------------------------------------------------------------------------
    async def on_task(self, task: DecodeTask) -> Ack | None:
        if failpoints.hit("decoder.task"):  # not taken, not answered: as if this decoder had just died
            return None
        try:
            return self._take(task)
        finally:
            self._came(task.request_id)

    def _came(self, rid: str) -> None:
        """The request's task (or abort) is in: a push waiting for it goes on."""
        if (came := self._awaited.pop(rid, None)) is not None:
            came.set()

    def _take(self, task: DecodeTask) -> Ack:
        rid = task.request_id
        if rid in self.aborted:
            return Ack(rid, ok=False, error="request was aborted")
        if problem := self.task_problem(task.prompt_ids, task.sampling) or _start_problem(task, self.cfg.block_size):
            return Ack(rid, ok=False, error=f"{self.inst.id} refused the task: {problem}")
        held = self.requests.get(rid)
        if held is not None and held.task.transfer_secret != task.transfer_secret and held.phase == Phase.PENDING:
            # the request was planned again and this task came before the earlier copy's drop
            # (two subjects: nothing orders them): the new copy replaces it, and the drop, naming
            # the earlier copy's secret, will find nothing of its own to drop
            self.receiver.cancel(rid)
            self.end(rid, End.DROPPED)
            held = None
        if held is None:
            if (full := self.refuse_if_full(rid)) is not None:
                return full
            self.requests[rid] = DecodeRequest(task, time.monotonic())
        return Ack(rid)

    # -- 2. KV arrives ----------------------------------------------------------------------
    async def vet(self, t: Transfer) -> tuple[Verdict, str]:
        """Before a byte of KV is read: is this the transfer the scheduler told us to expect? A push
        may overtake its task (both were sent at once): it waits for the task, as long as the
        scheduler waits for this decoder's ack. What needs no task is checked first: a header
        that could fit no task here is refused at once, not held."""
        kv, layout = t.head.kv, self.layout
        if (kv.num_layers, kv.kv_heads, kv.head_dim) != (layout.num_layers, layout.kv_heads, layout.head_dim):
            return Verdict.REFUSE, f"KV header of {t.request_id} does not fit this model's layout: {kv}"
        if t.request_id not in self.requests and t.request_id not in self.aborted:
            came = self._awaited.setdefault(t.request_id, asyncio.Event())
            try:
                await asyncio.wait_for(came.wait(), self.cfg.timeouts.control_s)
            except TimeoutError:
                if self._awaited.get(t.request_id) is came:
                    del self._awaited[t.request_id]
        req = self.requests.get(t.request_id)
        if req is None:
            return Verdict.REFUSE, f"no decode task for {t.request_id!r} here (aborted?)"
        secret = req.task.transfer_secret
        if not secret or not hmac.compare_digest(t.head.secret, secret):
            return Verdict.REFUSE, f"wrong transfer secret for {t.request_id}"
        if req.phase != Phase.PENDING:  # a retried push whose first attempt landed after all
            return Verdict.HAVE_IT, ""
        kv, layout = t.head.kv, self.layout
        planned = (req.task.kv_start, len(req.task.prompt_ids), layout.num_layers, layout.kv_heads, layout.head_dim)
        if (kv.start, kv.end, kv.num_layers, kv.kv_heads, kv.head_dim) != planned:
            return Verdict.REFUSE, f"KV header of {t.request_id} differs from its task: {kv}, planned {planned}"
        return Verdict.RECEIVE, ""

    async def on_transfer(self, t: Transfer) -> str:
        req = self.requests.get(t.request_id)
        if req is None:
            return f"{self.inst.id} has no decode task for {t.request_id}"
        if req.phase != Phase.PENDING:  # a retried push whose first attempt landed after all
            return ""
        first = t.first.token_id
        if not 0 <= first < self.vocab_size:
            return f"first token {first!r} is not in the vocabulary"
        header = t.head.kv
        parts = [(p.start, p.end, p.layers) for p in t.parts]
        payload = await asyncio.to_thread(payload_from_parts, header, parts)
        if self.requests.get(t.request_id) is not req or req.phase != Phase.PENDING:
            return ""  # aborted (or a duplicate landed) while the bytes were converted
        req.stats.merge(t.first.stats)
        if t.via_wan:
            req.stats.wan_kv_bytes, req.stats.kv_wan_ms = t.wire_bytes, t.elapsed_ms
            if header.num_tokens:  # no KV (this decoder computes the suffix): no measure of the line
                sample = WanSample(t.wire_bytes, t.elapsed_ms / 1000, req.id)
                self.spawn(self.bus.publish(subjects.wan_sample(self.inst.id), sample))
        else:
            req.stats.local_kv_bytes, req.stats.kv_local_ms = t.wire_bytes, t.elapsed_ms
        task = req.task
        # a migrated attempt's next token is sampled here, after its earlier output is computed
        # here (the engine's `admit_with_kv`): prefill's would be of another precision
        seq = Sequence(
            req.id,
            list(task.prompt_ids) + ([] if task.sampling.resumed else [first]),
            task.sampling,
            namespace=namespace_of(self.cfg.model, task.cache_salt),
        )
        seq.prompt_len = len(task.prompt_ids)
        seq.shadow = self.shadows(task)
        req.parked, req.phase = (seq, payload, t.first), Phase.PARKED
        self.parked.append(req.id)
        await self._admit_parked()
        return req.error  # "" = committed: running, or parked until the pool has room

    async def _admit_parked(self) -> None:
        """Import parked KV and join the batch, oldest first, while the pool has room.

        Admission reserves a request's whole budget. When running requests hold the pool, the
        KV that landed waits here in host memory (bounded: at most `max_waiting` requests beyond
        `max_running` are accepted) and is admitted as they finish, instead of failing.
        """
        async with self._admitting:
            while self.parked:
                # all of them in one call, at one step boundary: a transfer is ACKed after this, and
                # one call per request made the last of many wait that many steps (a soak with a
                # main-decode killed parked enough on the other for prefill to give the ACK up)
                batch = [self.requests[rid] for rid in self.parked]  # `end` removes ended requests
                work = [req.parked[:2] for req in batch]
                results = await self.worker.call(lambda e, w=work: e.admit_with_kv(w))
                for req, (done, error) in zip(batch, results):
                    if self.requests.get(req.id) is not req:
                        continue  # ended meanwhile; its abort frees what the admission took
                    await self._joined(req, done, error)
                if len(results) < len(batch):
                    return  # the pool is full: the rest are retried when a running request frees its blocks

    async def _joined(self, req: DecodeRequest, done: str | None, error: str) -> None:
        """A parked request's admission is through: it runs (or shadows), or fails if it cannot."""
        seq, _, first = req.parked
        self.parked.remove(req.id)
        req.parked = None
        if error:  # cannot ever fit, bad KV...: the request fails, nothing is held
            req.error = f"{self.inst.id}: {error}"
            self.emit(TokenOutput(req.id, None, 0, FinishReason.ERROR, req.error))
            return
        self._admitted(req, seq)
        if req.cache_only:  # finished on the relay: freeing the sequence caches its prompt blocks
            self.end(req.id, End.ABORTED)
            await self.abort_engine(req.id)
            return
        if not seq.shadow and not seq.params.resumed:
            self.emit(TokenOutput(req.id, first.token_id, 0, done, logprob=first.logprob))
        if req.id in self.requests:
            await self.on_admitted(req, done)

    def _admitted(self, req: DecodeRequest, seq: Sequence) -> None:
        req.phase = Phase.SHADOW if seq.shadow else Phase.RUNNING
        self.count_hit(req, seq.cached_tokens)
        if seq.imported is not None:
            req.stats.recomputed_tokens = seq.imported[0] - seq.num_computed
            log.info(
                "%s: %s: prefix evicted since the plan; recomputing %d tokens",
                self.inst.id,
                seq.seq_id,
                req.stats.recomputed_tokens,
            )

    async def _unparker(self) -> None:
        while True:
            await self._room.wait()
            self._room.clear()
            await self._admit_parked()

    # -- 3./4. tokens out -------------------------------------------------------------------
    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        if self.parked and any(out.finish_reason is not None for out in outputs):
            self._room.set()
        for out in outputs:
            req = self.requests.get(out.seq_id)
            if req is None:
                continue
            if out.caught_up:
                req.caught_up.set()
            else:
                self.emit(out)

    def emit(self, out: TokenOutput) -> None:
        req = self.requests.get(out.seq_id)
        chunk = TokenChunk(
            out.seq_id,
            out.index,
            [] if out.token_id is None else [out.token_id],
            role=self.role,
            instance_id=self.inst.id,
            finish_reason=out.finish_reason,
            error=out.error or "",
            logprobs=None if out.logprob is None else [out.logprob],
        )
        if req is not None:
            self.on_emit(req, out)
        if out.finish_reason is not None:
            chunk.stats = req.stats if req else None
        if req is not None:
            req.replay.record(chunk)
        if out.finish_reason is not None:
            self.end(out.seq_id, End.FINISHED if out.error is None else End.FAILED)
        self._out.put_nowait((self._stream(req, out.seq_id), chunk))

    @staticmethod
    def _stream(req: DecodeRequest | None, request_id: str) -> str:
        """The request's token stream: under its plan's key, which only the planned stages hold."""
        return subjects.tokens(request_id, req.task.plan.stream_key if req is not None else "")

    async def on_resend(self, msg: Resend) -> Resent:
        """The gateway lost a chunk: everything sent from its index on, again (in one chunk)."""
        req = self.requests.get(msg.request_id)
        replay = req.replay if req is not None else self.replays.get(msg.request_id)
        if replay is None:
            return Resent(held=False)
        return Resent(held=True, chunk=replay.since(msg.request_id, msg.index, self.role, self.inst.id))

    async def _publisher(self) -> None:
        """Every chunk in order, whatever fails on the way: an index report that cannot go (a
        full report over the bus's payload limit, say) is logged and left to the index loop, and
        a publish that fails is tried again, then logged; the loop itself never ends."""
        while True:
            subject, chunk = await self._out.get()
            if chunk.finish_reason is not None:
                try:
                    await self.report_index()  # the next turn's plan must see this turn cached
                except Exception as e:
                    log.warning("%s: index report before %s's last chunk failed: %s", self.inst.id, chunk.request_id, e)
            await self._publish_chunk(subject, chunk)

    async def _publish_chunk(self, subject: str, chunk: TokenChunk) -> None:
        last = chunk.finish_reason is not None or bool(chunk.error)
        if failpoints.hit("decoder.final_chunk" if last else "decoder.token_chunk"):
            return  # lost on purpose (tests, the chaos bench): the gateway asks for it again
        for attempt in range(PUBLISH_ATTEMPTS):
            try:
                await self.bus.publish(subject, chunk)
                return
            except Exception as e:  # a reconnecting or closed connection: the next try may go
                if attempt + 1 == PUBLISH_ATTEMPTS:
                    log.error("%s: %s: token %d not sent: %s", self.inst.id, chunk.request_id, chunk.index, e)
                    return
                await asyncio.sleep(PUBLISH_RETRY_S * 2**attempt)

    # -- 5. abort, drop and deadlines -------------------------------------------------------
    async def forget(self, request_ids: list[str]) -> None:
        """Never silently: a gateway that still waits (the record was lost, not the request)
        gets an error blaming this copy, and moves the request."""
        for rid in request_ids:
            if (req := self.requests.get(rid)) is not None:
                error, me = f"{self.inst.id}: {rid} is no longer recorded as in flight; dropped", self.inst.id
                chunk = TokenChunk(rid, 0, [], role=self.role, instance_id=me, error=error, blame=me)
                req.replay.record(chunk)
                self._out.put_nowait((self._stream(req, rid), chunk))
        await super().forget(request_ids)

    async def on_abort(self, msg: Abort) -> None:
        req = self.requests.get(msg.request_id)
        if msg.keep_kv and req is not None and self.keeps_kv(req):
            req.cache_only = True  # its KV lands into the prefix cache, then it ends (`_admit_parked`)
            return
        self.aborted.add(msg.request_id)
        self._came(msg.request_id)
        self.receiver.cancel(msg.request_id)  # its KV may be mid-way across the WAN: stop carrying it
        if self.end(msg.request_id, End.ABORTED) is not None:
            await self.abort_engine(msg.request_id)

    async def on_drop(self, msg: Drop) -> None:
        """Only this decoder's copy is abandoned (its KV push failed, or the scheduler re-planned),
        unless it runs: its KV did land (only the push's ACK was late) and, on main-decode after
        the handoff, it is the one copy the user's stream comes from."""
        req = self.requests.get(msg.request_id)
        if req is not None and msg.transfer_secret and msg.transfer_secret != req.task.transfer_secret:
            log.info("%s: %s: the drop is for an earlier plan's copy; kept (%s)", self.inst.id, req.id, msg.reason)
            return
        if req is not None and req.phase == Phase.RUNNING:
            log.warning("%s: %s runs here; not dropped (%s)", self.inst.id, req.id, msg.reason)
            return
        self.receiver.cancel(msg.request_id)
        if self.end(msg.request_id, End.DROPPED) is not None:
            await self.abort_engine(msg.request_id)

    async def _watchdog(self) -> None:
        # A backstop for a KV that never comes (prefill died before pushing). Prefill may queue
        # and prefill long prompts first, so only the request deadline applies here; a transfer
        # that starts and stalls is caught by the KV plane's own stall timeout.
        while True:
            await asyncio.sleep(1.0)
            if self.parked:  # blocks also free outside steps (a relay letting go after its handoff)
                self._room.set()
            self.expire_pending(time.monotonic())

    def expire_pending(self, now: float) -> None:
        limit = self.cfg.timeouts.request_s
        for req in list(self.requests.values()):
            if req.phase == Phase.PENDING and now - req.accepted_at > limit:
                error = f"KV did not arrive within {limit:.0f}s"
                if not self.kv_never_came(req):
                    self.emit(TokenOutput(req.id, None, 0, FinishReason.ERROR, error))

    # -- what each role fills in (services/rld/service.py, services/md/service.py) ------------
    async def serve_role(self) -> None:
        """Subscribe the role's own subjects (its side of the handoff)."""

    def shadows(self, task: DecodeTask) -> bool:
        """Whether the request runs here as a shadow (computes KV, samples nothing)."""
        return False

    async def on_admitted(self, req: DecodeRequest, done: str | None) -> None:
        """The request joined the batch (`done`: prefill's first token already ended it)."""

    def on_emit(self, req: DecodeRequest, out: TokenOutput) -> None:
        """A token (or the end) of the request is going out."""

    def kv_never_came(self, req: DecodeRequest) -> bool:
        """Its KV missed the deadline: True when the role dealt with that, else it fails."""
        return False

    def keeps_kv(self, req: DecodeRequest) -> bool:
        """On an abort that keeps KV (finished on the relay): let the KV land into the cache."""
        return False

    def count_hit(self, req: DecodeRequest, tokens: int) -> None:
        """Record the prefix-cache hit of an admitted request, in this role's own field."""


def _start_problem(task: DecodeTask, block_size: int) -> str:
    start = task.kv_start
    if not valid_start(start, len(task.prompt_ids), block_size):
        return f"kv_start {start} is neither a block boundary inside the prompt nor its end"
    return ""
