"""Paged KV pool: one preallocated tensor per instance, handed out by block.

Layout `[layers, 2 (K/V), slots, kv_heads, head_dim]` with `slots = num_blocks * block_size`.
A sequence owns a *block table* (list of block ids); token position `p` lives in slot
`table[p // block_size] * block_size + p % block_size`. Blocks carry reference counts so a
cached prefix can be shared by several sequences (and by the radix cache); a block returns to
the free list when its last reference is dropped.

The pool has one owner (the engine that drives it); nothing here is thread-safe on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
            raise PoolExhausted(
                f"KV pool exhausted: need {n} blocks, {len(self._free)} of {self.num_blocks} free"
            )
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
        shape = (layout.num_layers, 2, num_blocks * block_size, layout.kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)

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

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V `[n, kv_heads, head_dim]` at `slots`, converting dtype on the way."""
        self.kv[layer, 0, slots] = k.to(self.dtype)
        self.kv[layer, 1, slots] = v.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S), as `[*S, kv_heads, head_dim]`. A flat index_select
        is several times faster than advanced indexing with a 2-D slot tensor."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.kv.shape[-2:])
        kv = self.kv[layer]
        return kv[0].index_select(0, flat).view(shape), kv[1].index_select(0, flat).view(shape)
