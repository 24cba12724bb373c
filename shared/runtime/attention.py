"""Paged attention for a flattened variable-length batch, plugged into transformers.

One model forward carries the new tokens of every running sequence as a batch of one
(`input_ids [1, T]`, explicit `position_ids`). transformers calls `paged_attention` once per
layer with the projected, rotated Q/K/V of all T tokens. It

1. writes the new K/V into the paged pool at each token's slot, then
2. attends each sequence's queries over that sequence's own context in the pool:
   - all single-token sequences (decode steps) in one padded SDPA call,
   - every multi-token span (prefill chunk, extend) in its own causal SDPA call; a span with no
     cached prefix attends over the freshly projected K/V without a gather.

Everything index-like is computed once per step in `StepAttention` (the runner builds it);
the per-layer work is tensor ops only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from shared.runtime.kv_pool import KVPool

ATTN_IMPLEMENTATION = "pdd_paged"


@dataclass
class SpanAttention:
    """A multi-token span of new queries: tokens [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    ctx_slots: torch.Tensor  # [L] slots of the whole context, new tokens last
    mask: torch.Tensor | None  # [n, L] bool, None when the span has no cached prefix

    @property
    def uncached(self) -> bool:
        return self.mask is None


@dataclass
class StepAttention:
    """Per-step attention plan shared by all layers."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_q_index: torch.Tensor | None  # [B] flat index of each single-token sequence
    decode_ctx_slots: torch.Tensor | None  # [B, Lmax] context slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] True where a key is real
    spans: list[SpanAttention]


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
    step: StepAttention = kwargs["pdd_step"]
    layer = module.layer_idx
    pool = step.pool
    # query [1, H, T, D]; key/value [1, KVH, T, D]
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    pool.write(layer, step.slot_mapping, new_k, new_v)
    out = torch.empty_like(query)
    if step.decode_q_index is not None:
        _attend_decodes(step, layer, query, out, scaling)
    for span in step.spans:
        _attend_span(span, pool, layer, query, key, value, out, scaling)
    return out.transpose(1, 2), None


def _attend_decodes(
    step: StepAttention, layer: int, query: torch.Tensor, out: torch.Tensor, scaling: float | None
) -> None:
    idx = step.decode_q_index
    q = query[0, :, idx].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
    k, v = step.pool.read(layer, step.decode_ctx_slots)  # [B, Lmax, KVH, D]
    k = k.to(q.dtype).transpose(1, 2)
    v = v.to(q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=step.decode_mask, scale=scaling, enable_gqa=True)
    out[0, :, idx] = o.squeeze(2).transpose(0, 1)


def _attend_span(
    span: SpanAttention,
    pool: KVPool,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scaling: float | None,
) -> None:
    s, e = span.q_start, span.q_end
    q = query[:, :, s:e]
    if span.uncached:
        k, v = key[:, :, s:e], value[:, :, s:e]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        k, v = pool.read(layer, span.ctx_slots)  # [L, KVH, D]
        k = k.to(q.dtype).transpose(0, 1).unsqueeze(0)
        v = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling, enable_gqa=True)
    out[:, :, s:e] = o


def _no_mask(*args, **kwargs) -> None:
    """The paged kernel builds its own masks; skip transformers' [T, T] mask."""
    return None


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


register()
