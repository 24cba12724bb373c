"""Prefill (datacenter A): compute the prompt's KV, sample the first token, push the KV out.

Lifecycle of a request here:
1. PrefillTask from the scheduler (idempotent by request id) -> acked, queued in the engine as
   a sequence that samples one token and keeps its blocks (`hold_kv`). The KV connection to a
   target across the WAN is readied now (`EarlyConnection`): a standing one from the idle pool
   when there is one, else dialed, its TCP and TLS handshakes overlapping the prefill instead of
   delaying the first KV byte.
2. The engine prefills it, chunked and batched with other prompts, and samples the first token,
   which goes to the gateway at once (index 0; `first_token: prefill`, the default).
3. On the engine thread, the KV each target lacks ([target.start, prompt_len)) is exported and
   the blocks are released at once: transfers never pin the pool.
4. The KV is pushed to every target concurrently (a relay-decoder in-DC, main-decode through
   the WAN link); neither path waits for the other. DONE carries the first token and the
   prefill timings. Each push runs on a standing connection to its decoder (`KVConnections`:
   taken idle, or dialed), which goes back to the pool once the decoder ACKed: the next push
   to that decoder pays no handshake.
5. A dropped or stalled push is retried (`kv_retries`). If main-decode's copy still cannot be
   delivered while the relay has its own, the relay is told to finish the request and
   main-decode to drop it: the user's stream goes on. Any other failure sends an error to the
   gateway, which ends the request or moves it off the decoder it blames (its abort frees every
   stage): the request fails clearly, never hangs. Abort drops the sequence and cancels its
   transfers.
6. Once a request ends, its prompt and answer may come back (`Warm`, services/prefill/warm.py):
   the answer's KV is computed into the prefix cache while nothing else runs here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.prefill.warm import AnswerWarmer
from shared import subjects
from shared.instance import InstanceService, service_main
from shared.kv_push import KVPush
from shared.kv_send import EarlyConnection, Endpoint, KVConnections
from shared.kv_transport import FirstToken, KVTransferError, TransferHead
from shared.messages import (
    Abort,
    Ack,
    Drop,
    FinishOnRelay,
    Inspect,
    InstanceState,
    KVTarget,
    Plan,
    PrefillTask,
    RequestStats,
    Sampling,
    TokenChunk,
    Warm,
)
from shared.pipelines import Role, hands_off
from shared.prefix_hash import namespace_of
from shared.recent import RecentIds
from shared.runtime.engine import TokenOutput
from shared.runtime.kv_exchange import NotHeld
from shared.runtime.kv_payload import KVHeader, KVPayload, layer_to_bytes, valid_start
from shared.runtime.sequence import Sequence
from shared.security import Secrets

log = logging.getLogger(__name__)

# KV connections across the WAN are readied when the task arrives (`EarlyConnection`: an idle one
# from the pool, else dialed, its TCP and TLS handshakes then overlapping the prefill). At most this
# many wait unused per decoder at once, well under the receiver's cap on connections per peer;
# later tasks take or dial one when their KV is ready.
EARLY_CONNECTIONS_PER_DECODER = 4


@dataclass(eq=False)
class PrefillState:
    task: PrefillTask
    accepted_at: float
    tasks: set[asyncio.Task] = field(default_factory=set)  # its push and transfers; cancelled on abort
    early: dict[str, EarlyConnection] = field(default_factory=dict)  # decoder id -> its connection
    # done once the engine took its sequence: an output before that is an earlier copy's (replaced)
    added: asyncio.Future | None = None
    pushes: dict[str, KVPush] = field(default_factory=dict)  # decoder id -> its push, once the first KV is out
    sending: dict[str, asyncio.Task] = field(default_factory=dict)  # decoder id -> its push's task, once under way
    feeding: asyncio.Lock = field(default_factory=asyncio.Lock)  # KV parts go into the pushes in order


class Prefiller(InstanceService):
    role = Role.PREFILL

    def __init__(self, cfg, inst) -> None:
        super().__init__(cfg, inst)
        self.requests: dict[str, PrefillState] = {}
        self.aborted = RecentIds()  # request ids aborted: a task arriving after its abort is refused
        self.seen = RecentIds()  # transfer secrets of copies taken or dropped: each copy is taken once
        self.warmer: AnswerWarmer | None = None
        self._tls = None
        self.kv_pool: KVConnections | None = None  # standing KV connections, per decoder
        self.kv_seconds = self.metrics.histogram(
            "pdd:kv_transfer_seconds", "KV pushes, KV ready to ACK, by path", labels=("path",)
        )
        self.early_connections = self.metrics.counter(
            "pdd:kv_early_connections",
            "KV connections readied (taken idle or dialed) as the task came, by outcome",
            ("outcome",),
        )
        self.kv_connections = self.metrics.counter(
            "pdd:kv_connections",
            "KV connections per decoder: dialed (a TCP + TLS handshake), reused (a standing one taken "
            "idle: no handshake), stale (a standing one found closed, or failed under a push, and dropped)",
            ("decoder", "how"),
        )
        self.kv_bytes = self.metrics.counter("pdd:kv_transfer_bytes", "KV bytes pushed, by path", ("path",))
        self.kv_failures = self.metrics.counter("pdd:kv_transfer_failures", "KV push attempts that failed", ("path",))
        self.answers_warmed = self.metrics.counter(
            "pdd:prefill_answers_warmed", "finished requests' answers computed into the prefix cache"
        )

    async def serve(self) -> None:
        secrets = Secrets.of(self.cfg)
        self._tls = secrets.kv_client_context(self.inst.id) if secrets else None  # mutual TLS on the KV plane
        self.kv_pool = KVConnections(
            self.cfg.timeouts.kv_stall_s,
            self._tls,
            count=lambda decoder, how: self.kv_connections.labels(decoder=decoder, how=how).inc(),
        )
        await self.bus.serve(subjects.prefill_task(self.inst.id), PrefillTask, self.on_task)
        # The scheduler took this instance for dead (no ack in time) and planned the request again
        # elsewhere under the same id: let go of it, and refuse its task if that comes later. Not the
        # broadcast abort, which would end the new plan too.
        await self.bus.serve(subjects.prefill_drop(self.inst.id), Drop, self.on_drop)
        self.warmer = AnswerWarmer(
            self.worker, lambda: bool(self.requests), self.cfg.model, on_warmed=self.answers_warmed.inc
        )
        self.spawn(self.warmer.run())
        await self.bus.serve(subjects.prefill_warm(self.inst.id), Warm, self.on_warm)

    async def shutdown(self) -> None:
        await super().shutdown()  # pushes under way are cancelled (their connections reset) first
        if self.kv_pool is not None:
            await self.kv_pool.close()

    def held_requests(self) -> list[str]:
        return sorted(self.requests)

    def computes_prompt(self) -> bool:
        return bool(self.requests)  # else the engine's work is warming an answer (nobody waits)

    def state_sizes(self) -> dict[str, int]:
        return {
            "requests": len(self.requests),
            "remembered_ids": len(self.aborted) + len(self.seen),
            "answers_to_warm": len(self.warmer.queue) if self.warmer else 0,
        }

    def holding_since(self, older_than_s: float) -> dict[str, float]:
        now = time.monotonic()
        return {rid: now - s.accepted_at for rid, s in self.requests.items() if now - s.accepted_at > older_than_s}

    # -- 1. task ------------------------------------------------------------------------
    async def on_task(self, task: PrefillTask) -> Ack:
        """A copy of a request is named by its targets' transfer secrets: the same copy delivered
        twice is acked once; a re-plan's copy (new secrets) that comes before the earlier copy's
        drop (two subjects: nothing orders them) replaces it, and the drop then finds nothing."""
        rid = task.request_id
        held = self.requests.get(rid)
        if held is not None and _secrets(held.task) == _secrets(task):
            return Ack(rid)
        if rid in self.aborted:
            return Ack(rid, ok=False, error="request was aborted")
        if any(secret in self.seen for secret in _secrets(task)):
            return Ack(rid, ok=False, error="this copy of the request was already taken or dropped")
        if problem := self.task_problem(task.prompt_ids, task.sampling) or _targets_problem(task, self.cfg.block_size):
            return Ack(rid, ok=False, error=f"{self.inst.id} refused the task: {problem}")
        if held is not None:  # its abort goes to the engine before this copy's add; the ack does not wait for it
            self._let_go(held)
        if (full := self.refuse_if_full(rid)) is not None:
            return full
        for secret in _secrets(task):
            self.seen.add(secret)
        self.requests[rid] = state = PrefillState(task, time.monotonic())
        self._dial_early(state)
        start = min(t.start for t in task.targets)
        seq = Sequence(
            rid,
            list(task.prompt_ids),
            task.sampling,
            hold_kv=True,
            max_new=1,
            namespace=namespace_of(self.cfg.model, task.cache_salt),
            export_from=start if self.cfg.stream_kv else None,
            layers_from=start if self._by_layer(task, start) else None,
        )
        # Acked now, not once the engine took it: the engine takes it at its next step boundary,
        # and a step may be a prefill chunk of seconds on a busy CPU; an ack behind it would
        # outlast the scheduler's control-plane timeout and look like a dead instance. An abort
        # of this request is queued after this command, so it finds the sequence.
        state.added = self.worker.submit(lambda e: e.add(seq))
        state.added.add_done_callback(lambda f: self._added(rid, f))
        return Ack(rid)

    def _by_layer(self, task: PrefillTask, start: int) -> bool:
        """Whether the prompt's KV left to push when its last chunk is computed goes layer by layer
        during that chunk's forward: where main-decode across the line makes the second token
        (`p-md`), for every prompt with `stream_kv`, else for one that pushes at most
        `stream_layers_max_tokens` (on a CPU the push takes prefill's cores: a short range costs
        little TTFT, a long one much; docs/kv-wire.md)."""
        if not self.cfg.stream_layers_max_tokens or not _next_token_waits_on_the_line(task):
            return False
        return self.cfg.stream_kv or len(task.prompt_ids) - start <= self.cfg.stream_layers_max_tokens

    def _dial_early(self, state: PrefillState) -> None:
        """Ready the WAN targets' KV connections now (idle ones, or dialed while the prompt waits and
        prefills)."""
        for t in state.task.targets:
            waiting = sum(
                1 for s in self.requests.values() if (e := s.early.get(t.instance_id)) is not None and not e.settled
            )
            if t.wan and waiting < EARLY_CONNECTIONS_PER_DECODER:
                stall_s = self.cfg.timeouts.kv_stall_s
                state.early[t.instance_id] = EarlyConnection(
                    t.host, t.port, stall_s, self._tls, t.instance_id, spawn=self.spawn, pool=self.kv_pool
                )

    def _settle_early(self, state: PrefillState) -> None:
        """Close what the request did not use and count each connection's outcome (once)."""
        for early in state.early.values():
            early.close()
            self.early_connections.labels(outcome=early.outcome or "unused").inc()
        state.early.clear()

    def _added(self, rid: str, done: asyncio.Future) -> None:
        if not done.cancelled() and (error := done.exception()) is not None and rid in self.requests:
            self.spawn(self._fail(rid, f"the engine refused the request: {error}"))

    def _spawn_for(self, state: PrefillState, coro) -> asyncio.Task:
        task = self.spawn(coro)
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)
        return task

    # -- 2./3. first token -> export ----------------------------------------------------
    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            if self.warmer is not None and self.warmer.took(out):
                continue
            state = self.requests.get(out.seq_id)
            if state is None or not state.added.done():
                continue
            if out.kv_part is not None:  # a chunk of the prompt (or layers of its last) computed: it leaves now
                self._spawn_for(state, self._feed(state, out.kv_part, out.kv_layer))
                continue
            if out.token_id is None:
                self.spawn(self._fail(out.seq_id, out.error or "prefill failed"))
                continue
            # published before the push task even starts; a migrated attempt's next token comes
            # from its decoders, which compute its earlier output in their own precision first
            if self.cfg.first_token == Role.PREFILL and not state.task.sampling.resumed:
                self._spawn_for(state, self._stream_first(state, out))
            self._spawn_for(state, self._push(state, out))

    async def _stream_first(self, state: PrefillState, out: TokenOutput) -> None:
        """The first token to the gateway at once, through this site's NATS only: the user's TTFT
        is the prefill's, never the line's. The decoders get it with the KV and send it again as
        index 0 (with the finish, when it ends the request); the gateway keeps one copy, and only
        from the plan's dispatch (a dropped copy's first token may differ, when sampled)."""
        rid = state.task.request_id
        chunk = TokenChunk(
            rid,
            0,
            [out.token_id],
            role=self.role,
            instance_id=self.inst.id,
            dispatch_id=state.task.plan.dispatch_id,
            logprobs=None if out.logprob is None else [out.logprob],
        )
        await self.bus.publish(subjects.tokens(rid, state.task.plan.stream_key), chunk)

    async def _feed(self, state: PrefillState, part: KVPayload, layer: int | None = None) -> None:
        """A chunk of the prompt was computed (`stream_kv`): its KV goes into each target's push at
        once, so a long prompt's KV crosses while the rest prefills; the last chunk's comes layer by
        layer (`layer`: the part holds the layers from that one), while its forward computes the next. A
        target's push goes out with its first part: one that starts later in the prompt
        (main-decode holding a longer prefix, or computing the suffix itself) waits for its own, as
        its decoder waits only `stall_s` between a HEADER and its first part."""
        async with state.feeding:
            self._make_pushes(state, part.header)
            await self._encode_and_add(state, [part] * len(state.task.targets), layer=layer)

    async def _push(self, state: PrefillState, out: TokenOutput) -> None:
        """The first token is sampled: the KV not streamed yet is exported (the blocks are freed),
        and each push ends with it and the first token; then the pushes' outcome is settled."""
        task = state.task
        rid = task.request_id
        prefill_ms = (time.monotonic() - state.accepted_at) * 1000
        async with state.feeding:  # after every part of the prompt fed before it
            starts = [state.pushes[t.instance_id].covered if state.pushes else t.start for t in task.targets]
            try:
                payloads, hit = await self.worker.call(lambda e: e.export_and_release(rid, starts))
            except NotHeld:
                return  # aborted between the first token and the export: nothing is held
            try:
                self._make_pushes(state, payloads[0].header)
                streamed = max(start - t.start for start, t in zip(starts, task.targets))
                stats = RequestStats(prefill_ms=prefill_ms, prefill_hit_tokens=hit, streamed_kv_tokens=streamed)
                await self._encode_and_add(state, payloads, FirstToken(out.token_id, stats, out.logprob))
            except Exception as e:  # the pushes wait for what will not come: the request fails, once
                log.exception("%s: %s: KV export failed", self.inst.id, rid)
                return await self._fail(rid, f"KV export failed: {e}")
        try:
            results = await asyncio.gather(
                *(state.sending[t.instance_id] for t in task.targets), return_exceptions=True
            )
        finally:
            self._settle_early(state)
        if self.requests.get(rid) is not state:
            return  # aborted or dropped meanwhile
        del self.requests[rid]
        failed = [(t, r) for t, r in zip(task.targets, results) if isinstance(r, Exception)]
        if failed:
            await self._degrade(task, failed)

    def _make_pushes(self, state: PrefillState, kv: KVHeader) -> None:
        """Each target's push, [its start, n) of the prompt's KV (once); each goes out with its
        first part (`_add`)."""
        if state.pushes:
            return
        task = state.task
        for t in task.targets:
            head = TransferHead(
                request_id=task.request_id,
                sender=self.inst.id,
                secret=t.transfer_secret,
                kv=dataclasses.replace(kv, start=t.start, end=len(task.prompt_ids), wire=t.wire),
                wan=t.wan,
            )
            state.pushes[t.instance_id] = KVPush(head)

    async def _encode_and_add(
        self, state: PrefillState, parts: list[KVPayload], first: FirstToken | None = None, layer: int | None = None
    ) -> None:
        """What of each target's part its push lacks (a target starting later skips what it holds),
        in its wire format, added to its push (with `first`, which ends it) as soon as it is
        encoded: the next target's is encoded while this one's goes out. The in-DC targets come
        first (a relay streams the next token from its copy; a 2,000-token prompt's second token
        waited ~45 ms for main-decode's bytes too), and a target whose range and wire format an
        earlier one had takes its bytes."""
        encoded: dict[tuple[int, int, str], tuple[int, list[bytes]] | None] = {}
        for t, part in sorted(zip(state.task.targets, parts), key=lambda tp: tp[0].wan):  # stable
            push = state.pushes[t.instance_id]
            key = (push.covered, part.header.end, t.wire)
            if key not in encoded:
                encoded[key] = None
                if part.header.end > push.covered:
                    mine = part.narrow(push.covered, part.header.end)
                    layers = await asyncio.to_thread(_wire_layers, mine, t.wire)
                    encoded[key] = mine.header.end, layers
            self._add(state, t, encoded[key], first, layer)

    def _add(
        self,
        state: PrefillState,
        target: KVTarget,
        part: tuple[int, list[bytes]] | None,
        first: FirstToken | None = None,
        layer: int | None = None,
    ) -> None:
        """Add the encoded part (and, with `first`, end the push), and send the push once it holds
        more than its HEADER. A push across the WAN that is whole when it starts (its KV was not
        streamed) follows the in-DC pushes already under way: the relay streams the next token from
        its copy, and main-decode's copy, wanted only at the handoff, took half the relay's
        bandwidth and CPU (a 2,000-token prompt's second token came ~400 ms after the first with
        both at once, ~250 ms with the relay's alone)."""
        push = state.pushes[target.instance_id]
        if part is not None and layer is not None:
            push.add_layers(part[0], layer, part[1])
        elif part is not None:
            push.add(*part)
        if first is not None:
            push.finish(first)
        if target.instance_id not in state.sending and (push.has_kv or push.first is not None):
            early = state.early.get(target.instance_id)
            ahead = [task for iid, task in state.sending.items() if not state.pushes[iid].head.wan]
            sending = self._spawn_for(state, self._send(target, push, early, ahead if target.wan and first else ()))
            # its outcome is `_push`'s to settle; a push given up with its request has none to settle
            sending.add_done_callback(lambda t: t.cancelled() or t.exception())
            state.sending[target.instance_id] = sending

    async def _degrade(self, task: PrefillTask, failed: list[tuple[KVTarget, Exception]]) -> None:
        """Some pushes failed after their retries. If the relay has its copy and only main-decode's
        failed, the relay finishes the request (the user's stream goes on); otherwise it fails."""
        rid = task.request_id
        roles = {t.role for t, _ in failed}
        if roles == {Role.MD} and task.plan.rld and hands_off(task.plan.pipeline):
            log.warning("%s: %s: WAN push failed (%s); relay finishes it", self.inst.id, rid, failed[0][1])
            msg = FinishOnRelay(rid, reason=f"KV push to main-decode failed: {failed[0][1]}")
            await self.bus.publish(subjects.finish_on_relay(task.plan.rld), msg)
            md_secret = next(t.transfer_secret for t in task.targets if t.role == Role.MD)
            drop = Drop(rid, reason="KV push failed", transfer_secret=md_secret)
            await self.bus.publish(subjects.decode_drop(task.plan.md), drop)
            return
        errors = "; ".join(str(e) for _, e in failed)
        await self._fail(rid, errors, blame=failed[0][0].instance_id, plan=task.plan)

    async def _send(
        self, target: KVTarget, push: KVPush, early: EarlyConnection | None, after: Iterable[asyncio.Task] = ()
    ) -> int:
        """Push one target's KV as its parts come (the first try on its early connection, if one is
        ready; else on a standing one, or dialed); a dropped or stalled connection is retried from
        the start on a new one (a standing connection found dead costs one redial, not a retry:
        `KVConnections.send`). It starts once the pushes `after` ended, whatever their outcome."""
        if after := list(after):
            await asyncio.wait(after)
        endpoint = Endpoint(target.host, target.port, target.instance_id)
        t = self.cfg.timeouts
        path = "wan" if target.wan else "in_dc"
        kv = push.head.kv
        for attempt in range(t.kv_retries + 1):
            t0 = time.perf_counter()
            try:
                conn = await early.take() if early is not None and attempt == 0 else None
                sent = await self.kv_pool.send(endpoint, push, conn, reused=conn is not None and early.reused)
                self.kv_seconds.labels(path=path).observe(time.perf_counter() - t0)
                self.kv_bytes.labels(path=path).inc(sent)
                log.info(
                    "%s: %s: KV [%d, %d) to %s (%s): %d bytes in %.0f ms",
                    self.inst.id,
                    push.head.request_id,
                    kv.start,
                    kv.end,
                    target.instance_id,
                    path,
                    sent,
                    (time.perf_counter() - t0) * 1000,
                )
                return sent
            except KVTransferError as e:
                if push.abandoned:
                    raise  # the request ended: nothing to retry
                self.kv_failures.labels(path=path).inc()
                error = e
                log.warning(
                    "%s: %s: KV push to %s failed (attempt %d): %s",
                    self.inst.id,
                    push.head.request_id,
                    target.instance_id,
                    attempt + 1,
                    e,
                )
                await asyncio.sleep(0.2 * (attempt + 1))
        raise KVTransferError(f"KV push to {target.instance_id} failed: {error}")

    # -- 5. failure and abort -----------------------------------------------------------
    async def _fail(self, rid: str, error: str, blame: str = "", plan: Plan | None = None) -> None:
        """Tell the gateway, stamped with the copy's dispatch: it ends the request, or moves it off
        `blame`, and its abort frees every stage. Not a broadcast abort from here: this copy may be
        one the scheduler is dropping and planning again under the same id (a decoder that took no
        task fails the push at once), and an abort would end the new copy with it."""
        log.warning("%s: request %s failed: %s", self.inst.id, rid, error)
        if (state := self.requests.pop(rid, None)) is not None:
            self._settle_early(state)
            for push in state.pushes.values():  # waiting for KV that will not come
                push.abandon(error)
            me = asyncio.current_task()
            for t in state.tasks:
                if t is not me:  # `_push` failing calls this: its error chunk must still go out
                    t.cancel()
            plan = plan or state.task.plan
        dispatch_id, stream_key = (plan.dispatch_id, plan.stream_key) if plan else ("", "")
        chunk = TokenChunk(
            rid,
            0,
            [],
            role=self.role,
            instance_id=self.inst.id,
            finish_reason="error",
            error=error,
            blame=blame,
            dispatch_id=dispatch_id,
        )
        await self.bus.publish(subjects.tokens(rid, stream_key), chunk)

    async def _flush_cache(self, msg: Inspect) -> InstanceState:
        """The cache flush, answers waiting to be warmed and the one being warmed included."""
        for seq_id in self.warmer.clear():
            await self.worker.call(lambda e, s=seq_id: e.abort(s))
        return await super()._flush_cache(msg)

    async def on_warm(self, msg: Warm) -> None:
        if problem := self.task_problem(msg.token_ids, Sampling(max_tokens=1)):
            log.info("%s: answer of %s not warmed: %s", self.inst.id, msg.request_id, problem)
            return
        self.warmer.offer(msg)

    async def on_drop(self, msg: Drop) -> None:
        """Let go of the copy the drop names (by a transfer secret), and refuse it if it comes
        later; a copy it does not name goes on. A drop naming no copy is an abort here."""
        if not msg.transfer_secret:
            return await self.on_abort(Abort(msg.request_id, reason=msg.reason))
        self.seen.add(msg.transfer_secret)
        state = self.requests.get(msg.request_id)
        if state is not None and msg.transfer_secret in _secrets(state.task):
            await self._let_go(state)

    async def on_abort(self, msg: Abort) -> None:
        self.aborted.add(msg.request_id)
        if (state := self.requests.get(msg.request_id)) is not None:
            await self._let_go(state, keep_kv=msg.keep_kv)

    def _let_go(self, state: PrefillState, keep_kv: bool = False) -> asyncio.Future:
        """Forget the copy, cancel its push and transfers, and abort its sequence in the engine
        (the returned future: done when the engine let go)."""
        rid = state.task.request_id
        if self.requests.get(rid) is state:
            del self.requests[rid]
        self._settle_early(state)
        if not keep_kv:  # finished on the relay: md's push may still land (its task is not cancelled)
            for push in state.pushes.values():
                push.abandon("the request was let go")
        me = asyncio.current_task()
        for t in list(state.tasks):
            if t is not me and not keep_kv:  # finished on the relay: md's push may still land
                t.cancel()
        return self.worker.submit(lambda e: e.abort(rid))


def main(argv: list[str] | None = None) -> None:
    service_main(Prefiller, Role.PREFILL, argv)


def _secrets(task: PrefillTask) -> set[str]:
    """What names a copy of a request: the transfer secrets the scheduler minted for its targets."""
    return {t.transfer_secret for t in task.targets}


def _targets_problem(task: PrefillTask, block_size: int) -> str:
    if not 1 <= len(task.targets) <= 2 or len({t.role for t in task.targets}) != len(task.targets):
        return "a task names one or two decoders of different roles"
    for t in task.targets:
        if t.role not in (Role.RLD, Role.MD) or not 0 < t.port < 65536 or not t.host or not t.transfer_secret:
            return f"bad KV target {t.instance_id!r}"
        if not valid_start(t.start, len(task.prompt_ids), block_size):
            return f"KV target {t.instance_id!r}: start {t.start} is neither a block boundary in the prompt nor its end"
    return ""


def _wire_layers(part: KVPayload, wire: str) -> list[bytes]:
    """Each layer of the part in wire format `wire` (run in a thread: it copies megabytes)."""
    return [layer_to_bytes(k, v, wire) for k, v in part.layers]


def _next_token_waits_on_the_line(task: PrefillTask) -> bool:
    """Whether the request's second token comes from across the line (main-decode with no relay,
    `p-md`): its prompt's last chunk may then leave layer by layer while the forward runs
    (`Prefiller._by_layer`), and the line carries it meanwhile. Under `p-rld-md` the relay's in-DC push and
    main-decode's after it stay whole after the first token: the two pushes beside the forward took
    prefill's cores on a CPU host (a 400-token prompt's TTFT +51%, its second token 1.31x;
    docs/kv-wire.md)."""
    return not any(t.role == Role.RLD for t in task.targets) and any(t.wan for t in task.targets)
