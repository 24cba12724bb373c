"""Benchmark workloads: what `pdd bench` replays. Pure: no HTTP, no servers.

- `agentic` (benchmarks/agentic.py): multi-turn agent sessions sharing one system prompt, in chat
  form, with the report's prefix-hit skew (mean ~0.9, 70-80% of requests above 0.95, a low-hit
  minority of new sessions, 3-4% anomalous long-input/short-output requests). Later turns hold
  the earlier answers as placeholders; the runner fills them with `fill_answers`.
- `trace` (benchmarks/trace.py): a Mooncake FAST'25 JSONL trace, 512-token hash blocks rescaled
  to `block_tokens` deterministic token ids, so equal hash ids share real prefixes.
- `random_workload`: fixed input/output lengths, fresh random token ids, no sharing at all (the
  floor for prefix caches).
- `load_workload("agentic" | "agentic-tools" | "random" | "trace:FILE", ...)`: what the command line names.
`estimated_hit_rates` (benchmarks/hit_rates.py) replays any of them through an infinite prefix
cache to check the skew without running a model.
"""

from __future__ import annotations

import random
from typing import Any

from benchmarks.agentic import AgenticParams, agentic
from benchmarks.hit_rates import estimated_hit_rates
from benchmarks.trace import read_trace, trace
from benchmarks.workload_model import BenchRequest, Workload, fill_answers, is_placeholder, poisson_arrivals

__all__ = [
    "AgenticParams",
    "BenchRequest",
    "Workload",
    "agentic",
    "estimated_hit_rates",
    "fill_answers",
    "is_placeholder",
    "load_workload",
    "poisson_arrivals",
    "random_workload",
    "read_trace",
    "trace",
]

FIRST_TOKEN_ID = 100  # keep clear of special tokens at the bottom of the vocabulary


def random_workload(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    input_tokens: int = 256,
    output_tokens: int = 32,
    vocab_size: int = 49152,
) -> Workload:
    """`n_requests` prompts of exactly `input_tokens` fresh random ids each; nothing is shared."""
    if input_tokens < 1 or output_tokens < 1:
        raise ValueError(f"input_tokens={input_tokens} and output_tokens={output_tokens} must be >= 1")
    requests = []
    for i, t in enumerate(poisson_arrivals(n_requests, rate_rps, seed)):
        rng = random.Random(f"{seed}:random:{i}")
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(input_tokens)]
        requests.append(BenchRequest(f"rd-{i:05d}", "", 0, t, output_tokens, "random", prompt_ids=prompt))
    params = {
        "rate_rps": rate_rps,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "vocab_size": vocab_size,
    }
    return Workload("random", requests, seed, params, {"est_mean_prompt_tokens": float(input_tokens)})


def load_workload(
    spec: str,
    *,
    n_requests: int,
    seed: int,
    rate_rps: float,
    tokenizer: Any | None = None,
    random_input_len: int = 256,
    random_output_len: int = 32,
    **trace_opts: Any,
) -> Workload:
    """The workload `spec` names: "agentic", "agentic-tools" (the same sessions calling tools),
    "random" or "trace:FILE".

    `random_input_len` / `random_output_len` are the random workload's prompt and output tokens.

    `trace_opts` (block_tokens, time_scale, output_scale, max_requests...) apply to traces only, so
    one command line can pass them whatever it names; None values are left at their defaults. A
    trace takes at most `n_requests` lines unless `max_requests` says otherwise, and keeps its own
    arrival times (`rate_rps` is for the generated workloads).
    """
    if spec in ("agentic", "agentic-tools"):
        return agentic(n_requests, seed, rate_rps, tokenizer, tools=spec == "agentic-tools")
    if spec == "random":
        return random_workload(
            n_requests, seed, rate_rps, input_tokens=random_input_len, output_tokens=random_output_len
        )
    if spec.startswith("trace:") and len(spec) > len("trace:"):
        opts = {"max_requests": n_requests, **{k: v for k, v in trace_opts.items() if v is not None}}
        return trace(spec[len("trace:") :], seed=seed, **opts)
    raise ValueError(f"unknown workload {spec!r}: use 'agentic', 'agentic-tools', 'random' or 'trace:FILE'")
