"""Paged attention for a flattened variable-length batch.

One forward carries the new tokens of every running sequence as one flat batch of T tokens with
explicit positions. `attend(step, layer, q, k, v, scale)` is called once per layer — by the
runtime's fused layer loop (fused.py), or through transformers' `AttentionInterface` for other
models (`paged_attention`) — with the projected, rotated Q/K/V of all T tokens. It

1. writes the new K/V into the paged pool at each token's slot, then
2. attends each sequence's queries over that sequence's own context in the pool:
   - all single-token sequences (decode steps) together, either
     * from the decode mirror (mirror.py, CPU): every decoding sequence's KV kept contiguous, so
       one batched matmul per layer reads it in place and nothing is gathered per step, or
     * by ONE gather of the padded contexts (into reused buffers) and one SDPA call, where each
       KV head's G query heads are G query rows (no GQA expansion of K/V);
   - every multi-token span (prefill chunk, extend) in its own causal SDPA call; a span with no
     cached prefix attends over the freshly projected K/V without a gather.

Batch-invariant runs (the runner's `invariant`, the CPU default) take neither path: every row of
the step, decode or span, is attended by rows.c over the pool in place (`StepAttention.row_plan`),
with one fixed order of operations per row (rows.py).

Everything index-like is computed once per step in `StepAttention` (the runner builds it; a CUDA
graph builds the decode part from static block tables with `decode_context`); the per-layer work
is tensor ops only, with no host synchronisation, so a decode step can be captured as a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from shared.runtime import rows
from shared.runtime.kv_pool import KVPool

if TYPE_CHECKING:
    from shared.runtime.mirror import MirrorStep

ATTN_IMPLEMENTATION = "pdd_paged"


@dataclass
class SpanAttention:
    """A multi-token span of new queries: tokens [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    ctx_slots: torch.Tensor | None  # [L] slots of the whole context, new tokens last; None when uncached
    mask: torch.Tensor | None  # [n, L] bool, None when the span has no cached prefix

    @property
    def uncached(self) -> bool:
        return self.mask is None


@dataclass
class StepAttention:
    """Per-step attention plan shared by all layers."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_q_index: torch.Tensor | None = None  # [B] flat index of each single-token sequence (gather path)
    decode_ctx_slots: torch.Tensor | None = None  # [B, Lmax] context slots, padded with the scratch slot
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] True where a key is real
    spans: list[SpanAttention] | None = None
    mirror: MirrorStep | None = None  # decodes served by the mirror instead of the gather
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # reused gather output (CPU)
    row_plan: rows.RowAttention | None = None  # batch-invariant: every row through rows.c (nothing above)


def decode_context(tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context slots `[B, nb * block_size]` and key mask `[B, 1, 1, nb * block_size]` of B sequences
    from their block tables `[B, nb]` and context lengths `[B]`, with tensor ops only."""
    b, nb = tables.shape
    offsets = torch.arange(block_size, device=tables.device)
    slots = (tables.unsqueeze(-1) * block_size + offsets).view(b, nb * block_size)
    keys = torch.arange(nb * block_size, device=tables.device)
    return slots, (keys < lengths.unsqueeze(-1)).view(b, 1, 1, -1)


def attend(
    step: StepAttention, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of T new tokens: q `[T, H, D]`, k/v `[T, KVH, D]` (views are fine) -> `[T, H, D]`."""
    step.pool.store(layer, step.slot_mapping, k, v)
    if step.row_plan is not None:
        kv = step.pool.kv[layer]
        return rows.attend(q, kv[0], kv[1], step.row_plan, step.pool.block_size, scale).to(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if step.mirror is not None:
        step.mirror.attend(layer, q, k, v, out, scale)
    elif step.decode_q_index is not None:
        _attend_decodes(step, layer, q, out, scale)
    for span in step.spans or ():
        _attend_span(span, step.pool, layer, q, k, v, out, scale)
    return out


def _attend_decodes(step: StepAttention, layer: int, q: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    idx = step.decode_q_index
    b, (_, h, d) = idx.numel(), q.shape
    kv_heads = step.pool.layout.kv_heads
    qd = q.index_select(0, idx).view(b, kv_heads, h // kv_heads, d)  # G query heads of a KV head = G rows
    k, v = step.pool.read(layer, step.decode_ctx_slots, out=step.buffers)  # [B, Lmax, KVH, D]
    k = k.to(q.dtype).transpose(1, 2)
    v = v.to(q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=step.decode_mask, scale=scale)
    out.index_copy_(0, idx, o.reshape(b, h, d))


def _attend_span(
    span: SpanAttention,
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    s, e = span.q_start, span.q_end
    qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if span.uncached:
        ks, vs = k[s:e].transpose(0, 1).unsqueeze(0), v[s:e].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kc, vc = pool.read(layer, span.ctx_slots)  # [L, KVH, D]
        kc = kc.to(q.dtype).transpose(0, 1).unsqueeze(0)
        vc = vc.to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=span.mask, scale=scale, enable_gqa=True)
    out[s:e] = o[0].transpose(0, 1)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: query `[1, H, T, D]`, key/value `[1, KVH, T, D]` -> `[1, T, H, D]`."""
    step: StepAttention = kwargs["pdd_step"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return attend(step, module.layer_idx, q, k, v, scale).unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The paged kernel builds its own masks; skip transformers' [T, T] mask."""
    return None


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


register()
