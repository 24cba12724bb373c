"""ModelRunner: one flattened forward for any mix of prefill chunks, extends and decodes.

`forward(work)` takes `(sequence, n)` pairs — compute the next `n` known tokens of each
sequence — packs them into `input_ids [1, T]` with explicit positions, builds the paged
attention plan once, runs the model once, and returns next-token logits for the sequences
whose work reaches their last known token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.runtime.attention import SpanAttention, StepAttention
from shared.runtime.kv_pool import KVPool
from shared.runtime.sequence import Sequence


@dataclass
class StepResult:
    logits: torch.Tensor  # [len(sampled), vocab], float32
    sampled: list[Sequence]  # sequences whose step reached their last known token


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device

    @torch.inference_mode()
    def forward(self, work: list[tuple[Sequence, int]]) -> StepResult:
        if not work:
            raise ValueError("forward() needs at least one sequence")
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        decodes: list[tuple[int, torch.Tensor]] = []  # (flat index, context slots)
        spans: list[SpanAttention] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            if n < 1 or end > seq.num_tokens:
                raise ValueError(f"{seq.seq_id}: cannot compute tokens [{start}, {end}) of {seq.num_tokens}")
            flat = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            ctx = self.pool.slots(seq.block_table, 0, end)
            slot_parts.append(ctx[start:])
            if n == 1:
                decodes.append((flat, ctx))
            else:
                spans.append(_span(flat, start, end, ctx))
            if end == seq.num_tokens:
                logit_rows.append(flat + n - 1)
                sampled.append(seq)
        step = StepAttention(
            pool=self.pool,
            slot_mapping=torch.cat(slot_parts).to(self.device),
            spans=[_to(s, self.device) for s in spans],
            **_decode_group(decodes, self.device),
        )
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.tensor([positions], device=self.device)
        hidden = self.model.model(input_ids=input_ids, position_ids=position_ids, pdd_step=step).last_hidden_state
        if not logit_rows:
            return StepResult(logits=torch.empty(0), sampled=[])
        rows = torch.tensor(logit_rows, device=self.device)
        logits = self.model.lm_head(hidden[0, rows]).float().cpu()
        return StepResult(logits=logits, sampled=sampled)


def _span(flat: int, start: int, end: int, ctx: torch.Tensor) -> SpanAttention:
    n = end - start
    if start == 0:
        return SpanAttention(flat, flat + n, ctx, None)
    # query i (absolute position start + i) sees keys at positions <= start + i
    q_pos = torch.arange(start, end).unsqueeze(1)
    k_pos = torch.arange(end).unsqueeze(0)
    return SpanAttention(flat, flat + n, ctx, k_pos <= q_pos)


def _to(span: SpanAttention, device: torch.device) -> SpanAttention:
    mask = None if span.mask is None else span.mask.to(device)
    return SpanAttention(span.q_start, span.q_end, span.ctx_slots.to(device), mask)


def _decode_group(decodes: list[tuple[int, torch.Tensor]], device: torch.device) -> dict:
    if not decodes:
        return {"decode_q_index": None, "decode_ctx_slots": None, "decode_mask": None}
    lmax = max(len(ctx) for _, ctx in decodes)
    slots = torch.zeros(len(decodes), lmax, dtype=torch.long)
    mask = torch.zeros(len(decodes), 1, 1, lmax, dtype=torch.bool)
    for i, (_, ctx) in enumerate(decodes):
        slots[i, : len(ctx)] = ctx
        mask[i, 0, 0, : len(ctx)] = True
    index = torch.tensor([flat for flat, _ in decodes])
    return {
        "decode_q_index": index.to(device),
        "decode_ctx_slots": slots.to(device),
        "decode_mask": mask.to(device),
    }
