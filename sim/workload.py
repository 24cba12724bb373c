"""Workloads for the simulator: `pdd bench`'s own, reduced to lengths and block names.

- `agentic` / `random` (benchmarks/workloads.py, same generator, same seed): each prompt is
  rebuilt as token ids — a chat message is its template tokens around content ids drawn from a
  hash of the content (length from the tokenizer when there is one, as the bench counts), an
  earlier answer is that request's own answer ids — and named by `shared.prefix_hash` in
  16-token blocks. Equal text, equal blocks; so hits on prefill (prompts) and on the DRC
  (prompts and answers) come out as the real caches see them.
- `agents`: the same agent sessions at fleet scale (benchmarks/agentic.py `agent_sessions`:
  every length 16x the bench's, a 128K context; bodies known by name and length), named in
  `AGENT_BLOCK`-token blocks by a chain over the message bodies' names and offsets: equal
  conversation so far, equal blocks, as with token ids, at a fraction of the cost.
- `trace:FILE`: a Mooncake trace, rescaled by the same rules as benchmarks/trace.py but kept in
  hash space (a block name is the trace's hash id; the tail and the answer get unique names).
- `hitmix:H`: synthetic traffic whose requests each hit a fraction ~H of their prompt (Beta
  around H), on a few long shared documents: the bathtub's x axis.
Output length is `max_tokens` (a simulator cannot know where the model stops) unless
`outputs` gives the lengths a real run produced; a real length under `max_tokens` means the
model stopped on its EOS token, which the client never sees as a chunk (`SimRequest.eos`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Hashable
from typing import Any

from benchmarks.agentic import GENERATION_PROMPT, AgenticParams, Segment, agent_sessions
from benchmarks.pseudo_text import TokenCounter
from benchmarks.trace import rescale
from benchmarks.workload_model import BenchRequest, Workload
from benchmarks.workloads import load_workload
from shared.prefix_hash import block_hashes
from sim.request import SimRequest

BLOCK = 16
AGENT_SCALE = 16  # `agents`: the bench's agent sessions, every length 16x (a 128K context)
AGENT_BLOCK = BLOCK * AGENT_SCALE  # ... in blocks 16x longer, so a block is the same share of a prompt
AGENT_SESSIONS = 512  # agents working at once across the fleet (the bench's 8 on one host)
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


class _Chain:
    """Block names of a token sequence known as named pieces: block k's name hashes block k-1's
    name with the (piece, offset, length) runs it holds, so equal sequences give equal names."""

    def __init__(self, block: int) -> None:
        self.block, self.names, self.runs, self.fill, self.tokens = block, [], [], 0, 0

    def copy(self) -> _Chain:
        out = _Chain(self.block)
        out.names, out.runs, out.fill, out.tokens = list(self.names), list(self.runs), self.fill, self.tokens
        return out

    def add(self, key: Hashable, n: int) -> _Chain:
        offset = 0
        while offset < n:
            take = min(n - offset, self.block - self.fill)
            self.runs.append((key, offset, take))
            self.fill, offset = self.fill + take, offset + take
            if self.fill == self.block:
                self.names.append(hash((self.names[-1] if self.names else None, tuple(self.runs))))
                self.runs, self.fill = [], 0
        self.tokens += n
        return self


def _message(chain: _Chain, m: dict, answers: dict[str, int]) -> None:
    body: Segment | None = m.get("content")
    chain.add(("open", m["role"]), OPEN_TOKENS)
    if body is None:
        chain.add(("answer", m["from"]), answers[m["from"]])
    else:
        chain.add(body.name, body.tokens)
    chain.add(("close",), CLOSE_TOKENS)


def from_segments(workload: Workload, block_tokens: int = AGENT_BLOCK) -> list[SimRequest]:
    """`agent_sessions` requests as SimRequests: a prompt is its messages, each its template tokens
    around its body (a `Segment`, or an earlier answer), then the generation prompt; a session's
    turn starts from where the turn before it stopped (the chain is kept per conversation)."""
    answers: dict[str, int] = {}
    kept: dict[tuple, _Chain] = {}  # conversation (its message names) -> its chain before the generation prompt
    out = []
    for r in workload.requests:
        names = tuple(m["from"] if m.get("content") is None else m["content"].name for m in r.messages)
        if len(names) > 2 and names[:-2] in kept:  # the session's turn before: its answer and a tool result follow
            start, chain = len(names) - 2, kept.pop(names[:-2])
        elif names[:1] in kept:  # the system prompt every conversation starts with
            start, chain = 1, kept[names[:1]].copy()
        else:
            start, chain = 0, _Chain(block_tokens)
        for j in range(start, len(names)):
            _message(chain, r.messages[j], answers)
            if j == 0:
                kept[names[:1]] = chain.copy()
        if r.session:
            kept[names] = chain.copy()
        chain.add(("open", "assistant"), GENERATION_PROMPT)  # the assistant message's own opening
        prompt, prompt_len = tuple(chain.names), chain.tokens
        answers[r.request_id] = r.max_tokens
        chain.add(("answer", r.request_id), r.max_tokens)
        out.append(
            SimRequest(
                r.request_id,
                r.arrival_s * 1000.0,
                prompt_len,
                r.max_tokens,
                prompt,
                tuple(chain.names),
                block_tokens,
                r.kind,
                r.session,
                r.turn,
                r.depends_on,
            )
        )
    return out


def agents(n: int, seed: int, rate_rps: float, sessions: int = AGENT_SESSIONS) -> tuple[list[SimRequest], dict]:
    """The bench's agent sessions at fleet scale (`agents`), and the workload's description."""
    params = dataclasses.replace(AgenticParams().scaled(AGENT_SCALE), concurrent_sessions=sessions)
    wl = agent_sessions(n, seed, rate_rps, params)
    return from_segments(wl), {**wl.describe(), "block_tokens": AGENT_BLOCK, "scale": AGENT_SCALE}


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
    """The workload `spec` names (agentic | agents | random | trace:FILE | hitmix:H) and its description."""
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
    if spec == "agents":
        return agents(n_requests, seed, rate_rps)
    if spec.startswith("hitmix:"):
        hit = float(spec[7:])
        reqs = hitmix(n_requests, seed, rate_rps, hit)
        return reqs, {"name": spec, "requests": len(reqs), "seed": seed, "params": {"hit": hit, "rate_rps": rate_rps}}
    wl = load_workload(spec, n_requests=n_requests, seed=seed, rate_rps=rate_rps, tokenizer=tokenizer)
    return from_bench(wl, tokenizer), wl.describe()


def reuse(requests: list[SimRequest]) -> dict[str, float]:
    """How much of each prompt was seen before, by an infinite cache of earlier prompts (what prefill
    could hit) and of earlier prompts and answers (what main-decode's DRC could hit), in arrival order."""
    prompts: set[Hashable] = set()
    done: set[Hashable] = set()
    hits: dict[str, list[float]] = {"prompts": [], "prompts_and_answers": []}
    ordered = sorted(requests, key=lambda r: r.arrival_ms)
    for r in ordered:
        for name, seen in (("prompts", prompts), ("prompts_and_answers", done)):
            n = 0
            while n < len(r.blocks) and r.blocks[n] in seen:
                n += 1
            hits[name].append(r.hit_tokens(n) / max(r.prompt_len, 1))
        prompts.update(r.blocks)
        done.update(r.done_blocks)
    tokens = sum(r.prompt_len for r in requests)
    out: dict[str, float] = {}
    for name, hs in hits.items():
        out[f"{name}_mean"] = sum(hs) / max(len(hs), 1)
        out[f"{name}_over_95"] = sum(h > 0.95 for h in hs) / max(len(hs), 1)
        out[f"{name}_token_weighted"] = sum(h * r.prompt_len for h, r in zip(hs, ordered)) / max(tokens, 1)
    return out
