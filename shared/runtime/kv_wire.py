"""KV on the wire: the sender narrows each layer to a wire format, the receiver restores it.

After the prefix caches, the width of each KV element is the next lever on the WAN (the
network-KV literature, e.g. CacheGen, cuts KV bytes 3.5-4.3x with little quality loss):

    native   what the receiver stores, bit for bit (float32 into a bfloat16 pool: bf16, link_wire)
    bf16     bfloat16: exact from a bf16 pool, 2x narrower than fp32
    fp8      float8 e4m3, one float32 scale per token and head (amax / 448)
    int8     int8, one float32 scale per token and head (amax / 127), rounded to nearest

A layer on the wire is K then V, `[2, tokens, kv_heads, head_dim]` elements, then (fp8, int8)
their scales `[2, tokens, kv_heads]` as float32. Decoding gives float32 (or the native dtype);
the receiver's pool converts it to its own precision on import.
"""

from __future__ import annotations

import torch

from shared.model_info import WIRE_FORMATS, wire_bytes

__all__ = ["WIRE_FORMATS", "decode_layer", "encode_layer", "layer_bytes"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCALED = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}


layer_bytes = wire_bytes  # one home for the arithmetic: shared/model_info.py (no torch there)


def encode_layer(k: torch.Tensor, v: torch.Tensor, wire: str) -> bytes:
    """One layer's K and V as `wire` bytes (k, v: `[tokens, kv_heads, head_dim]`)."""
    if wire in ("native", "bf16"):  # one pass: each into its half, converted on the way
        both = torch.empty((2, *k.shape), dtype=k.dtype if wire == "native" else torch.bfloat16)
        both[0].copy_(k)
        both[1].copy_(v)
        return both.view(torch.uint8).numpy().tobytes()
    both = torch.stack([k.contiguous(), v.contiguous()])
    kind, top = _SCALED[wire]
    x = both.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / top).clamp(min=torch.finfo(torch.float32).tiny)
    q = x / scale
    q = q.round().clamp(-top, top).to(kind) if kind == torch.int8 else q.to(kind)
    return q.view(torch.uint8).numpy().tobytes() + scale.numpy().tobytes()


def decode_layer(
    data: bytes | bytearray | memoryview, tokens: int, kv_heads: int, head_dim: int, dtype: str, wire: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V from `wire` bytes: the native dtype, or float32 for the narrowed ones."""
    expected = layer_bytes(tokens, kv_heads, head_dim, dtype, wire)
    if len(data) != expected:
        raise ValueError(f"KV layer frame has {len(data)} bytes, expected {expected}")
    shape = (2, tokens, kv_heads, head_dim)
    if not tokens:  # the receiver already held the whole prompt: nothing but the header travels
        empty = torch.empty(shape[1:], dtype=DTYPES[dtype] if wire == "native" else torch.float32)
        return empty, empty
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if wire in ("native", "bf16"):
        both = raw.view(DTYPES[dtype] if wire == "native" else torch.bfloat16).view(shape)
        return both[0], both[1]
    kind, _ = _SCALED[wire]
    n = 2 * tokens * kv_heads * head_dim
    q = raw[:n].view(kind).view(shape).float()
    scale = raw[n:].view(torch.float32).view(2, tokens, kv_heads, 1)
    both = q * scale
    return both[0], both[1]
