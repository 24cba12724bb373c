"""Engine: continuous batching over the ModelRunner. The single owner of its pool and sequences.

Lifecycle of a sequence here:
1. `add(seq)` queues it (WAITING). A sequence may arrive with KV already in the pool
   (`num_computed > 0`, blocks in `block_table`): imported from prefill, or a cached prefix.
2. Admission: when enough blocks are free for its whole budget (known tokens + tokens it may
   still sample), they are reserved and it becomes RUNNING. Reserving up front means a running
   sequence never meets an exhausted pool. A sequence that cannot fit even in an empty pool
   fails at once with a clear error.
3. Each `step()`: every RUNNING sequence with one pending token decodes; sequences with more
   pending tokens (prefill, chunked prefill, extend) share the rest of the step's token budget,
   oldest first. All of it is ONE model forward.
4. A sequence whose step reached its last known token samples the next one and checks stop
   conditions. Finished sequences free their blocks unless `hold_kv` is set, in which case the
   owner calls `release()` once it has exported the KV.
5. `abort()` finishes a sequence at any point and frees its blocks.

KV that crosses instances enters and leaves through the engine too, so that only the runtime
allocates, frees or caches blocks: `admit_with_kv` stitches KV that arrived from prefill onto the
cached prefix and joins the batch (decoders), `export_and_release` copies a finished prompt's KV
out and frees its blocks (prefill), `extend_shadow` hands a shadow the relay's tokens (main-decode),
`cache_events` and `flush_cache` report and empty the prefix cache. Callers on the event loop
reach these through `EngineWorker.call`, on the engine thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from itertools import chain

import torch

from shared.messages import EngineFigures, IndexEvent, Logprob
from shared.runtime.grammar import Grammars, Masks
from shared.runtime.kv_exchange import KVExchange
from shared.runtime.kv_payload import KVPayload, export_layer, kv_header
from shared.runtime.kv_pool import KVPool, PoolExhausted
from shared.runtime.layers import PER_CALL
from shared.runtime.models import kv_layout
from shared.runtime.radix_cache import RadixCache
from shared.runtime.runner import ModelRunner
from shared.runtime.sampling import TokenMask, sample_batch, token_logprobs
from shared.runtime.sequence import FinishReason, SeqStatus, Sequence
from shared.runtime.stops import StopRules


@dataclass(frozen=True)
class TokenOutput:
    seq_id: str
    token_id: int | None  # None when the sequence finished without a new token (abort, error)
    index: int  # position of the token among the generated tokens (0-based)
    finish_reason: str | None = None
    error: str | None = None
    caught_up: bool = False  # a shadow sequence computed every token it knows (no token sampled)
    logprob: Logprob | None = None  # the token's, when its request asked for them
    kv_part: KVPayload | None = None  # a streaming prefill's KV computed by this step (no token: `export_from`)
    kv_layer: int | None = None  # kv_part holds layers from this one of its range (the prompt's last chunk, mid-step)


class Engine(KVExchange):
    def __init__(
        self,
        runner: ModelRunner,
        max_step_tokens: int = 512,
        max_running: int = 64,
        eos_token_ids: tuple[int, ...] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        cache: RadixCache | None = None,
        namespace: str = "",
        grammars: Grammars | None = None,
    ) -> None:
        self.runner = runner
        self.cache = cache  # optional prefix cache; holds its own references on blocks
        self.namespace = namespace
        self.pool = runner.pool
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.stops = StopRules(eos_token_ids, decode_text)
        self.grammars = grammars  # constrained decoding (None: requests with a grammar fail)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # finished with hold_kv, blocks not yet released
        self.steps = 0
        self.last_step_tokens = 0  # tokens computed by the last step (its forward's size)
        self.prefix_queried = 0  # prompt tokens of admitted sequences, and of those found cached
        self.prefix_hit = 0
        # where a streaming prefill's last chunk goes layer by layer, during its step (the worker
        # hands each to the loop at once: `_LayerStream`); None: it leaves with the first token
        self.emit: Callable[[list[TokenOutput]], None] | None = None

    @classmethod
    def for_model(
        cls,
        model,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        invariant: bool | None = None,
        **kwargs,
    ) -> Engine:
        """An engine with its own pool (in the model's dtype unless told) around `model`
        (`invariant`: the runner's batch-invariant kernels, by default where they run)."""
        dtype = dtype or next(model.parameters()).dtype
        pool = KVPool(kv_layout(model), num_blocks, block_size, dtype, next(model.parameters()).device)
        return cls(ModelRunner(model, pool, invariant=invariant), **kwargs)

    # -- commands -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.running or any(s.seq_id == seq.seq_id for s in self.waiting):
            raise ValueError(f"sequence {seq.seq_id} is already in the engine")
        seq.status = SeqStatus.WAITING
        seq.namespace = seq.namespace or self.namespace
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish a sequence wherever it is and free its blocks. Idempotent."""
        for seq in list(self.waiting):
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.ABORT, hold=False)
                return seq
        seq = self.running.pop(seq_id, None) or self.held.pop(seq_id, None)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT, hold=False)
        return seq

    def find(self, seq_id: str) -> Sequence | None:
        """A sequence queued or running here (a shadow may be handed tokens before it is admitted)."""
        return self.running.get(seq_id) or next((s for s in self.waiting if s.seq_id == seq_id), None)

    def release(self, seq_id: str) -> None:
        """Free the blocks a finished `hold_kv` sequence kept."""
        seq = self.held.pop(seq_id, None)
        if seq is not None:
            self._free_blocks(seq)

    def allocate(self, n: int) -> list[int]:
        """n blocks, evicting cached prefixes if the free list is short. Raises PoolExhausted."""
        short = n - self.pool.num_free_blocks
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pool.allocator.allocate(n)

    def match_prefix(self, seq: Sequence, max_tokens: int) -> None:
        """Reuse the cached prefix of a fresh sequence, at most `max_tokens` of it."""
        if self.cache is None or seq.block_table or seq.num_computed:
            return
        blocks = self.cache.match(seq.token_ids, seq.namespace or self.namespace, max_tokens // self.pool.block_size)
        seq.block_table = blocks
        seq.num_computed = seq.cached_tokens = len(blocks) * self.pool.block_size

    def count_prefix(self, seq: Sequence) -> None:
        """An admitted sequence's prefix-cache lookup, for the hit-rate counters."""
        self.prefix_queried += seq.prompt_len
        self.prefix_hit += seq.cached_tokens

    def fail_running(self, error: str) -> list[TokenOutput]:
        """Finish every running sequence with an error (after a failed step); frees their blocks."""
        failed = [self._fail(seq, error) for seq in self.running.values()]
        self.running.clear()
        return failed

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def samples_a_first_token(self) -> bool:
        """Whether the next step samples some request's first token here: a decoder's first after
        the KV came (the request's second token), main-decode's first after a handoff, a moved
        request's first on its new instance. A user waits on it as on a prompt."""
        return any(not s.shadow and s.sampled_here == 0 for s in chain(self.running.values(), self.waiting))

    def figures(self) -> EngineFigures:
        return EngineFigures(
            running=len(self.running),
            waiting=len(self.waiting),
            free_blocks=self.pool.num_free_blocks,
            total_blocks=self.pool.num_blocks,
            cached_blocks=self.cache.num_blocks if self.cache else 0,
            prefix_queried=self.prefix_queried,
            prefix_hit=self.prefix_hit,
            queued_tokens=sum(s.num_pending for s in self.waiting)
            + sum(s.num_pending for s in self.running.values() if s.num_pending > 1),  # prompt left to compute
            mirror_bytes=self.runner.mirror.nbytes if self.runner.mirror is not None else 0,
        )

    # -- the prefix cache's reports -----------------------------------------------------------
    @property
    def has_cache_events(self) -> bool:
        """Whether the cache changed since the last `cache_events`. A peek another thread may
        take without a call to the engine's (a list's length under the GIL): a stale answer
        only moves the report to the next look."""
        return self.cache is not None and bool(self.cache.events)

    def cache_events(self, full: bool) -> list[IndexEvent]:
        """The prefix cache's changes since the last call; `full`: all of it, from a clean slate."""
        if self.cache is None:
            return [IndexEvent("cleared")] if full else []
        if full:
            self.cache.drain_events()
            return self.cache.all_events()
        return self.cache.drain_events()

    def flush_cache(self) -> int:
        """Evict every cached block no sequence uses (SGLang's /flush_cache). Returns how many."""
        return self.cache.evict(self.pool.num_blocks) if self.cache is not None else 0

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        outputs = self._admit()
        work = self._schedule()
        if not work:
            return outputs
        masking = self._prefetch_masks(work)
        by_layer = _LayerStream.of(self, work)
        try:
            result = self.runner.forward(work, by_layer)
        finally:  # a failed step frees sequences: not while the grammar thread reads them
            if masking is not None:
                wait([masking])
        self.steps += 1
        self.last_step_tokens = sum(n for _, n in work)
        for seq, n in work:
            seq.num_computed += n
            if seq.imported is not None and seq.num_computed == seq.imported[0]:
                seq.num_computed, seq.imported = seq.imported[1], None
            if seq.shadow and seq.num_pending == 1:
                outputs.append(TokenOutput(seq.seq_id, None, seq.num_generated, caught_up=True))
            if seq.export_from is not None and seq.export_from < seq.num_computed < seq.num_tokens:
                outputs.append(TokenOutput(seq.seq_id, None, seq.num_generated, kv_part=self.export_part(seq)))
        sampled = result.sampled
        steps = [s.num_output for s in sampled]
        histories = [self.stops.history(s) if s.params.penalised else None for s in sampled]
        masks, failed = self._masks(sampled, masking)
        params = [s.params for s in sampled]
        tokens = sample_batch(result.logits, params, steps, histories, masks)
        logprobs = token_logprobs(result.logits, params, tokens)
        for s, token, lp in zip(sampled, tokens, logprobs):
            if s.seq_id in failed:
                self.running.pop(s.seq_id, None)
                outputs.append(self._fail(s, failed[s.seq_id]))
            else:
                outputs.append(self._append(s, token, lp))
        return outputs

    def _prefetch_masks(self, work: list[tuple[Sequence, int]]) -> Future[Masks] | None:
        """The grammar masks of the constrained rows this step will sample, computed while its
        forward runs (they depend only on tokens already known)."""
        if self.grammars is None:
            return None
        sampling = [s for s, n in work if s.params.grammar and not s.shadow and s.num_computed + n >= s.num_tokens]
        return self.grammars.prefetch(sampling) if sampling else None

    def _masks(
        self, seqs: list[Sequence], masking: Future[Masks] | None
    ) -> tuple[list[TokenMask | None], dict[str, str]]:
        """Each sampled row's grammar mask (None for rows without a grammar) and the rows whose
        grammar failed."""
        if not any(s.params.grammar for s in seqs):
            return [], {}
        if self.grammars is None:
            return [], {s.seq_id: "this instance has no grammar support" for s in seqs if s.params.grammar}
        ready, failed = self.grammars.masks(seqs, masking.result() if masking is not None else None)
        return [ready.get(s.seq_id) for s in seqs], failed

    def _admit(self) -> list[TokenOutput]:
        failed: list[TokenOutput] = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if error := self._never_fits(seq):
                self.waiting.popleft()
                failed.append(self._fail(seq, error))
                continue
            fresh = not seq.block_table and not seq.num_computed
            self.match_prefix(seq, seq.num_tokens - 1)  # at least one token left to compute
            try:
                self._reserve(seq)
            except PoolExhausted:
                if fresh:  # give the matched prefix back while waiting
                    self._free_blocks(seq)
                    seq.num_computed = seq.cached_tokens = 0
                break  # wait for running sequences to finish
            self.waiting.popleft()
            if fresh:
                self.count_prefix(seq)
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
        return failed

    def _never_fits(self, seq: Sequence) -> str:
        """Why the sequence could not run even in an empty pool ("" when it could)."""
        if self.pool.blocks_for(seq.max_total_tokens) <= self.pool.num_blocks:
            return ""
        held = self.pool.num_blocks * self.pool.block_size
        return f"request needs {seq.max_total_tokens} tokens of KV, more than the pool holds ({held})"

    def _reserve(self, seq: Sequence) -> None:
        """Blocks for the sequence's whole budget (known tokens + tokens it may still sample): a
        running sequence never meets an exhausted pool. Raises PoolExhausted when it must wait."""
        seq.block_table.extend(self.allocate(max(self.pool.blocks_for(seq.max_total_tokens) - len(seq.block_table), 0)))

    def _schedule(self) -> list[tuple[Sequence, int]]:
        # A shadow leaves its last known token pending: its logits are only wanted once it
        # stops being a shadow, and then that token is an ordinary decode step.
        def is_decode(s: Sequence) -> bool:
            return s.num_pending == 1 and not s.shadow and s.imported is None

        decodes = [(s, 1) for s in self.running.values() if is_decode(s)]
        budget = self.max_step_tokens - len(decodes)
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running.values():
            todo = seq.num_schedulable
            if todo >= 1 and not is_decode(seq) and budget > 0:
                n = min(todo, budget)
                chunks.append((seq, n))
                budget -= n
        return decodes + chunks

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None = None) -> TokenOutput:
        index = seq.num_generated
        seq.token_ids.append(token)
        seq.sampled_here += 1
        reason = self.stops.reason(seq, token)
        if reason is None and seq.params.grammar and self.grammars is not None and self.grammars.finished(seq):
            reason = FinishReason.STOP  # the grammar allows nothing more (a JSON answer closed)
        if reason is not None:
            self.running.pop(seq.seq_id, None)
            self._finish(seq, reason, hold=seq.hold_kv)
        return TokenOutput(seq.seq_id, token, index, reason, logprob=logprob)

    def _fail(self, seq: Sequence, error: str) -> TokenOutput:
        self._finish(seq, FinishReason.ERROR, hold=False)
        return TokenOutput(seq.seq_id, None, seq.num_generated, FinishReason.ERROR, error)

    def _finish(self, seq: Sequence, reason: str, hold: bool) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.grammars is not None:
            self.grammars.drop(seq.seq_id)
        if hold:
            self.held[seq.seq_id] = seq
        else:
            self._free_blocks(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        """Drop the sequence's references; with a cache, its computed full blocks stay cached."""
        if not seq.block_table:
            return
        if self.cache is not None and seq.imported is None:
            full = seq.num_computed // self.pool.block_size
            self.cache.insert(
                seq.token_ids[: seq.num_computed], seq.block_table[:full], seq.namespace or self.namespace
            )
        self.pool.allocator.free(seq.block_table)
        seq.block_table = []


class _LayerStream:
    """A step's `after_layer` where it computes the last chunk of streaming prefills' prompts
    (`Sequence.layers_from`): each layer's KV of [its start, the prompt's end) goes to
    `Engine.emit` as soon as the forward computed that layer, so its push crosses while the later
    layers run (as Mooncake and Splitwise stream layer by layer), not after the first token. Earlier
    chunks of a prompt streamed chunk by chunk (`export_from`) went whole, each after its step; a
    model outside the fused decoder calls no `after_layer`, and its KV leaves with the first token."""

    # layers per hand-over: each wakes the loop, the push's sender, the line and the receiver, and
    # on a CPU host every wake-up preempts a thread of the forward (whose partner then waits at
    # its barrier); a group of 5 of SmolLM2's 30 layers is a sixth of the KV left after the
    # forward. layers.c runs as many per call (`PER_CALL`).
    EVERY = PER_CALL

    def __init__(self, engine: Engine, seqs: list[Sequence]) -> None:
        self.engine, self.seqs = engine, seqs
        self._layers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in seqs]
        self._slots: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, engine: Engine, work: list[tuple[Sequence, int]]) -> _LayerStream | None:
        if engine.emit is None:
            return None
        seqs = [s for s, n in work if s.layers_from is not None and _start(s) < s.num_computed + n == s.num_tokens]
        return cls(engine, seqs) if seqs else None

    def __call__(self, layer: int) -> None:
        pool = self.engine.pool
        if self._slots is None:  # the step's blocks are allocated by now
            self._slots = [pool.slots(s.block_table, _start(s), s.num_tokens) for s in self.seqs]
        for layers, slots in zip(self._layers, self._slots):
            layers.append(export_layer(pool, slots, layer))
        if len(self._layers[0]) < self.EVERY and layer + 1 < pool.layout.num_layers:
            return
        outputs = []
        for seq, layers in zip(self.seqs, self._layers):
            part = KVPayload(kv_header(pool, _start(seq), seq.num_tokens), layers)
            outputs.append(
                TokenOutput(seq.seq_id, None, seq.num_generated, kv_part=part, kv_layer=layer + 1 - len(layers))
            )
        self._layers = [[] for _ in self.seqs]
        self.engine.emit(outputs)


def _start(seq: Sequence) -> int:
    """Where a sequence's KV left layer by layer starts: past the chunks already handed out."""
    return seq.export_from if seq.export_from is not None else seq.layers_from
