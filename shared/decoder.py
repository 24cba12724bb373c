"""DecoderService: the decode side shared by main-decode (md) and relay-decode (rld).

Lifecycle of a request on a decoder:
1. `DecodeTask` arrives over NATS: remembered as pending (with a deadline), acked. Duplicates
   are acked again; a task for an aborted request is refused.
2. Its KV arrives on this instance's TCP listener (from prefill, in-DC or across the WAN):
   on the engine thread, blocks are allocated, the KV imported (dtype converted), and the
   sequence — prompt plus prefill's first token — joins the running batch. Then the sender
   gets its ACK, and the first token (index 0) is published.
3. Every engine step's tokens are published on `pdd.tokens.<request>` in order.
4. The final chunk carries finish_reason and the request's stats; the engine frees the blocks.
5. Abort (or a pending task whose KV never comes before its deadline) drops the request
   wherever it is; an error is published for the latter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from shared import subjects
from shared.kv_transport import KVReceiver, Transfer
from shared.messages import Abort, Ack, DecodeTask, TokenChunk, WanSample
from shared.runtime.engine import Engine, TokenOutput
from shared.runtime.kv_payload import KVHeader, KVPayload, import_kv, layer_from_bytes
from shared.runtime.kv_pool import PoolExhausted
from shared.runtime.sequence import FinishReason, Sequence
from shared.service import EngineService, to_params

log = logging.getLogger(__name__)


@dataclass
class DecodeState:
    task: DecodeTask
    accepted_at: float
    stats: dict[str, Any] = field(default_factory=dict)
    running: bool = False
    parked: tuple[Sequence, KVPayload, int] | None = None  # KV landed; waits in host memory for room
    error: str = ""


class DecoderService(EngineService):
    def __init__(self, cfg, inst) -> None:
        super().__init__(cfg, inst)
        self.requests: dict[str, DecodeState] = {}
        self.aborted: dict[str, float] = {}  # request id -> when; tasks arriving late are refused
        self.receiver = KVReceiver(self.on_transfer, cfg.timeouts.kv_stall_s, self._on_transfer_error,
                                   wanted=lambda rid: rid in self.requests)  # fmt: skip
        self._out: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self.parked: deque[str] = deque()  # requests whose KV waits for pool room, in arrival order
        self._admitting = asyncio.Lock()
        self._room = asyncio.Event()  # set when blocks may have been freed

    async def setup(self) -> None:
        await super().setup()
        self.info.kv_host = self.cfg.public_host
        self.info.kv_port = await self.receiver.start(self.cfg.host, 0)
        await self.bus.serve(subjects.decode_task(self.inst.id), DecodeTask, self.on_task)
        await self.bus.serve(subjects.decode_drop(self.inst.id), Abort, self.on_drop)
        self.spawn(self._publisher())
        self.spawn(self._watchdog())
        self.spawn(self._unparker())

    async def teardown(self) -> None:
        await self.receiver.stop()
        await super().teardown()

    def held_requests(self) -> list[str]:
        return sorted(self.requests)

    async def load(self) -> dict[str, int]:
        """The engine's figures plus `pending`: tasks accepted whose KV has not landed. They are
        committed here, so the scheduler's relay admission control counts them."""
        return {**await super().load(), "pending": sum(not s.running for s in self.requests.values())}

    # -- 1. task ------------------------------------------------------------------------
    async def on_task(self, task: DecodeTask) -> Ack:
        rid = task.request_id
        if rid in self.aborted:
            return Ack(rid, ok=False, error="request was aborted")
        if rid not in self.requests:
            if (full := self.refuse_if_full(rid)) is not None:
                return full
            self.requests[rid] = DecodeState(task, time.monotonic())
        return Ack(rid)

    # -- 2. KV arrives ------------------------------------------------------------------
    async def on_transfer(self, t: Transfer) -> str:
        state = self.requests.get(t.request_id)
        if state is None:
            return f"{self.inst.id} has no decode task for {t.request_id}"
        if state.running or state.parked is not None:  # a retried push whose first attempt landed after all
            return ""
        header = KVHeader(**t.kv)
        layers = await asyncio.to_thread(lambda: [layer_from_bytes(header, b) for b in t.layers])
        first = int(t.done["first_token"])
        state.stats.update(t.done.get("stats", {}))
        key = "wan_kv_bytes" if t.via_wan else "local_kv_bytes"
        state.stats[key] = state.stats.get(key, 0) + t.wire_bytes
        state.stats.setdefault("timings_ms", {})["kv_wan" if t.via_wan else "kv_local"] = t.elapsed_ms
        if t.via_wan:
            self.spawn(self.bus.publish(subjects.WAN_SAMPLE, WanSample(t.wire_bytes, t.elapsed_ms / 1000)))
        task = state.task
        seq = Sequence(task.request_id, list(task.prompt_ids) + [first], to_params(task.sampling))
        seq.prompt_len = len(task.prompt_ids)
        seq.shadow = self.admits_as_shadow(task)
        state.parked = (seq, KVPayload(header, layers), first)
        self.parked.append(task.request_id)
        await self._admit_parked()
        return state.error  # "" = committed: running, or parked until the pool has room

    async def _admit_parked(self) -> None:
        """Import parked KV and join the batch, oldest first, while the pool has room.

        Admission reserves a request's whole budget. When running requests hold the pool, the
        KV that landed waits here in host memory (bounded: at most `max_waiting` requests beyond
        `max_running` are accepted) and is admitted as they finish, instead of failing.
        """
        async with self._admitting:
            while self.parked:
                state = self.requests.get(self.parked[0])
                if state is None or state.parked is None:  # aborted meanwhile
                    self.parked.popleft()
                    continue
                seq, payload, first = state.parked
                try:
                    done = await self.worker.call(lambda e, s=seq, kv=payload: _admit(e, s, kv))
                except PoolExhausted:
                    return  # retried when a running request frees its blocks
                except Exception as e:  # cannot ever fit, bad KV...: the request fails, nothing is held
                    state.error = f"{self.inst.id}: {e}"
                    done = None
                self.parked.popleft()
                state.parked = None
                if state.error:
                    self.emit(TokenOutput(seq.seq_id, None, 0, FinishReason.ERROR, state.error))
                    continue
                self._admitted(state, seq)
                await self.after_admit(state, first, done)

    def _admitted(self, state: DecodeState, seq: Sequence) -> None:
        state.running = True
        state.stats.setdefault("prefix_hit_tokens", {})["md" if self.role == "md" else "rld"] = seq.cached_tokens
        if seq.imported is not None:
            state.stats["recomputed_tokens"] = seq.imported[0] - seq.num_computed
            log.info("%s: %s: prefix evicted since the plan; recomputing %d tokens", self.inst.id, seq.seq_id,
                     state.stats["recomputed_tokens"])  # fmt: skip

    async def _unparker(self) -> None:
        while True:
            await self._room.wait()
            self._room.clear()
            await self._admit_parked()

    def admits_as_shadow(self, task: DecodeTask) -> bool:
        """Whether this decoder follows another one's tokens before it decodes (md in p-rld-md)."""
        return False

    async def after_admit(self, state: DecodeState, first: int, done: str | None) -> None:
        """The KV is in and the sequence runs: stream prefill's first token as index 0."""
        self.emit(TokenOutput(state.task.request_id, first, 0, done))

    # -- 3./4. tokens out ---------------------------------------------------------------
    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        if self.parked and any(out.finish_reason is not None for out in outputs):
            self._room.set()
        for out in outputs:
            if out.seq_id not in self.requests:
                continue
            if out.caught_up:
                self.on_caught_up(out)
            else:
                self.emit(out)

    def on_caught_up(self, out: TokenOutput) -> None:
        """A shadow sequence computed every token it was given (see services/md)."""

    def emit(self, out: TokenOutput) -> None:
        state = self.requests.get(out.seq_id)
        chunk = TokenChunk(
            out.seq_id, out.index, [] if out.token_id is None else [out.token_id],
            role=self.role, instance_id=self.inst.id, finish_reason=out.finish_reason, error=out.error or "",
        )  # fmt: skip
        if out.finish_reason is not None:
            chunk.stats = state.stats if state else {}
            self.requests.pop(out.seq_id, None)
        self._out.put_nowait(chunk)

    async def _publisher(self) -> None:
        while True:
            chunk = await self._out.get()
            if chunk.finish_reason is not None:
                await self.flush_index()  # the next turn's plan must see this turn cached
            await self.bus.publish(subjects.tokens(chunk.request_id), chunk)

    # -- 5. abort and deadlines ---------------------------------------------------------
    async def on_abort(self, msg: Abort) -> None:
        self.aborted[msg.request_id] = time.monotonic()
        self.receiver.cancel(msg.request_id)  # its KV may be mid-way across the WAN: stop carrying it
        state = self.requests.pop(msg.request_id, None)
        if state is not None:
            await self.worker.call(lambda e: e.abort(msg.request_id))
            self._room.set()

    async def on_drop(self, msg: Abort) -> None:
        """Only this decoder's copy is abandoned (its KV push failed); others carry the request."""
        self.receiver.cancel(msg.request_id)
        state = self.requests.pop(msg.request_id, None)
        if state is not None and state.running:
            await self.worker.call(lambda e: e.abort(msg.request_id))
            self._room.set()

    def _on_transfer_error(self, request_id: str, error: str) -> None:
        # The sender retries (and reports if it gives up); the deadline below is the backstop.
        log.info("%s: KV transfer for %s broke off: %s", self.inst.id, request_id or "?", error)

    async def _watchdog(self) -> None:
        # A backstop for a KV that never comes (prefill died before pushing). Prefill may queue
        # and prefill long prompts first, so only the request deadline applies here; a transfer
        # that starts and stalls is caught by the KV plane's own stall timeout.
        limit = self.cfg.timeouts.request_s
        while True:
            await asyncio.sleep(1.0)
            if self.parked:  # blocks also free outside steps (a relay letting go after its handoff)
                self._room.set()
            now = time.monotonic()
            for rid, state in list(self.requests.items()):
                if not state.running and now - state.accepted_at > limit:
                    self.on_kv_deadline(rid, state, f"KV did not arrive within {limit:.0f}s")
            for rid, when in list(self.aborted.items()):
                if now - when > 600:
                    del self.aborted[rid]

    def on_kv_deadline(self, rid: str, state: DecodeState, error: str) -> None:
        self.emit(TokenOutput(rid, None, 0, FinishReason.ERROR, error))


def _admit(engine: Engine, seq: Sequence, payload: KVPayload) -> str | None:
    """On the engine thread: stitch the arriving KV [start, n) onto the cached prefix [0, start)
    and join the batch. Returns the finish reason when prefill's first token already ends it.

    If part of [0, start) was evicted since the plan was made, the missing range is recomputed
    here from its token ids before anything is decoded (never decode on incomplete KV).
    """
    first, params = seq.token_ids[-1], seq.params
    if first in engine.eos_token_ids and not params.ignore_eos or first in params.stop_token_ids:
        return FinishReason.STOP
    if params.max_tokens <= 1:
        return FinishReason.LENGTH
    if params.stop and engine.decode_text and any(s in engine.decode_text([first]) for s in params.stop):
        return FinishReason.STOP
    pool, start, n = engine.pool, payload.header.start, seq.prompt_len
    if start % pool.block_size:
        raise ValueError(f"KV starts at {start}, not on a block boundary of {pool.block_size}")
    engine.match_prefix(seq, start)  # [0, hit) from this decoder's own cache
    hit = seq.num_computed
    try:
        seq.block_table += engine.allocate(pool.blocks_for(n) - len(seq.block_table))
        with torch.inference_mode():
            import_kv(pool, seq.block_table, payload)
    except BaseException:  # as it was before the call: a parked request retries from scratch
        engine.pool.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.cached_tokens = 0
        raise
    seq.num_computed = n
    if hit < start:
        seq.num_computed, seq.imported = hit, (start, n)
    elif engine.cache is not None:  # KV is cached as it lands: the next turn hits at once
        engine.cache.insert(seq.token_ids[:n], seq.block_table[: n // pool.block_size], engine.namespace)
    try:
        engine.add(seq)
    except ValueError:
        engine.pool.allocator.free(seq.block_table)
        seq.block_table = []
        raise
    return None
