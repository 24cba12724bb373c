"""Batch-invariant attention and RMSNorm on CPU (rows.c), loaded with ctypes.

With skinny.c for every projection, these make a row's result independent of its batch: the
same bits alone or beside fifteen other sequences, with 1 or 2 threads, as a decode step or as
one position of a prefill chunk or an extend (rows.c's header says how). `RowAttention` is one
step's plan: each row's block table and key count, built once per step from the flat batch.
Built like skinny.c (`skinny.build`); where it cannot be, `unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from shared.runtime import skinny

SOURCE = Path(__file__).with_name("rows.c")
ABI = 1
PROFILER_NAME = "pdd::attend_rows"  # torch.profiler's name for the ctypes calls (runtime bench --profile)
NORM_PROFILER_NAME = "pdd::rms_norm_rows"
POOL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class RowAttention:
    """Which keys each of a step's T rows attends: `lens[t]` keys through the block table that
    starts at `table_at[t]` in `tables` (rows of one sequence share it)."""

    tables: torch.Tensor  # int32, the step's block tables concatenated
    table_at: torch.Tensor  # int64 [T]
    lens: torch.Tensor  # int32 [T]


def plan(rows: list[tuple[list[int], int]]) -> RowAttention:
    """From `(block_table, keys)` per row, in flat order; consecutive rows passing the same table
    object (one sequence's chunk) share one copy of it."""
    tables: list[int] = []
    table_at, lens = [], []
    last = None
    for table, keys in rows:
        if table is not last:
            at, last = len(tables), table
            tables.extend(table)
        table_at.append(at)
        lens.append(keys)
    return RowAttention(
        tables=torch.tensor(tables, dtype=torch.int32),
        table_at=torch.tensor(table_at, dtype=torch.int64),
        lens=torch.tensor(lens, dtype=torch.int32),
    )


def supports(heads: int, kv_heads: int, head_dim: int, pool_dtype: torch.dtype) -> bool:
    return (
        head_dim % 16 == 0
        and head_dim <= 256
        and heads % kv_heads == 0
        and heads // kv_heads <= 8
        and (pool_dtype in POOL_DTYPES)
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: RowAttention, block_size: int, scale: float
) -> torch.Tensor:
    """Attention `[T, H, D]` fp32 of q `[T, H, D]` over one layer's pool K/V `[slots, KVH, D]`
    (fp32 or bf16, contiguous), row t seeing `rows.lens[t]` keys of its block table."""
    fn = load().attend_rows
    q = q.float().contiguous()
    t, h, d = q.shape
    kv_heads = k.shape[1]
    if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype and supports(h, kv_heads, d, k.dtype)):
        raise ValueError(f"rows.c takes contiguous fp32/bf16 K/V and head_dim % 16 == 0: {k.dtype} {tuple(k.shape)}")
    if rows.lens.numel() != t:
        raise ValueError(f"{t} query rows but a plan for {rows.lens.numel()}")
    out = torch.empty_like(q)
    args = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
        rows.tables.data_ptr(), rows.table_at.data_ptr(), rows.lens.data_ptr(), out.data_ptr(),
        t, h, kv_heads, d, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if _call(PROFILER_NAME, fn, *args):
        raise MemoryError("rows.c could not allocate its workspace")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (a multiple of 16) of fp32 x, each row on its own; fp32 out."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or shape[-1] % 16:
        raise ValueError(f"rows.c's RMSNorm takes fp32 rows of a multiple of 16: {x.dtype} {tuple(shape)}")
    out = torch.empty_like(x)
    args = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    _call(NORM_PROFILER_NAME, load().rms_norm_rows, *args)
    return out.view(shape)


def _call(name: str, fn, *args) -> int:
    """A ctypes call, recorded by name when torch.profiler runs (it is no torch op)."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


class _Kernels:
    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        if lib.rows_abi() != ABI:
            raise OSError(f"{library.name} has ABI {lib.rows_abi()}, this module calls {ABI}")
        self.attend_rows = lib.attend_rows
        self.attend_rows.restype = ctypes.c_int
        self.attend_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 4
        self.attend_rows.argtypes += [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
        self.rms_norm_rows = lib.rms_norm_rows
        self.rms_norm_rows.restype = ctypes.c_int
        self.rms_norm_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int]


def load() -> _Kernels:
    kernels, reason = _load()
    if kernels is None:
        raise skinny.Unavailable(reason)
    return kernels


def unavailable_reason() -> str | None:
    """None when the kernels are ready, else why not (building them on the first call)."""
    return _load()[1]


@cache
def _load() -> tuple[_Kernels | None, str | None]:
    return skinny.load_built(SOURCE, _Kernels)
