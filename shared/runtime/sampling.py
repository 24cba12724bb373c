"""Sampling: greedy, temperature, top-k, top-p, seeded per request and per step.

A seeded request draws its randomness from a generator seeded by `(seed, step)`, where step
is the number of tokens generated before this one. The draw is a pure function of the logits,
the seed and the step, so an instance that picks a request up mid-way (relay-decode hands it to
main-decode) continues exactly as the first instance would have: only the seed travels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_STEP_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps apart
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def step_seed(seed: int, step: int) -> int:
    return (seed * _STEP_MIX + step * 0x632BE59BD9B4E019 + 1) & _MASK63


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick the next token from one row of logits `[vocab]`."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(step_seed(params.seed, step))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """Sample one token per row; greedy rows share one argmax."""
    if not params:
        return []
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample(logits[i], p, steps[i])
    return out
