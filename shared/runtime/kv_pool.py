"""Paged KV pool: one preallocated tensor per instance, handed out by block.

On a CPU the tensor is a mapping the kernel commits page by page as blocks are first written
(shared/runtime/memory.py): the allocator hands out the lowest free ids first and reuses freed
blocks first, so an instance's memory follows the most blocks it has held, not its capacity.

Layout `[layers, 2 (K/V), slots, kv_heads, head_dim]` with `slots = (num_blocks + 1) * block_size`.
A sequence owns a *block table* (list of block ids); token position `p` lives in slot
`table[p // block_size] * block_size + p % block_size`. Blocks carry reference counts so a
cached prefix can be shared by several sequences (and by the radix cache); a block returns to
the free list when its last reference is dropped.

The tensor holds one block more than the allocator hands out: the *scratch* block. Padded rows of
a fixed-shape step (a CUDA graph bucket) write their K/V there and read it as context, so padding
never touches a sequence's KV.

Writes from outside the runner's own step (`write`: KV imported from another instance) can be
logged by block (`track_writes`): the runner's decode mirror (shared/runtime/mirror.py) copies
KV out of the pool and must know when a copy went stale. The step's own writes go through
`store`, which is not logged: the mirror is updated alongside them.

On a GPU, `export_tokens` / `import_tokens` move the KV of a token range for all layers in one
device gather and ONE copy through pinned host memory (instead of a synchronising copy per layer).

The pool has one owner (the engine that drives it); nothing here is thread-safe on purpose.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from shared.runtime import memory


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more blocks than are free. Nothing is allocated."""


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV: what a sender and a receiver must agree on."""

    num_layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.head_dim * itemsize


@dataclass
class WriteLog:
    """Blocks written through `KVPool.write` since the subscriber last took them."""

    blocks: set[int] = field(default_factory=set)

    def take(self) -> set[int]:
        blocks, self.blocks = self.blocks, set()
        return blocks


class BlockAllocator:
    """Free list plus reference counts. Block ids are ints in [0, num_blocks)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"KV pool exhausted: need {n} blocks, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"incref of free block {b}")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the free list."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class KVPool:
    """The KV tensor and its block allocator."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        # one extra block past the allocator's range: the scratch block (see the module docstring)
        shape = (layout.num_layers, 2, (num_blocks + 1) * block_size, layout.kv_heads, layout.head_dim)
        self.kv = memory.zeros(shape, dtype, self.device)  # on a CPU: resident as blocks are first written
        self.scratch_slot = num_blocks * block_size
        self._logs: list[weakref.ref[WriteLog]] = []  # subscribers to `write` (see `track_writes`)

    @classmethod
    def with_capacity(
        cls,
        layout: KVLayout,
        *,
        tokens: int | None = None,
        bytes_: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """Size the pool by token count or by bytes (exactly one of them)."""
        if (tokens is None) == (bytes_ is None):
            raise ValueError("give the KV pool capacity as exactly one of tokens or bytes")
        if tokens is None:
            tokens = bytes_ // layout.bytes_per_token(dtype)
        num_blocks = tokens // block_size
        if num_blocks < 1:
            raise ValueError(f"KV capacity {tokens} tokens is below one block of {block_size}")
        return cls(layout, num_blocks, block_size, dtype, device)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of every token position in [start, end) of a sequence."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        if end > len(block_table) * self.block_size:
            raise ValueError(f"positions up to {end} exceed the block table ({len(block_table)} blocks)")
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_list(self, block_table: list[int], start: int, end: int) -> list[int]:
        """`slots` as Python ints: cheaper than tensor ops for the handful of new tokens of a step."""
        if end > len(block_table) * self.block_size:
            raise ValueError(f"positions up to {end} exceed the block table ({len(block_table)} blocks)")
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def table_tensor(self, tables: list[list[int]], num_blocks: int, rows: int | None = None) -> torch.Tensor:
        """Block tables as `[rows, num_blocks]`, cut or padded with the scratch block (so are extra rows)."""
        out = torch.full((rows or len(tables), num_blocks), self.scratch_slot // self.block_size, dtype=torch.long)
        for i, table in enumerate(tables):
            used = table[:num_blocks]
            out[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        return out

    # -- writes ----------------------------------------------------------------------------
    def track_writes(self) -> WriteLog:
        """A log of the blocks `write` / `import_tokens` touch from now on (one per subscriber)."""
        log = WriteLog()
        self._logs.append(weakref.ref(log))
        return log

    def _log_writes(self, slots: torch.Tensor) -> None:
        logs = [log for ref in self._logs if (log := ref()) is not None]
        if len(logs) != len(self._logs):
            self._logs = [weakref.ref(log) for log in logs]
        if logs and slots.numel():
            blocks = torch.unique(slots.reshape(-1).cpu() // self.block_size).tolist()
            for log in logs:
                log.blocks.update(blocks)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V `[n, kv_heads, head_dim]` at `slots`, converting dtype on the way. Logged."""
        self._log_writes(slots)
        self.store(layer, slots, k, v)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` without tracking: the runner's own step (its mirror sees the same values)."""
        self.kv[layer, 0, slots] = k.to(self.dtype)
        self.kv[layer, 1, slots] = v.to(self.dtype)

    # -- reads ----------------------------------------------------------------------------
    def read(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S), as `[*S, kv_heads, head_dim]`. A flat index_select
        is several times faster than advanced indexing with a 2-D slot tensor. `out` (two flat
        buffers of at least S tokens) reuses memory: a fresh multi-MB result per layer costs page
        faults on CPU that took longer than the copy itself at batch 16."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.kv.shape[-2:])
        kv = self.kv[layer]
        if out is None:
            return kv[0].index_select(0, flat).view(shape), kv[1].index_select(0, flat).view(shape)
        n = flat.numel()
        k_out, v_out = out[0][:n], out[1][:n]
        torch.index_select(kv[0], 0, flat, out=k_out)
        torch.index_select(kv[1], 0, flat, out=v_out)
        return k_out.view(shape), v_out.view(shape)

    # -- whole-range transfers (all layers at once) ---------------------------------------
    def export_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """KV of `slots` for every layer, `[layers, 2, n, kv_heads, head_dim]`, on the host.
        On a GPU: one gather on the device, one copy into pinned memory, one synchronisation."""
        kv = self.kv.index_select(2, slots.to(self.device))
        if self.device.type != "cuda":
            return kv
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)  # cached by torch's host allocator
        host.copy_(kv, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def import_tokens(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write `[layers, 2, n, kv_heads, head_dim]` (any dtype, any device) at `slots`. Logged.
        Pageable host memory is staged through a pinned buffer so the upload is one async copy."""
        self._log_writes(slots)
        if self.device.type == "cuda" and kv.device.type == "cpu" and not kv.is_pinned():
            kv = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True).copy_(kv)
        kv = kv.to(self.device, non_blocking=True).to(self.dtype)
        self.kv.index_copy_(2, slots.to(self.device), kv)
