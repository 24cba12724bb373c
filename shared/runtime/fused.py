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

The projections (`Dense`, dense.py) run on weights laid out once for skinny.c, the runtime's own
fp32 GEMM for decode steps, or for oneDNN, whichever timed faster on the model's own weights when
the decoder was built; one packed copy is kept beside the concatenated weights, and the model's
modules are pointed at slices of those (transformers' forward and the plain kernel share them),
as on a GPU, where nothing else is kept.

Batch-invariant (`invariant=True`, the default on CPU where the kernels build: see runner.py):
every projection through skinny.c (fp32 or bf16 weights, fp32 sums, at every row count), RMSNorm
and attention through rows.c, activations in fp32 whatever the weights' dtype. A row's bits then
do not depend on its batch, the thread count, or whether it is a decode step, an extend or a
prefill chunk (`invariant_reason` says why a model cannot run so). Where layers.c takes the
model (the plain Llama layer: no bias, no q/k norm), the whole stack runs there in one C call per
step (layers.py), not as ~25 tensor ops per layer: a batch-1 bf16 step 22.7 -> 13.8 ms on our
2-core Intel host. Every invariant forward then takes it, so all still agree bit for bit.

`FusedDecoder.for_model` caches one decoder per model, since engines come and go around a model.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.runtime import layers as c_layers
from shared.runtime import rows, skinny
from shared.runtime.attention import StepAttention, attend
from shared.runtime.dense import Dense, choose_packed_kernel, choose_small_step_kernel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at load
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


def invariant_reason(model: torch.nn.Module) -> str | None:
    """Why the batch-invariant kernels cannot run this model here (None: they can)."""
    reason = unsupported_reason(model)
    if reason is not None:
        return f"the fused loop does not run it ({reason})"
    w = model.model.embed_tokens.weight
    if w.device.type != "cpu":
        return f"the kernels are for the CPU, the model is on {w.device.type}"
    reason = skinny.unavailable_reason() or rows.unavailable_reason()
    if reason is not None:
        return reason
    cfg, attn = model.config, model.model.layers[0].self_attn
    if not rows.supports(cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim, torch.float32):
        return f"head layout {cfg.num_attention_heads}/{cfg.num_key_value_heads} x {attn.head_dim}"
    if cfg.hidden_size % 16:
        return f"hidden size {cfg.hidden_size} (RMSNorm takes multiples of 16)"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    odd = next((m for m in linears if not skinny.supports(m.weight)), None)
    if odd is not None:
        return f"a {odd.weight.dtype} projection of {odd.weight.shape[0]} outputs (skinny.c takes multiples of 32)"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool = False) -> torch.Tensor:
    if invariant:
        return rows.rms_norm(x, weight, eps)
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
    def __init__(self, model: torch.nn.Module, invariant: bool = False) -> None:
        reason = invariant_reason(model) if invariant else unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused decoder cannot run this model{' invariantly' * invariant}: {reason}")
        cfg, inner = model.config, model.model
        attn0 = inner.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn0.head_dim
        self.scale = float(attn0.scaling)
        self.eps = cfg.rms_norm_eps
        self.invariant = invariant
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = self._norm_weight(inner.norm)
        with torch.no_grad():
            self.layers = [_layer(layer, self._norm_weight) for layer in inner.layers]
            self.lm_head = Dense([model.lm_head])
            per_layer = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in self.layers]
            self._denses = [d for denses in per_layer for d in denses] + [self.lm_head]
            if invariant:  # skinny.c for every row count: nothing timed, nothing on MKL
                self.kernel, self.kernel_note = "skinny", "batch-invariant: every step"
                for d in self._denses:
                    d.invariant = True
                    d.pack("skinny")
            else:
                self.kernel, self.kernel_note = choose_packed_kernel(per_layer)
                self.use_kernel(self.kernel)
        if any(d.packed is not None for d in self._denses):  # CPU; on a GPU nothing is packed
            logger.info("fused decoder: %s kernel for packed weights (%s)", self.kernel, self.kernel_note)
        self.rotary = inner.rotary_emb
        self.source = _source(model)
        self.cos: torch.Tensor | None = None  # [positions, D]
        self.sin: torch.Tensor | None = None  # sin with its first half negated (see `_rope`)
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []
        # batch-invariant: the whole layer stack in one C call where layers.c takes it (every
        # invariant forward then goes through it, so all agree bit for bit)
        self.c_layers: c_layers.Layers | None = None
        self.c_layers_note = c_layers.unsupported_reason(self)
        if self.c_layers_note is None:
            self.c_layers = c_layers.Layers(self)

    def _norm_weight(self, norm: torch.nn.Module | None) -> torch.Tensor | None:
        if norm is None:
            return None
        w = norm.weight.detach()
        return w.float() if self.invariant else w

    def use_kernel(self, kernel: str) -> None:
        """Pack every weight for `kernel` ("skinny" or "onednn"), then time plain `F.linear` against
        it for small steps again (`plain_rows`). Raises `skinny.Unavailable` for "skinny" where
        skinny.c cannot be built."""
        if self.invariant:
            raise ValueError("a batch-invariant decoder runs skinny.c on every step")
        if kernel == "skinny":
            skinny.load()
        with torch.no_grad():
            for d in self._denses:
                d.pack(kernel)
            choose_small_step_kernel(self._denses)
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
    def for_model(cls, model: torch.nn.Module, invariant: bool = False) -> FusedDecoder:
        """The model's cached decoder for this mode (one per mode: a process that runs both, as
        the tests and benches do, builds each once), rebuilt if the model moved or changed dtype
        since (`.to()`)."""
        modes = _decoders.setdefault(model, {})
        decoder = modes.get(invariant)
        if decoder is None or decoder.source != _source(model):
            decoder = modes[invariant] = cls(model, invariant)
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
        like = self.embed[:1].float() if self.invariant else self.embed[:1]
        cos, sin = self.rotary(like, pos)  # the model's own rotary module: same values
        half = self.head_dim // 2
        self.cos = cos[0]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` (before the final norm) of the flat batch `ids [T]`;
        `after_layer(i)` once layer i's KV is in the pool (a streaming prefill's last chunk)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        h = F.embedding(ids, self.embed)
        if self.invariant:
            h = h.float()
        if self.c_layers is not None and step.row_plan is not None:
            return self.c_layers.run(h, cos[:, 0], sin[:, 0], step, after_layer)
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, cos, sin, step)
            if after_layer is not None:
                after_layer(i)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(hidden, self.norm, self.eps, self.invariant))

    def _layer(
        self, i: int, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepAttention
    ) -> torch.Tensor:
        t, (nh, nkv, d), inv = h.shape[0], (self.heads, self.kv_heads, self.head_dim), self.invariant
        qkv = layer.qkv(rms_norm(h, layer.ln1, self.eps, inv))
        if layer.q_norm is None:
            _rope(qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d), cos, sin)  # q and k in one go
            q, k = qkv[:, : nh * d].view(t, nh, d), qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d)
        else:
            q = _rope(rms_norm(qkv[:, : nh * d].view(t, nh, d), layer.q_norm, self.eps, inv), cos, sin)
            k = _rope(rms_norm(qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d), layer.k_norm, self.eps, inv), cos, sin)
        v = qkv[:, (nh + nkv) * d :].view(t, nkv, d)
        a = attend(step, i, q, k, v, self.scale)
        h = h + layer.o(a.view(t, nh * d))
        gate, up = layer.gate_up(rms_norm(h, layer.ln2, self.eps, inv)).split(layer.gate_up.sizes, dim=-1)
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


def _layer(block: torch.nn.Module, norm_weight) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    return _Layer(
        ln1=norm_weight(block.input_layernorm),
        ln2=norm_weight(block.post_attention_layernorm),
        qkv=Dense([attn.q_proj, attn.k_proj, attn.v_proj]),
        o=Dense([attn.o_proj]),
        gate_up=Dense([mlp.gate_proj, mlp.up_proj]),
        down=Dense([mlp.down_proj]),
        q_norm=norm_weight(getattr(attn, "q_norm", None)),
        k_norm=norm_weight(getattr(attn, "k_norm", None)),
    )
