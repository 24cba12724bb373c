"""Estimated prefix-hit fractions of a workload, as an infinite prefix cache would see them.

Requests are replayed in arrival order. Each one's prompt is rendered exactly as the gateway
renders it (chat template, then tokens), its leading full blocks that the cache already holds
count as hits, and then its blocks join the cache, followed by the blocks of its prompt plus an
assumed answer: the cache holds earlier prompts *and* outputs, as MD's decode-side radix cache
does. Answers are deterministic pseudo-text of `answer_tokens` tokens per request.
Without a tokenizer, characters stand in for tokens (a rough but tokenizer-free check).
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from benchmarks.pseudo_text import text_of_tokens
from benchmarks.summary import percentile
from benchmarks.workload_model import Workload, fill_answers
from shared.prefix_hash import block_hashes


class _Renderer:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def chat(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        if self.tokenizer is None:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            text += "<|im_start|>assistant\n" if generation_prompt else ""
            return [ord(c) for c in text]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)


def assumed_answer(request_id: str, answer_tokens: int) -> str:
    return text_of_tokens(random.Random(f"answer:{request_id}"), answer_tokens)


def _leading_hits(hashes: list[str], cached: set[str]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in cached:
        n += 1
    return n


def _replay(workload: Workload, tokenizer: Any | None, block_size: int, answer_tokens: int) -> tuple[list, list]:
    render, cached, answers = _Renderer(tokenizer), set(), {}
    hits: list[float] = []
    lengths: list[int] = []
    for req in workload.requests:
        if req.prompt_ids is not None:
            tokens, with_answer = req.prompt_ids, []
        else:
            messages = fill_answers(req.messages, answers)
            tokens = render.chat(messages, generation_prompt=True)
            answers[req.request_id] = assumed_answer(req.request_id, answer_tokens)
            reply = {"role": "assistant", "content": answers[req.request_id]}
            with_answer = render.chat(messages + [reply], generation_prompt=False)
        hashes = block_hashes(tokens, block_size)
        hits.append(_leading_hits(hashes, cached) * block_size / max(1, len(tokens)))
        lengths.append(len(tokens))
        cached.update(hashes)
        cached.update(block_hashes(with_answer, block_size))
    return hits, lengths


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4) if values else 0.0


def estimated_hit_rates(
    workload: Workload, tokenizer: Any | None = None, block_size: int = 16, answer_tokens: int = 32
) -> dict[str, Any]:
    """Per-request hit fractions and the skew figures: mean, share above 0.95, by kind."""
    hits, lengths = _replay(workload, tokenizer, block_size, answer_tokens)
    kinds: dict[str, list[float]] = {}
    for req, hit in zip(workload.requests, hits):
        kinds.setdefault(req.kind, []).append(hit)
    n = max(1, len(hits))
    return {
        "per_request": hits,
        "prompt_tokens": lengths,
        "unit": "tokens" if tokenizer is not None else "characters",
        "mean_hit": _mean(hits),
        "share_above_95": round(sum(h > 0.95 for h in hits) / n, 4),
        "anomalous_share": round(len(kinds.get("anomalous", [])) / n, 4),
        "mean_hit_by_kind": {k: _mean(v) for k, v in sorted(kinds.items())},
        "count_by_kind": {k: len(v) for k, v in sorted(kinds.items())},
        "mean_prompt_tokens": round(statistics.fmean(lengths), 1) if lengths else 0.0,
        "p50_prompt_tokens": percentile(sorted(lengths), 50) if lengths else 0,
        "max_prompt_tokens": max(lengths, default=0),
    }
