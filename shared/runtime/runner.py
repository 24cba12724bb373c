"""ModelRunner: one flattened forward for any mix of prefill chunks, extends and decodes.

`forward(work)` takes `(sequence, n)` pairs — compute the next `n` known tokens of each
sequence — packs them into one flat batch of T tokens with explicit positions (`pack`, plain
Python), builds the attention plan once (`StepAttention`), runs the model once, and returns
next-token logits for the sequences whose work reaches their last known token.

Which pieces run:
- batch-invariant by default on CPU (`invariant`): skinny.c, rows.c and fp32 activations for every
  row, so a sequence's tokens do not depend on what shares its step (fused.py); no mirror, every
  row's attention read from the pool in place. `invariant=False` is the fastest non-invariant
  path below (oneDNN/MKL, the mirror, SDPA), kept for comparison and for models the kernels do
  not take;
- the forward: the runtime's fused layer loop (fused.py) for Llama-family models, otherwise
  transformers' forward with the paged attention plugged in (attention.py);
- decode attention: on CPU the decode mirror (mirror.py: contiguous per-sequence KV, no gather
  per step) while it fits its budget, otherwise one padded gather per layer;
- on a GPU, a step made only of decodes replays a CUDA graph captured for its batch-size and
  context-length bucket (cuda_graphs.py); steps with prefill or extend work run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.runtime import rows
from shared.runtime.attention import SpanAttention, StepAttention, decode_context
from shared.runtime.batch import Batch, pack
from shared.runtime.cuda_graphs import DecodeGraphs
from shared.runtime.fused import FusedDecoder, invariant_reason, unsupported_reason
from shared.runtime.kv_pool import KVPool
from shared.runtime.mirror import DecodeMirror
from shared.runtime.sequence import Sequence

DEFAULT_MIRROR_BYTES = 1 << 30  # CPU decode mirror budget; 0 turns it off
logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    logits: torch.Tensor  # [len(sampled), vocab], float32, on the host
    sampled: list[Sequence]  # sequences whose step reached their last known token


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        *,
        cuda_graphs: bool | None = None,
        fused: bool | None = None,
        mirror_bytes: int | None = None,
        invariant: bool | None = None,
    ) -> None:
        """`cuda_graphs`: replay decode steps from CUDA graphs (default: on when the pool is on a GPU and
        the fused decoder runs the model).
        `fused`: the fused layer loop (default: when the model supports it). `mirror_bytes`: the
        CPU decode mirror's budget (default 1 GiB; 0 = gather every step).
        `invariant`: batch-invariant kernels (default: on where `fused.invariant_reason` finds none
        against them; a model on CPU that cannot run them is logged with why)."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        cuda = self.device.type == "cuda"
        reason = unsupported_reason(model)
        if fused and reason:
            raise ValueError(f"fused=True, but the fused decoder does not support this model: {reason}")
        use_fused = fused if fused is not None else reason is None
        self.invariant = self._invariant(invariant, use_fused, cuda)
        self.decoder = FusedDecoder.for_model(model, self.invariant) if use_fused else None
        budget = DEFAULT_MIRROR_BYTES if mirror_bytes is None else mirror_bytes
        self.mirror = DecodeMirror(pool, budget) if budget > 0 and not cuda and not self.invariant else None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graphs = None
        if cuda_graphs and not cuda:
            raise ValueError("cuda_graphs=True needs the pool on a CUDA device")
        if cuda_graphs and self.decoder is None:
            raise ValueError("CUDA graphs need the fused decoder (a Llama-family model)")
        if cuda_graphs or (cuda_graphs is None and cuda and self.decoder is not None):
            self.graphs = DecodeGraphs(self.decoder, pool)

    def _invariant(self, asked: bool | None, fused: bool, cuda: bool) -> bool:
        if asked is False or (asked is None and cuda):
            return False
        reason = invariant_reason(self.model) if fused else "the fused loop is off"
        if reason is None and not rows.supports(1, 1, 16, self.pool.dtype):
            reason = f"a {self.pool.dtype} KV pool"
        if reason is None:
            return True
        if asked:
            raise ValueError(f"invariant=True, but the batch-invariant kernels cannot run here: {reason}")
        logger.warning("batch-invariant kernels off (%s): a row's tokens may depend on its batch", reason)
        return False

    @torch.inference_mode()
    def forward(self, work: list[tuple[Sequence, int]], after_layer: Callable[[int], None] | None = None) -> StepResult:
        """The step's logits; `after_layer(i)` once layer i's KV is in the pool, where the fused
        decoder runs the step (a streaming prefill's last chunk leaves layer by layer)."""
        if not work:
            raise ValueError("forward() needs at least one sequence")
        batch = pack(work, self.pool)
        if self.graphs is not None and not batch.spans:
            logits = self.graphs.run(batch)
            if logits is not None:
                return StepResult(logits=logits, sampled=batch.sampled)
        step = self.plan(batch)
        try:
            hidden = self.hidden(batch, step, after_layer)
        except BaseException:
            if self.mirror is not None:
                self.mirror.clear()  # its rows may hold half a step
            raise
        if not batch.logit_rows:
            return StepResult(logits=torch.empty(0), sampled=[])
        if len(batch.logit_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(batch.logit_rows, device=self.device))
        return StepResult(logits=self.logits(hidden).float().cpu(), sampled=batch.sampled)

    def hidden(
        self, batch: Batch, step: StepAttention, after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the step's tokens (final norm left to `logits`)."""
        ids = torch.tensor(batch.ids, device=self.device)
        positions = torch.tensor(batch.positions, device=self.device)
        if self.decoder is not None:
            self.decoder.ensure_positions(max(batch.positions) + 1)
            return self.decoder.forward(ids, positions, step, after_layer)
        out = self.model.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), pdd_step=step)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.decoder is not None:
            return self.decoder.logits(hidden)
        return self.model.lm_head(hidden)  # transformers' forward already applied the final norm

    def plan(self, batch: Batch) -> StepAttention:
        dev = self.device
        step = StepAttention(pool=self.pool, slot_mapping=torch.tensor(batch.slots, device=dev))
        if self.invariant:
            step.row_plan = self._row_plan(batch)
            return step
        step.spans = [self._span(*s) for s in batch.spans]
        if self.mirror is not None:
            for _, seq, start, _ in batch.spans:
                self.mirror.recompute(seq, start)
        if not batch.decodes:
            return step
        if self.mirror is not None:
            step.mirror = self.mirror.prepare(batch.decodes)
            if step.mirror is not None:
                return step
        bs = self.pool.block_size
        nb = max(pos for _, _, pos in batch.decodes) // bs + 1
        tables = self.pool.table_tensor([seq.block_table for _, seq, _ in batch.decodes], nb)
        lengths = torch.tensor([pos + 1 for _, _, pos in batch.decodes])
        ctx, mask = decode_context(tables.to(dev), lengths.to(dev), bs)
        step.decode_q_index = torch.tensor([flat for flat, _, _ in batch.decodes], device=dev)
        step.decode_ctx_slots, step.decode_mask = ctx, mask
        step.buffers = self._gather_buffers(ctx.numel()) if dev.type == "cpu" else None
        return step

    @staticmethod
    def _row_plan(batch: Batch) -> rows.RowAttention:
        """Each flat row's block table and key count: a decode at position p sees p + 1 keys, row i
        of a span from `start` sees start + i + 1."""
        per_row: list[tuple[list[int], int] | None] = [None] * len(batch.ids)
        for flat, seq, pos in batch.decodes:
            per_row[flat] = (seq.block_table, pos + 1)
        for flat, seq, start, end in batch.spans:
            for i in range(end - start):
                per_row[flat + i] = (seq.block_table, start + i + 1)
        return rows.plan(per_row)

    def _span(self, flat: int, seq: Sequence, start: int, end: int) -> SpanAttention:
        n = end - start
        if start == 0:
            return SpanAttention(flat, flat + n, None, None)
        # query i (absolute position start + i) sees keys at positions <= start + i
        mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
        ctx = self.pool.slots(seq.block_table, 0, end)
        return SpanAttention(flat, flat + n, ctx.to(self.device), mask.to(self.device))

    def _gather_buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused K and V gather outputs of at least `tokens` tokens (see `KVPool.read`)."""
        if self._buffers is None or self._buffers[0].shape[0] < tokens:
            shape = (max(tokens, 1024), *self.pool.kv.shape[-2:])
            self._buffers = (torch.empty(shape, dtype=self.pool.dtype), torch.empty(shape, dtype=self.pool.dtype))
        return self._buffers
