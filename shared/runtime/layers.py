"""A step's decoder layers in one C call (layers.c), for the batch-invariant fused decoder.

The fused loop (fused.py) runs ~25 tensor ops per layer around the kernels; at a decode step
each costs more in dispatch than in arithmetic. `Layers` hands the whole stack to layers.c, which
runs the same math with skinny.c's projections and rows.c's norms and attention, one ctypes call
per step. It takes the plain Llama layer: no projection bias, no per-head q/k norm, silu;
`unsupported_reason` says why a decoder keeps the Python loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from shared.runtime import rows, skinny

SOURCE = Path(__file__).with_name("layers.c")
ABI = 1
PROFILER_NAME = "pdd::run_layers"
PER_CALL = 5  # layers per call where a step's KV leaves as its layers are computed (`run`'s `after_layer`)

_P = ctypes.c_void_p


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in ("layers", "hidden", "H", "KVH", "D", "inter", "weights_bf16")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, ctypes.POINTER(_P)) for name in ("qkv", "o", "gate_up", "down", "ln1", "ln2")),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("h", _P),
        ("T", ctypes.c_int),
        ("cos", _P),
        ("sin", _P),
        ("slots", _P),
        ("pool", _P),
        ("pool_bf16", ctypes.c_int),
        ("pool_slots", ctypes.c_int64),
        ("tables", _P),
        ("table_at", _P),
        ("lens", _P),
        ("block", ctypes.c_int),
        ("threads", ctypes.c_int),
    ]


def unsupported_reason(decoder) -> str | None:
    """Why layers.c cannot run this fused decoder's layers (None: it can)."""
    if not decoder.invariant:
        return "not a batch-invariant decoder"
    for layer in decoder.layers:
        if layer.q_norm is not None:
            return "per-head q/k norms"
        if any(d.bias is not None for d in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return "a projection bias"
        if len(set(layer.gate_up.sizes)) != 1:
            return "gate and up of different widths"
    return _load()[1]


class Layers:
    """The decoder's layers as layers.c's model: built once (pointers into the decoder's packed
    weights, which it keeps), run per step."""

    def __init__(self, decoder, run=None) -> None:
        """`run`: another build's `run_layers` (`bind`), else this machine's."""
        layers = decoder.layers
        n = len(layers)

        def pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
            return (_P * n)(*(t.data_ptr() for t in tensors))

        self._arrays = [
            pointers([getattr(layer, name).packed for layer in layers]) for name in ("qkv", "o", "gate_up", "down")
        ]
        self._arrays += [pointers([layer.ln1 for layer in layers]), pointers([layer.ln2 for layer in layers])]
        casts = [ctypes.cast(a, ctypes.POINTER(_P)) for a in self._arrays]
        self.model = _Model(
            n,
            decoder.embed.shape[1],
            decoder.heads,
            decoder.kv_heads,
            decoder.head_dim,
            layers[0].gate_up.sizes[0],
            int(layers[0].qkv.packed.dtype == torch.bfloat16),
            decoder.eps,
            decoder.scale,
            *casts,
        )
        self._run = run or _load()[0]
        self._groups: list[tuple[int, _Model]] | None = None

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Every layer over the step's rows: h `[T, hidden]` fp32 (updated in place and returned),
        cos/sin `[T, head_dim]` at each row's position, the step's pool slots and row plan.
        `after_layer(i)`, when given, runs once layer i's KV is in the pool: the layers then go
        `PER_CALL` to a call (a model of those layers, the pool from the first on), the same math.
        Not one call each: the engine thread takes the GIL back after every call, and waits for it
        while the event loop encodes and sends (a 50-token step: 148 ms one call, 157 ms one call
        per layer beside a busy Python thread)."""
        plan, pool = step.row_plan, step.pool
        cos, sin = cos.contiguous(), sin.contiguous()
        s = _Step(
            h.data_ptr(), h.shape[0], cos.data_ptr(), sin.data_ptr(), step.slot_mapping.data_ptr(),
            pool.kv.data_ptr(), int(pool.dtype == torch.bfloat16), pool.kv.shape[2],
            plan.tables.data_ptr(), plan.table_at.data_ptr(), plan.lens.data_ptr(),
            pool.block_size, torch.get_num_threads(),
        )  # fmt: skip
        if after_layer is None:
            self._call(self.model, s)
            return h
        base, layer_bytes = pool.kv.data_ptr(), pool.kv.stride(0) * pool.kv.element_size()
        for first, model in self._group_models():
            s.pool = base + first * layer_bytes
            self._call(model, s)
            for i in range(first, first + model.layers):
                after_layer(i)
        return h

    def _call(self, model: _Model, s: _Step) -> None:
        if rows._call(PROFILER_NAME, self._run, ctypes.byref(model), ctypes.byref(s)):
            raise MemoryError("layers.c could not allocate its buffers for the step")

    def _group_models(self) -> list[tuple[int, _Model]]:
        """Layers [i, i + PER_CALL) as layers.c's model (their weights' pointers: elements i... of
        each array), with i, for every i a multiple of PER_CALL."""
        if self._groups is None:
            m, size = self.model, ctypes.sizeof(_P)
            fields = [getattr(m, name) for name in ("hidden", "H", "KVH", "D", "inter", "weights_bf16", "eps", "scale")]
            self._groups = [
                (
                    i,
                    _Model(
                        min(PER_CALL, m.layers - i),
                        *fields,
                        *(ctypes.cast(ctypes.addressof(a) + i * size, ctypes.POINTER(_P)) for a in self._arrays),
                    ),
                )
                for i in range(0, m.layers, PER_CALL)
            ]
        return self._groups


def bind(library: Path):
    """`run_layers` of a built library, typed for ctypes."""
    lib = ctypes.CDLL(str(library))
    if lib.layers_abi() != ABI:
        raise OSError(f"{library.name} has ABI {lib.layers_abi()}, this module calls {ABI}")
    fn = lib.run_layers
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    return fn


@cache
def _load():
    return skinny.load_built(SOURCE, bind)
