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
from pathlib import Path

from benchmarks.workload_model import BenchRequest, Workload

MOONCAKE_BLOCK = 512
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

    def prompt(self, index: int, input_length: int, hash_ids: list[int]) -> list[int]:
        full = min(len(hash_ids), input_length // MOONCAKE_BLOCK)
        tokens = [t for h in hash_ids[:full] for t in self.block(h)]
        target = max(1, round(input_length * self.block_tokens / MOONCAKE_BLOCK))
        tail = self.ids(random.Random(f"{self.seed}:tail:{index}"), max(0, target - len(tokens)))
        return tokens + tail


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
    if max_context < 2:
        raise ValueError(f"max_context={max_context} leaves no room for a prompt and an answer")
    blocks = BlockTokens(block_tokens, vocab_size, seed)
    requests = []
    for i, row in enumerate(read_trace(path, max_requests)):
        max_tokens = min(max(1, round(row["output_length"] * output_scale)), max_context - 1)
        prompt = blocks.prompt(i, row["input_length"], row["hash_ids"])[: max_context - max_tokens]
        arrival = row["timestamp"] / 1000 * time_scale
        requests.append(BenchRequest(f"tr-{i:06d}", "", 0, arrival, max_tokens, "trace", prompt_ids=prompt))
    requests.sort(key=lambda r: r.arrival_s)
    lengths = [len(r.prompt_ids or []) for r in requests]
    params = {"path": str(path), "block_tokens": block_tokens, "time_scale": time_scale, "output_scale": output_scale,
              "max_requests": max_requests, "max_context": max_context, "vocab_size": vocab_size}  # fmt: skip
    stats = {"est_mean_prompt_tokens": round(sum(lengths) / max(1, len(lengths)), 1),
             "est_max_prompt_tokens": max(lengths, default=0),
             "mean_max_tokens": round(sum(r.max_tokens for r in requests) / max(1, len(requests)), 1)}  # fmt: skip
    return Workload(f"trace:{Path(path).name}", requests, seed, params, stats)
