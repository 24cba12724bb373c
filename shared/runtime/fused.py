"""The runtime's own layer loop for Llama-family models (Llama, Mistral, Qwen2, Qwen3).

transformers' forward spends ~60 small tensor ops per layer (separate q/k/v/gate/up projections,
a rotate_half with two cats per tensor, an RMSNorm in seven ops, mask and cache plumbing); at a
decode step, where every op touches a few KB, that is a third of the step. `FusedDecoder` runs the
same math from the model's own weights with about 20 ops per layer. Per layer, for the T new
tokens of a step (`h [T, hidden]`):

1. RMSNorm, then ONE projection to q|k|v (the three weights concatenated): `[T, (H + 2 KVH) D]`;
   Qwen3 normalises q and k per head here;
2. RoPE on q and k in place: `x * cos + swap_halves(x) * sin_signed` (cos/sin looked up once per
   step from tables built with the model's own rotary module; bit-identical to transformers');
3. `attention.attend`: the new K/V into the pool, each sequence over its own context;
4. o projection + residual; RMSNorm; ONE projection to gate|up; silu(gate) * up; down + residual.

The final norm and LM head run only on the rows whose logits are wanted (`logits`).

On CPU the projections run on weights laid out once for one of two kernels ("packed"):

- skinny.c (`skinny.py`), the runtime's own fp32 GEMM for the few rows of a decode step: it reads
  each weight once per step for up to 12 rows. A SmolLM2 step's projections on the 2-core Intel
  Xeon host, at 1 / 8 / 16 rows: skinny 18.2 / 20.6 / 24.9 ms, oneDNN packed 24.1 / 29.6 / 36.3,
  MKL (`F.linear`) 20.0 / 47.3 / 46.5; at prefill sizes (512, 2048 rows) the three were equal.
- oneDNN with its blocked layout: on the AMD EPYC hosts it read weights near full bandwidth at
  1..16 rows where MKL read them at a third, and ran prefill 2x faster than MKL.

Each decoder picks when it is built, on its own weights and at the engine's thread count
(`_choose_packed_kernel`: skinny.c where it builds here and times faster on the first layers at
a batched decode step, without making a prefill chunk much slower), then times plain `F.linear`
against the packed weights at 1-3 rows (`_choose_small_step_kernel`) and runs steps of up to
`Dense.plain_rows` rows through it (MKL's one-row GEMM beat oneDNN's on the Intel host). Both
take about a second.
One packed copy is kept beside the concatenated weights; the model's modules are pointed at slices
of those (transformers' forward and the plain kernel share them), as on a GPU, where nothing else
is kept.

`FusedDecoder.for_model` caches one decoder per model, since engines come and go around a model.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from time import perf_counter

import torch
import torch.nn.functional as F

from shared.runtime import skinny
from shared.runtime.attention import StepAttention, attend

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at load
PACK_BATCH_HINT = 16  # oneDNN picks its weight layout for this many rows; fine from 1 to prefill sizes
SMALL_STEPS = (1, 2, 3)  # step sizes at which plain F.linear may beat the packed weights
PROBE_LIMIT_S = 0.25  # a model whose projections take longer per step keeps the packed weights untimed
PROBE_LAYERS = 8  # layers whose weights time skinny.c against oneDNN
PROBE_ROWS = (8, 256)  # the step sizes they are timed at: a batched decode step, a prefill chunk
SKINNY_MAX_ROWS = 128  # under skinny.c, bigger steps (prefill chunks) take plain F.linear (MKL)
PREFILL_SLACK = 1.25  # skinny.c is kept unless that makes prefill this much slower (MKL: 2x on AMD EPYC)
_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
logger = logging.getLogger(__name__)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fused loop cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE_TYPES:
        return f"rope type {rope!r}"
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and cfg.sliding_window):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "sliding-window layers"
    return None


class Dense:
    """`x @ W.T + b` for one or several nn.Linear layers, their outputs concatenated."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        weights = [lin.weight.detach() for lin in linears]
        self.sizes = [w.shape[0] for w in weights]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        biases = [lin.bias for lin in linears]
        self.bias = None
        if any(b is not None for b in biases):
            parts = [b.detach() if b is not None else weight.new_zeros(n) for b, n in zip(biases, self.sizes)]
            self.bias = torch.cat(parts)
        self.weight = weight
        if len(linears) > 1:  # the model's modules become views of the concatenation: one copy
            for lin, part in zip(linears, weight.split(self.sizes)):
                lin.weight.data = part
        self.kernel: str | None = None  # what `packed` is laid out for: "skinny", "onednn", None
        self.packed: torch.Tensor | None = None
        self.plain_rows = 0  # inputs of at most this many rows skip the packed weights

    def pack(self, kernel: str) -> None:
        """Lay the weight out for `kernel` ("skinny" where it takes this weight, else "onednn"; the
        layout of another kernel is dropped first, so at most one packed copy is held)."""
        self.packed = self.kernel = None
        if kernel == "skinny" and skinny.supports(self.weight):
            self.packed, self.kernel = skinny.pack(self.weight), "skinny"
            return
        self.packed = _pack(self.weight)
        self.kernel = None if self.packed is None else "onednn"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is None or rows <= self.plain_rows or (self.kernel == "skinny" and rows > SKINNY_MAX_ROWS):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self)


def _packed_linear(x: torch.Tensor, dense: Dense) -> torch.Tensor:
    if dense.kernel == "skinny":
        return skinny.linear(x, dense.packed, dense.bias)
    return torch.ops.mkldnn._linear_pointwise(x, dense.packed, dense.bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout (CPU, fp32/bf16), or None where that does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: plain F.linear
        return None


def _probe(denses: list[Dense], rows: int) -> float:
    """Seconds to run `rows` rows through every dense, each on its own input width."""
    inputs = {n: torch.full((rows, n), 0.01, dtype=denses[0].weight.dtype) for n in {d.weight.shape[1] for d in denses}}
    start = perf_counter()
    for d in denses:
        d(inputs[d.weight.shape[1]])
    return perf_counter() - start


def _choose_packed_kernel(layers: list[list[Dense]]) -> tuple[str, str]:
    """The kernel for the packed weights, and why: "skinny" where skinny.c builds here and, on the
    first `PROBE_LAYERS` layers' own weights packed both ways, ran a batched decode step
    (`PROBE_ROWS[0]`) 5% faster than oneDNN's packed weights, and a prefill chunk (`PROBE_ROWS[1]`;
    under skinny.c plain `F.linear`) at most `PREFILL_SLACK` times slower; else "onednn". The
    best of three alternating runs each way. Untimed ("onednn") where one sample step takes longer
    than `PROBE_LIMIT_S`."""
    sample = [d for layer in layers[:PROBE_LAYERS] for d in layer if skinny.supports(d.weight)]
    if not sample:
        return "onednn", "no weight the skinny kernel takes (fp32 on CPU, outputs a multiple of 32)"
    reason = skinny.unavailable_reason()
    if reason is not None:
        return "onednn", f"skinny kernel unavailable: {reason}"
    layouts = {}
    for kernel in ("onednn", "skinny"):  # both held while timing: ~112 MB each for SmolLM2
        for d in sample:
            d.pack(kernel)
        layouts[kernel] = [(d.packed, d.kernel) for d in sample]

    def timed(kernel: str, rows: int) -> float:
        for d, (packed, kind) in zip(sample, layouts[kernel]):
            d.packed, d.kernel = packed, kind
        return _probe(sample, rows)

    try:
        if any(timed(kernel, PROBE_ROWS[0]) > PROBE_LIMIT_S for kernel in layouts):
            return "onednn", "too large to time"
        best = {(r, k): min(timed(k, r) for _ in range(3)) for r in PROBE_ROWS for k in layouts}
    finally:
        for d in sample:
            d.packed = d.kernel = None
    decode, prefill = PROBE_ROWS
    won = (
        best[decode, "skinny"] <= 0.95 * best[decode, "onednn"]
        and best[prefill, "skinny"] <= PREFILL_SLACK * best[prefill, "onednn"]
    )
    figures = ", ".join(
        f"{r} rows {best[r, 'skinny'] * 1e3:.1f} vs {best[r, 'onednn'] * 1e3:.1f} ms" for r in PROBE_ROWS
    )
    return ("skinny" if won else "onednn"), f"skinny against oneDNN on {len(sample)} weights: {figures}"


def _choose_small_step_kernel(denses: list[Dense]) -> None:
    """Set on every `Dense` the most rows (0..3) up to which a step's projections ran faster
    through plain `F.linear` than through the packed weights, timed here on these weights (the best
    of three alternating runs each way; plain must win by 5%). 0 where nothing is packed, or where
    one step's projections take longer than `PROBE_LIMIT_S` (they stay packed, untimed)."""
    if any(d.packed is None for d in denses):
        return

    def step(rows: int, plain: bool) -> float:
        for d in denses:
            d.plain_rows = rows if plain else 0
        return _probe(denses, rows)

    chosen = 0
    step(1, False)  # warm-up
    if step(1, False) <= PROBE_LIMIT_S:
        step(1, True)  # warm-up
        for rows in SMALL_STEPS:
            runs = [(plain, step(rows, plain)) for _ in range(3) for plain in (True, False)]
            plain, packed = (min(t for p, t in runs if p == side) for side in (True, False))
            if plain > 0.95 * packed:
                break
            chosen = rows
    for d in denses:
        d.plain_rows = chosen


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # the fused kernel equals transformers' RMSNorm exactly in fp32
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()  # transformers' order of operations, so bf16 rounding matches
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Dense
    o: Dense
    gate_up: Dense
    down: Dense
    q_norm: torch.Tensor | None  # Qwen3
    k_norm: torch.Tensor | None


class FusedDecoder:
    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused decoder does not support this model: {reason}")
        cfg, inner = model.config, model.model
        attn0 = inner.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn0.head_dim
        self.scale = float(attn0.scaling)
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        with torch.no_grad():
            self.layers = [_layer(layer) for layer in inner.layers]
            self.lm_head = Dense([model.lm_head])
            per_layer = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in self.layers]
            self._denses = [d for denses in per_layer for d in denses] + [self.lm_head]
            self.kernel, self.kernel_note = _choose_packed_kernel(per_layer)
            self.use_kernel(self.kernel)
        if any(d.packed is not None for d in self._denses):  # CPU; on a GPU nothing is packed
            logger.info("fused decoder: %s kernel for packed weights (%s)", self.kernel, self.kernel_note)
        self.rotary = inner.rotary_emb
        self.source = _source(model)
        self.cos: torch.Tensor | None = None  # [positions, D]
        self.sin: torch.Tensor | None = None  # sin with its first half negated (see `_rope`)
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def use_kernel(self, kernel: str) -> None:
        """Pack every weight for `kernel` ("skinny" or "onednn"), then time plain `F.linear` against
        it for small steps again (`plain_rows`). Raises `skinny.Unavailable` for "skinny" where
        skinny.c cannot be built."""
        if kernel == "skinny":
            skinny.load()
        with torch.no_grad():
            for d in self._denses:
                d.pack(kernel)
            _choose_small_step_kernel(self._denses)
        self.kernel = kernel

    @property
    def plain_rows(self) -> int:
        """Steps of at most this many rows run their projections through plain `F.linear`."""
        return self.lm_head.plain_rows

    @plain_rows.setter
    def plain_rows(self, rows: int) -> None:
        for d in self._denses:
            d.plain_rows = rows

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> FusedDecoder:
        """The model's cached decoder, rebuilt if the model moved or changed dtype since (`.to()`)."""
        decoder = _decoders.get(model)
        if decoder is None or decoder.source != _source(model):
            decoder = _decoders[model] = cls(model)
        return decoder

    def ensure_positions(self, n: int) -> None:
        """RoPE tables for positions [0, n) at least, grown by doubling. Old tables stay referenced:
        a CUDA graph captured their addresses (another runner may grow the tables it shares)."""
        if self.cos is not None and self.cos.shape[0] >= n:
            return
        if self.cos is not None:  # captured graphs may read the old tables: keep them alive
            self._retired.append((self.cos, self.sin))
        n = max(n, 2 * (0 if self.cos is None else self.cos.shape[0]), 1024)
        pos = torch.arange(n, device=self.embed.device).unsqueeze(0)
        cos, sin = self.rotary(self.embed[:1], pos)  # the model's own rotary module: same values
        half = self.head_dim // 2
        self.cos = cos[0]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """Hidden states `[T, hidden]` (before the final norm) of the flat batch `ids [T]`."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        h = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, cos, sin, step)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(hidden, self.norm, self.eps))

    def _layer(
        self, i: int, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepAttention
    ) -> torch.Tensor:
        t, (nh, nkv, d) = h.shape[0], (self.heads, self.kv_heads, self.head_dim)
        qkv = layer.qkv(rms_norm(h, layer.ln1, self.eps))
        if layer.q_norm is None:
            _rope(qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d), cos, sin)  # q and k in one go
            q, k = qkv[:, : nh * d].view(t, nh, d), qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d)
        else:
            q = _rope(rms_norm(qkv[:, : nh * d].view(t, nh, d), layer.q_norm, self.eps), cos, sin)
            k = _rope(rms_norm(qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d), layer.k_norm, self.eps), cos, sin)
        v = qkv[:, (nh + nkv) * d :].view(t, nkv, d)
        a = attend(step, i, q, k, v, self.scale)
        h = h + layer.o(a.view(t, nh * d))
        gate, up = layer.gate_up(rms_norm(h, layer.ln2, self.eps)).split(layer.gate_up.sizes, dim=-1)
        return h + layer.down(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == swap(x) * sin_signed
    exactly (IEEE negation commutes with the product), and the same add as transformers."""
    half = x.shape[-1] // 2
    rot = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return x.mul_(cos).add_(rot)


def _source(model: torch.nn.Module) -> tuple:
    """What the cached decoder was built from: the embedding's storage, dtype and device."""
    w = model.model.embed_tokens.weight
    return w.data_ptr(), w.dtype, w.device


def _layer(block: torch.nn.Module) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return _Layer(
        ln1=block.input_layernorm.weight.detach(),
        ln2=block.post_attention_layernorm.weight.detach(),
        qkv=Dense([attn.q_proj, attn.k_proj, attn.v_proj]),
        o=Dense([attn.o_proj]),
        gate_up=Dense([mlp.gate_proj, mlp.up_proj]),
        down=Dense([mlp.down_proj]),
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
    )
