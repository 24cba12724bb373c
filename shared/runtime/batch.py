"""A step's work flattened into one batch (`pack`): what the runner and the CUDA graphs read."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.runtime.kv_pool import KVPool
from shared.runtime.sequence import Sequence


@dataclass
class Batch:
    """A step's work flattened: token t of the batch is `ids[t]` at `positions[t]`, stored at `slots[t]`."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decodes: list[tuple[int, Sequence, int]] = field(default_factory=list)  # (flat index, sequence, position)
    spans: list[tuple[int, Sequence, int, int]] = field(default_factory=list)  # (flat index, sequence, start, end)
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)


def pack(work: list[tuple[Sequence, int]], pool: KVPool) -> Batch:
    batch = Batch()
    for seq, n in work:
        start, end = seq.num_computed, seq.num_computed + n
        if n < 1 or end > seq.num_tokens:
            raise ValueError(f"{seq.seq_id}: cannot compute tokens [{start}, {end}) of {seq.num_tokens}")
        flat = len(batch.ids)
        batch.ids.extend(seq.token_ids[start:end])
        batch.positions.extend(range(start, end))
        batch.slots.extend(pool.slot_list(seq.block_table, start, end))
        if n == 1:
            batch.decodes.append((flat, seq, start))
        else:
            batch.spans.append((flat, seq, start, end))
        if end == seq.num_tokens:
            batch.logit_rows.append(flat + n - 1)
            batch.sampled.append(seq)
    return batch
