"""Workloads for the simulator: `pdd bench`'s own, reduced to lengths and block names.

- `agentic` / `random` (benchmarks/workloads.py, same generator, same seed): each prompt is
  rebuilt as token ids — a chat message is its template tokens around content ids drawn from a
  hash of the content (length from the tokenizer when there is one, as the bench counts), an
  earlier answer is that request's own answer ids — and named by `shared.prefix_hash` in
  16-token blocks. Equal text, equal blocks; so hits on prefill (prompts) and on the DRC
  (prompts and answers) come out as the real caches see them.
- `trace:FILE`: a Mooncake trace, rescaled by the same rules as benchmarks/trace.py but kept in
  hash space (a block name is the trace's hash id; the tail and the answer get unique names).
- `hitmix:H`: synthetic traffic whose requests each hit a fraction ~H of their prompt (Beta
  around H), on a few long shared documents: the bathtub's x axis.
Output length is `max_tokens` (a simulator cannot know where the model stops) unless
`outputs` gives the lengths a real run produced; a real length under `max_tokens` means the
model stopped on its EOS token, which the client never sees as a chunk (`SimRequest.eos`).
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

from benchmarks.agentic import GENERATION_PROMPT
from benchmarks.pseudo_text import TokenCounter
from benchmarks.trace import rescale
from benchmarks.workload_model import BenchRequest, Workload
from benchmarks.workloads import load_workload
from shared.prefix_hash import block_hashes
from sim.request import SimRequest

BLOCK = 16
VOCAB = 49152
OPEN_TOKENS, CLOSE_TOKENS = 3, 2  # "<|im_start|>role\n" ... "<|im_end|>\n"


def _ids(key: str, n: int) -> list[int]:
    rng = random.Random(hashlib.blake2b(key.encode(), digest_size=8).digest())
    return [rng.randrange(100, VOCAB) for _ in range(n)]


class _Tokens:
    def __init__(self, tokenizer: Any | None) -> None:
        self.counter = TokenCounter(tokenizer)
        self._memo: dict[str, list[int]] = {}

    def text(self, content: str) -> list[int]:
        if content not in self._memo:
            self._memo[content] = _ids("text:" + content, self.counter.count(content))
        return self._memo[content]


def _chat_ids(req: BenchRequest, tok: _Tokens, answers: dict[str, list[int]]) -> list[int]:
    ids: list[int] = []
    for m in req.messages or []:
        body = answers[m["from"]] if m.get("content") is None else tok.text(m["content"])
        ids += _ids("role:" + m["role"], OPEN_TOKENS) + body + _ids("close", CLOSE_TOKENS)
    return ids + _ids("role:assistant", GENERATION_PROMPT)


def from_bench(
    workload: Workload, tokenizer: Any | None = None, outputs: dict[str, int] | None = None
) -> list[SimRequest]:
    tok, answers, out = _Tokens(tokenizer), {}, []
    for r in workload.requests:
        prompt = list(r.prompt_ids) if r.prompt_ids is not None else _chat_ids(r, tok, answers)
        n_out = (outputs or {}).get(r.request_id, r.max_tokens)  # fewer than max_tokens: it stopped on EOS
        answers[r.request_id] = _ids("answer:" + r.request_id, n_out)
        out.append(
            SimRequest(
                r.request_id,
                r.arrival_s * 1000.0,
                len(prompt),
                n_out,
                tuple(block_hashes(prompt, BLOCK)),
                tuple(block_hashes(prompt + answers[r.request_id], BLOCK)),
                BLOCK,
                r.kind,
                r.session,
                r.turn,
                r.depends_on,
                eos=n_out < r.max_tokens,
            )
        )
    return out


def trace_requests(
    path: str,
    block_tokens: int = 16,
    time_scale: float = 1.0,
    output_scale: float = 1.0,
    max_requests: int | None = None,
    max_context: int = 8192,
    loops: int = 1,
) -> list[SimRequest]:
    """A Mooncake trace rescaled by benchmarks/trace.py's `rescale`, named in hash space (a full
    block is its hash id; the rest of the prompt and the answer get names of their own); `loops`
    replays it back to back (each copy with its own names) to make a longer run."""
    lines = rescale(
        path,
        block_tokens=block_tokens,
        time_scale=time_scale,
        output_scale=output_scale,
        max_requests=max_requests,
        max_context=max_context,
    )
    span = (lines[-1].arrival_s if lines else 0.0) + 1.0
    out = []
    for loop in range(loops):
        for line in lines:
            blocks = tuple((loop, h) for h in line.hash_ids[: line.kept_blocks])
            own = (line.prompt_tokens + line.max_tokens) // block_tokens - len(blocks)
            tail = tuple(("tail", loop, line.index, k) for k in range(own))
            out.append(
                SimRequest(
                    f"tr-{loop}-{line.index:06d}",
                    (line.arrival_s + loop * span) * 1000.0,
                    line.prompt_tokens,
                    line.max_tokens,
                    blocks,
                    blocks + tail,
                    block_tokens,
                    "trace",
                )
            )
    return sorted(out, key=lambda r: r.arrival_ms)


def hitmix(
    n: int,
    seed: int,
    rate_rps: float,
    hit: float,
    prompt_tokens: int = 8192,
    output_tokens: int = 512,
    block_tokens: int = 64,
    documents: int = 8,
    spread: float = 20.0,
) -> list[SimRequest]:
    """`n` requests whose prompt hit is Beta(mean `hit`, concentration `spread`) of a shared document."""
    rng = random.Random(f"{seed}:hitmix:{hit}")
    t, out = 0.0, []
    blocks_per_prompt = prompt_tokens // block_tokens
    for i in range(n):
        h = hit if hit in (0.0, 1.0) else rng.betavariate(hit * spread, (1 - hit) * spread)
        shared = min(math.floor(h * blocks_per_prompt), blocks_per_prompt - 1) if hit < 1.0 else blocks_per_prompt
        doc = rng.randrange(documents)
        blocks = tuple(("doc", doc, k) for k in range(shared)) + tuple(
            ("own", i, k) for k in range(blocks_per_prompt - shared)
        )
        answer = tuple(("ans", i, k) for k in range(output_tokens // block_tokens))
        out.append(
            SimRequest(
                f"hm-{i:06d}",
                t * 1000.0,
                prompt_tokens,
                output_tokens,
                blocks,
                blocks + answer,
                block_tokens,
                "continue" if shared else "new",
            )
        )
        t += rng.expovariate(rate_rps)
    return out


def load_sim_workload(
    spec: str,
    *,
    n_requests: int,
    seed: int,
    rate_rps: float,
    tokenizer: Any | None = None,
    block_tokens: int = 16,
    time_scale: float = 1.0,
    output_scale: float = 1.0,
    max_requests: int | None = None,
    max_context: int = 8192,
    loops: int = 1,
) -> tuple[list[SimRequest], dict]:
    """The workload `spec` names (agentic | random | trace:FILE | hitmix:H) and its description."""
    if spec.startswith("trace:"):
        reqs = trace_requests(
            spec[6:], block_tokens, time_scale, output_scale, max_requests or n_requests, max_context, loops
        )
        return reqs, {
            "name": spec,
            "requests": len(reqs),
            "seed": seed,
            "params": {
                "block_tokens": block_tokens,
                "time_scale": time_scale,
                "output_scale": output_scale,
                "loops": loops,
                "max_context": max_context,
            },
        }
    if spec.startswith("hitmix:"):
        hit = float(spec[7:])
        reqs = hitmix(n_requests, seed, rate_rps, hit)
        return reqs, {"name": spec, "requests": len(reqs), "seed": seed, "params": {"hit": hit, "rate_rps": rate_rps}}
    wl = load_workload(spec, n_requests=n_requests, seed=seed, rate_rps=rate_rps, tokenizer=tokenizer)
    return from_bench(wl, tokenizer), wl.describe()
