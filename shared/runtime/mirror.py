"""Decode mirror: each decoding sequence's KV kept contiguous, so decode attention needs no gather.

Why: on CPU a decode step at batch B must read B contexts of KV per layer. Reading them out of the
paged pool takes a gather (a copy) per layer and then a second pass to attend: twice the memory
traffic, growing with B while the weights' traffic does not. The mirror keeps a copy of each
decoding sequence's KV in one row of a dense tensor per layer:

    kt [layers, rows, kv_heads, head_dim, capacity]   (K transposed: Q @ K^T is a plain matmul)
    v  [layers, rows, kv_heads, capacity, head_dim]

so a layer's decode attention is one `baddbmm` (scores plus the length mask), one softmax and one
`bmm` over the step's range of rows, reading them in place. A step writes each new token's K/V to
the pool (the source of truth) and to its row; a row is filled from the pool when its sequence
first decodes (or after something invalidated it), so a context is copied once, not every step.

Rows: a sequence keeps its row while it decodes; a row unused for `IDLE_STEPS` steps is freed and
new sequences take the lowest free row, so the rows of a step stay a dense range. Rows inside the
range that are not in the step are computed with a one-key mask and their output is dropped. A
row is trusted only for positions it saw written: it is cut back when its sequence is recomputed
from an earlier position (a rewind, then a prefill chunk or extend: `recompute`), when the
sequence's block table changed, or when `KVPool.write` (KV imported from elsewhere) touched one
of its blocks. The runner clears the mirror when a step fails half-way.

Cost: memory, `rows x capacity` tokens of KV in float32, bounded by `budget_bytes` (the pool's
own capacity does not count it); a step that does not fit falls back to the gather path. The
memory is advised for huge pages (`zeros`): a step's K writes land 4 x capacity bytes apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.runtime import memory
from shared.runtime.kv_pool import KVPool
from shared.runtime.sequence import Sequence

CAPACITY_STEP = 128  # rows grow by whole multiples of this many tokens
IDLE_STEPS = 8  # a row unused for this many steps is freed
MIRROR_DTYPE = torch.float32  # keeps softmax and both matmuls in fp32 whatever the pool holds
HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor, on a CPU in memory the kernel may back with 2 MB pages (transparent huge
    pages, `madvise` mode). A step writes one position of every row's transposed K: one float
    per (row, head, dim), each 4 bytes x capacity apart, so on 4 KB pages every one of them is a
    TLB miss (at batch 16, 3072 per layer). Under 2 MB: `torch.zeros`."""
    if memory.nbytes(shape, dtype) < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    return memory.zeros(shape, dtype, device, huge_pages=True)


@dataclass
class _Row:
    seq: Sequence
    n: int = 0  # positions [0, n) hold the sequence's KV
    blocks: tuple[int, ...] = ()  # the block-table prefix those positions came from
    last_step: int = 0


@dataclass
class MirrorStep:
    """One step's decode plan over rows [lo, hi); `used_*` describe the rows that decode now."""

    mirror: DecodeMirror
    lo: int
    hi: int
    lmax: int
    q_index: torch.Tensor  # [hi - lo] flat index of each row's query (0 for rows not in the step)
    used_rows: torch.Tensor  # [B] absolute row ids
    used_flat: torch.Tensor  # [B] their tokens' flat indices
    used_pos: torch.Tensor  # [B] their tokens' positions
    bias: torch.Tensor | None  # [(hi - lo) * KVH, 1, lmax] 0 / -inf; None when all rows see lmax keys
    layout: str  # "identity": row r is flat token r; "full": every row decodes; "sparse"

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float):
        self.mirror.attend(self, layer, q, k, v, out, scale)


class DecodeMirror:
    def __init__(self, pool: KVPool, budget_bytes: int) -> None:
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.log = pool.track_writes()
        self.rows: list[_Row | None] = []
        self.kt: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.steps = 0

    @property
    def nbytes(self) -> int:
        """Memory the mirror holds now (it grows up to `budget_bytes` and keeps its size)."""
        return 0 if self.kt is None else self.kt.nbytes + self.v.nbytes

    def clear(self) -> None:
        self.rows, self.kt, self.v = [], None, None

    def recompute(self, seq: Sequence, start: int) -> None:
        """The step recomputes `seq` from `start` (a prefill chunk or extend, through the pool only):
        its row, if any, is trusted below `start` only (a rewound sequence may get new tokens there)."""
        for row in self.rows:
            if row is not None and row.seq is seq:
                row.n = min(row.n, start)

    def prepare(self, decodes: list[tuple[int, Sequence, int]]) -> MirrorStep | None:
        """Rows for this step's decodes `(flat index, sequence, position)`, filled up to each position;
        None (and an empty mirror) when they would not fit in the budget."""
        self.steps += 1
        dirty = self.log.take()
        self._free_idle()
        index = {id(r.seq): i for i, r in enumerate(self.rows) if r is not None}
        used = []
        for flat, seq, pos in decodes:
            i = index.get(id(seq))
            if i is None:
                i = self._new_row(seq)
            row = self.rows[i]
            if tuple(seq.block_table[: len(row.blocks)]) != row.blocks or not dirty.isdisjoint(row.blocks):
                row.n, row.blocks = 0, ()
            row.n, row.last_step = min(row.n, pos), self.steps  # a rewound sequence recomputes from pos
            used.append((i, flat, pos))
        used = self._compact(used)
        lo, hi = min(i for i, _, _ in used), max(i for i, _, _ in used) + 1
        lmax = max(pos for _, _, pos in used) + 1
        table_tokens = max(len(seq.block_table) for _, seq, _ in decodes) * self.pool.block_size
        if not self._reserve(hi, lmax, table_tokens):
            self.clear()
            return None
        self._fill(used)
        return self._plan(used, lo, hi, lmax)

    # -- rows ------------------------------------------------------------------------------
    def _free_idle(self) -> None:
        for i, row in enumerate(self.rows):
            if row is not None and self.steps - row.last_step > IDLE_STEPS:
                self.rows[i] = None
        while self.rows and self.rows[-1] is None:
            self.rows.pop()

    def _new_row(self, seq: Sequence) -> int:
        i = next((i for i, r in enumerate(self.rows) if r is None), len(self.rows))
        if i == len(self.rows):
            self.rows.append(None)
        self.rows[i] = _Row(seq)
        return i

    def _compact(self, used: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Move the step's highest rows into free rows below them when a quarter of its range would
        be rows it does not use (computed for nothing every layer); a move copies the row's KV once."""
        ids = sorted(i for i, _, _ in used)
        if ids[-1] + 1 - ids[0] <= len(ids) + len(ids) // 4:
            return used
        free = [j for j, r in enumerate(self.rows[: ids[-1]]) if r is None]
        moved: dict[int, int] = {}
        for i in reversed(ids):
            if not free or free[0] >= i:
                break
            j = free.pop(0)
            if self.rows[i].n:
                self.kt[:, j, :, :, : self.rows[i].n] = self.kt[:, i, :, :, : self.rows[i].n]
                self.v[:, j, :, : self.rows[i].n] = self.v[:, i, :, : self.rows[i].n]
            self.rows[j], self.rows[i], moved[i] = self.rows[i], None, j
        return [(moved.get(i, i), flat, pos) for i, flat, pos in used]

    def _reserve(self, rows: int, tokens: int, table_tokens: int) -> bool:
        """Room for `rows` rows of `tokens` positions; False when over the budget. Grows by half again
        (tokens: up to what the block tables can hold), since each growth copies the whole mirror."""
        have_rows, have_tokens = (0, 0) if self.kt is None else (self.kt.shape[1], self.kt.shape[-1])
        if rows <= have_rows and tokens <= have_tokens:
            return True
        layout = self.pool.layout
        item = torch.empty((), dtype=MIRROR_DTYPE).element_size()
        per_token = layout.num_layers * 2 * layout.kv_heads * layout.head_dim * item

        def size(r: int, t: int) -> tuple[int, int]:
            return max(r, have_rows), max(-(-t // CAPACITY_STEP) * CAPACITY_STEP, have_tokens)

        new_rows, new_tokens = size(max(rows, have_rows * 3 // 2), max(tokens, min(have_tokens * 3 // 2, table_tokens)))
        if new_rows * new_tokens * per_token > self.budget_bytes:
            new_rows, new_tokens = size(rows, tokens)
            if new_rows * new_tokens * per_token > self.budget_bytes:
                return False
        shape = (layout.num_layers, new_rows, layout.kv_heads)
        # zeros, not empty: keys past a row's length are read (then masked) and must be finite
        kt = zeros((*shape, layout.head_dim, new_tokens), MIRROR_DTYPE, self.pool.device)
        v = zeros((*shape, new_tokens, layout.head_dim), MIRROR_DTYPE, self.pool.device)
        if self.kt is not None:
            kt[:, :have_rows, :, :, :have_tokens] = self.kt
            v[:, :have_rows, :, :have_tokens] = self.v
        self.kt, self.v = kt, v
        return True

    def _fill(self, used: list[tuple[int, int, int]]) -> None:
        """Copy positions [row.n, pos) of every used row from the pool: one gather for all of them."""
        parts, spans = [], []
        bs = self.pool.block_size
        for i, _, pos in used:
            row = self.rows[i]
            if row.n < pos:
                parts.append(self.pool.slots(row.seq.block_table, row.n, pos))
                spans.append((i, row.n, pos))
            row.n, row.blocks = pos + 1, tuple(row.seq.block_table[: -(-(pos + 1) // bs)])
        if not parts:
            return
        kv = self.pool.kv.index_select(2, torch.cat(parts).to(self.pool.device)).to(MIRROR_DTYPE)
        at = 0
        for i, start, end in spans:
            n = end - start
            self.kt[:, i, :, :, start:end] = kv[:, 0, at : at + n].permute(0, 2, 3, 1)
            self.v[:, i, :, start:end] = kv[:, 1, at : at + n].transpose(1, 2)
            at += n

    def _plan(self, used: list[tuple[int, int, int]], lo: int, hi: int, lmax: int) -> MirrorStep:
        q_index, lengths = [0] * (hi - lo), [1] * (hi - lo)  # rows not in the step: one key, output dropped
        for i, flat, pos in used:
            q_index[i - lo], lengths[i - lo] = flat, pos + 1
        bias = None
        if min(lengths) < lmax:
            keep = torch.arange(lmax) < torch.tensor(lengths).unsqueeze(1)  # [rows, lmax]
            bias = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
            bias = bias.repeat_interleave(self.pool.layout.kv_heads, dim=0).unsqueeze(1).to(self.pool.device)
        layout = "sparse"
        if len(used) == hi - lo:
            layout = "identity" if lo == 0 and q_index == list(range(hi)) else "full"
        dev = self.pool.device
        return MirrorStep(
            mirror=self,
            lo=lo,
            hi=hi,
            lmax=lmax,
            q_index=torch.tensor(q_index, device=dev),
            used_rows=torch.tensor([i for i, _, _ in used], device=dev),
            used_flat=torch.tensor([f for _, f, _ in used], device=dev),
            used_pos=torch.tensor([p for _, _, p in used], device=dev),
            bias=bias,
            layout=layout,
        )

    # -- the layer call --------------------------------------------------------------------
    def attend(
        self,
        step: MirrorStep,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """Write the decode tokens' K/V into their rows, attend rows [lo, hi), put the result in `out`."""
        lo, hi, lmax, n = step.lo, step.hi, step.lmax, step.hi - step.lo
        _, heads, dim = q.shape
        kv_heads = k.shape[1]
        if step.layout == "identity":
            qr, kn, vn = q[:n], k[:n], v[:n]
        else:
            qr = q.index_select(0, step.q_index)
            kn, vn = k.index_select(0, step.used_flat), v.index_select(0, step.used_flat)
        if self.pool.dtype != MIRROR_DTYPE:  # the row holds what the pool holds, as a gather would read it
            kn, vn = kn.to(self.pool.dtype), vn.to(self.pool.dtype)
        self.kt[layer][step.used_rows, :, :, step.used_pos] = kn.to(MIRROR_DTYPE)
        self.v[layer][step.used_rows, :, step.used_pos] = vn.to(MIRROR_DTYPE)
        kt = self.kt[layer, lo:hi, :, :, :lmax].reshape(n * kv_heads, dim, lmax)
        vv = self.v[layer, lo:hi, :, :lmax].reshape(n * kv_heads, lmax, dim)
        qh = qr.reshape(n * kv_heads, heads // kv_heads, dim).to(MIRROR_DTYPE)
        if step.bias is None:
            scores = torch.bmm(qh, kt).mul_(scale)
        else:
            scores = torch.baddbmm(step.bias, qh, kt, alpha=scale)
        o = torch.bmm(torch.softmax(scores, dim=-1), vv).view(n, heads, dim).to(out.dtype)
        if step.layout == "identity":
            out[:n] = o
        elif step.layout == "full":
            out.index_copy_(0, step.q_index, o)
        else:
            out.index_copy_(0, step.used_flat, o.index_select(0, step.used_rows - lo))
