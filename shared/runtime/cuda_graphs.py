"""Decode steps replayed from CUDA graphs, one graph per (batch-size bucket, context bucket).

Why: an eager decode step is hundreds of small kernel launches (about 20 per layer); on a GPU
they cost more than the work (an 8B-shape step measured 36 ms at batch 1 on an H200 against a
~4 ms weight-read floor). A graph replays the whole step as one launch.

A graph has fixed shapes, so a step of B decodes with longest context L runs in the graph of
bucket (Bk >= B, Lk >= L): B rounded up to the next of `BATCH_BUCKETS`, L to a multiple of
`CONTEXT_STEP`. Its static inputs are token ids, positions and new-token slots `[Bk]`, block
tables `[Bk, Lk / block_size]` and context lengths `[Bk]`; the graph derives the context slots
and key mask itself (`attention.decode_context`), gathers the contexts, and returns logits
`[Bk, vocab]`. Padding rows decode token 0 at position 0 into the pool's scratch block, with a
context of one scratch key, so they never touch a sequence's KV and never produce NaNs.

Graphs are captured lazily, the first time a bucket is needed, into one shared memory pool (they
never run concurrently). Capture needs the RoPE tables at their final size: they are built for
every position the pool can hold before the first capture.

`capture=False` runs the same static-shape step eagerly: the padding and bucketing logic can be
tested on CPU, where there are no graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.runtime.attention import StepAttention, decode_context
from shared.runtime.batch import Batch
from shared.runtime.fused import FusedDecoder
from shared.runtime.kv_pool import KVPool

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CONTEXT_STEP = 256  # tokens; a multiple of any block size in use


@dataclass
class _Graph:
    ids: torch.Tensor  # [Bk] static inputs ...
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor  # [Bk, Lk / block_size]
    lengths: torch.Tensor  # [Bk]
    run: Callable[[], torch.Tensor]  # capture=False: the eager step
    logits: torch.Tensor | None = None  # [Bk, vocab] static output of the graph
    graph: torch.cuda.CUDAGraph | None = None

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    def __init__(
        self, decoder: FusedDecoder, pool: KVPool, capture: bool | None = None, max_batch: int | None = None
    ) -> None:
        self.decoder = decoder
        self.pool = pool
        self.device = pool.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.max_batch = max_batch or BATCH_BUCKETS[-1]
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        # every position a sequence in this pool can reach, so the tables never move after a capture
        self.max_context = self.pool.num_blocks * self.pool.block_size
        self.decoder.ensure_positions(self.max_context + CONTEXT_STEP)

    def bucket(self, batch: int, context: int) -> tuple[int, int] | None:
        """(Bk, Lk) for B decodes with longest context `context`; None when B is over the largest bucket."""
        bk = next((b for b in BATCH_BUCKETS if b >= batch), None)
        if bk is None or bk > self.max_batch:
            return None
        return bk, -(-context // CONTEXT_STEP) * CONTEXT_STEP

    def run(self, batch: Batch) -> torch.Tensor | None:
        """Logits `[len(batch.logit_rows), vocab]` (float32, host) of an all-decode step, or None if
        no bucket fits it (the runner then runs it eagerly)."""
        contexts = [pos + 1 for _, _, pos in batch.decodes]
        key = self.bucket(len(contexts), max(contexts))
        if key is None:
            return None
        graph = self.graphs.get(key) or self._build(*key)
        self._load(graph, batch)
        logits = graph.replay()
        rows = torch.tensor(batch.logit_rows, device=self.device)
        return logits.index_select(0, rows).float().cpu()

    def _load(self, g: _Graph, batch: Batch) -> None:
        """Copy the step into the graph's static inputs; rows past the batch keep their padding."""
        scratch = self.pool.scratch_slot
        n, (bk, nb) = len(batch.decodes), g.tables.shape
        tables = self.pool.table_tensor([seq.block_table for _, seq, _ in batch.decodes], nb, rows=bk)
        lengths = torch.ones(g.lengths.shape[0], dtype=torch.long)
        lengths[:n] = torch.tensor([pos + 1 for _, _, pos in batch.decodes])
        pad = g.ids.shape[0] - n
        ids = torch.tensor(batch.ids + [0] * pad)
        positions = torch.tensor(batch.positions + [0] * pad)
        slots = torch.tensor(batch.slots + [scratch] * pad)
        pairs = ((g.ids, ids), (g.positions, positions), (g.slots, slots), (g.tables, tables), (g.lengths, lengths))
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    def _build(self, bk: int, lk: int) -> _Graph:
        bs, dev, scratch = self.pool.block_size, self.device, self.pool.scratch_slot

        def full(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.long, device=dev)

        g = _Graph(
            ids=full((bk,), 0),
            positions=full((bk,), 0),
            slots=full((bk,), scratch),
            tables=full((bk, lk // bs), scratch // bs),
            lengths=full((bk,), 1),
            run=lambda: None,
        )
        q_index = torch.arange(bk, device=dev)

        def step() -> torch.Tensor:
            ctx, mask = decode_context(g.tables, g.lengths, bs)
            plan = StepAttention(self.pool, g.slots, q_index, ctx, mask, spans=[])
            return self.decoder.logits(self.decoder.forward(g.ids, g.positions, plan))

        g.run = step
        if self.capture:
            self._capture(g)
        self.graphs[(bk, lk)] = g
        return g

    def _capture(self, g: _Graph) -> None:
        # the recipe of torch.cuda.graphs' docs: warm up on a side stream (allocator, cuBLAS
        # workspaces, kernel selection), then capture into the shared memory pool
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                g.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            g.logits = g.run()
        g.graph = graph
