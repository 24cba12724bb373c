"""Mooncake FAST'25 traces, rescaled to a small model's context.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`,
each hash id naming one 512-token block of the prompt (equal ids, equal blocks: shared
prefixes). The rescaled request:
1. every full 512-token block becomes `block_tokens` token ids drawn from an RNG keyed by
   (seed, hash id), so equal hash ids give equal blocks and equal leading ids equal prefixes;
2. the rest of `input_length` (a partial last block, or blocks the line has no id for) is scaled
   by the same ratio and drawn from an RNG keyed by (seed, line index): never shared;
3. `max_tokens = max(1, round(output_length * output_scale))`, at most `max_context - 1`; a
   prompt that would not leave room for it is cut at the end (its prefix, hence its sharing,
   survives);
4. `arrival_s = timestamp / 1000 * time_scale`.
Requests are in completion form (`prompt_ids`), kind "trace", outside any session.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workload_model import BenchRequest, Workload

MOONCAKE_BLOCK = 512
# A trace in this format kept in the repository (3,993 requests over 17 minutes): the fleet experiments replay it.
MOONCAKE_TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_trace.jsonl"
FIRST_TOKEN_ID = 100  # keep clear of special tokens at the bottom of the vocabulary


class BlockTokens:
    """hash id -> its `block_tokens` token ids; memoised, deterministic from (seed, hash id)."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int) -> None:
        if block_tokens < 1 or vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"block_tokens={block_tokens} must be >= 1, vocab_size={vocab_size} > {FIRST_TOKEN_ID}")
        self.block_tokens, self.vocab_size, self.seed = block_tokens, vocab_size, seed
        self._blocks: dict[int, list[int]] = {}

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(n)]

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = self.ids(random.Random(f"{self.seed}:block:{hash_id}"), self.block_tokens)
        return self._blocks[hash_id]

    def prompt(self, index: int, hash_ids: tuple[int, ...], length: int) -> list[int]:
        """`length` tokens: the blocks of `hash_ids`, then a tail unique to line `index` (cut to `length`)."""
        tokens = [t for h in hash_ids for t in self.block(h)]
        tail = self.ids(random.Random(f"{self.seed}:tail:{index}"), max(0, length - len(tokens)))
        return (tokens + tail)[:length]


def read_trace(path: str | Path, max_requests: int | None = None) -> list[dict]:
    """The first `max_requests` lines (all when None) of a Mooncake JSONL trace."""
    rows = []
    with open(path) as f:
        for line in f:
            if max_requests is not None and len(rows) >= max_requests:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


@dataclass(frozen=True)
class TraceLine:
    """One trace line, rescaled (steps 1-4 of the module docstring) but not yet made of tokens:
    `pdd bench` draws token ids for it (`trace`), the simulator names its blocks (sim/workload.py)."""

    index: int  # line number in the file
    arrival_s: float
    prompt_tokens: int  # after the cut that leaves room for the answer
    max_tokens: int
    hash_ids: tuple[int, ...]  # the line's full 512-token blocks, `block_tokens` tokens each once rescaled
    block_tokens: int

    @property
    def kept_blocks(self) -> int:
        """The full blocks that survive the cut: the prompt's shareable prefix."""
        return min(len(self.hash_ids), self.prompt_tokens // self.block_tokens)


def rescale(
    path: str | Path,
    *,
    block_tokens: int = 16,
    time_scale: float = 1.0,
    output_scale: float = 1.0,
    max_requests: int | None = None,
    max_context: int = 8192,
) -> list[TraceLine]:
    """Every line (the first `max_requests`) of a Mooncake trace, rescaled, in file order."""
    if max_context < 2:
        raise ValueError(f"max_context={max_context} leaves no room for a prompt and an answer")
    out = []
    for i, row in enumerate(read_trace(path, max_requests)):
        max_tokens = min(max(1, round(row["output_length"] * output_scale)), max_context - 1)
        target = max(1, round(row["input_length"] * block_tokens / MOONCAKE_BLOCK))
        full = min(len(row["hash_ids"]), row["input_length"] // MOONCAKE_BLOCK)
        out.append(
            TraceLine(
                i,
                row["timestamp"] / 1000 * time_scale,
                min(target, max_context - max_tokens),
                max_tokens,
                tuple(row["hash_ids"][:full]),
                block_tokens,
            )
        )
    return out


def trace(
    path: str | Path,
    *,
    block_tokens: int = 16,
    time_scale: float = 1.0,
    output_scale: float = 1.0,
    max_requests: int | None = None,
    max_context: int = 8192,
    vocab_size: int = 49152,
    seed: int = 0,
) -> Workload:
    """A Mooncake trace as a workload (see the module docstring for the rescaling)."""
    lines = rescale(
        path,
        block_tokens=block_tokens,
        time_scale=time_scale,
        output_scale=output_scale,
        max_requests=max_requests,
        max_context=max_context,
    )
    blocks = BlockTokens(block_tokens, vocab_size, seed)
    requests = []
    for line in lines:
        prompt = blocks.prompt(line.index, line.hash_ids, line.prompt_tokens)
        requests.append(
            BenchRequest(f"tr-{line.index:06d}", "", 0, line.arrival_s, line.max_tokens, "trace", prompt_ids=prompt)
        )
    requests.sort(key=lambda r: r.arrival_s)
    lengths = [len(r.prompt_ids or []) for r in requests]
    params = {
        "path": str(path),
        "block_tokens": block_tokens,
        "time_scale": time_scale,
        "output_scale": output_scale,
        "max_requests": max_requests,
        "max_context": max_context,
        "vocab_size": vocab_size,
    }
    stats = {
        "est_mean_prompt_tokens": round(sum(lengths) / max(1, len(lengths)), 1),
        "est_max_prompt_tokens": max(lengths, default=0),
        "mean_max_tokens": round(sum(r.max_tokens for r in requests) / max(1, len(requests)), 1),
    }
    return Workload(f"trace:{Path(path).name}", requests, seed, params, stats)
