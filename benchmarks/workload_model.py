"""What a benchmark workload is: requests with arrival times, in chat or completion form.

Pure data and helpers, no I/O: the runner (HTTP client), the estimators and the tests all read
the same objects.

A chat request of a multi-turn session carries the earlier assistant answers as placeholders,
`{"role": "assistant", "content": None, "from": "<request id of that turn>"}`. The runner waits
for `depends_on`, then calls `fill_answers` with the answers it actually received, so the prompt
is byte for byte what a real client would send and prefix caches hit (or miss) for real.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

KINDS = ("new", "continue", "anomalous", "random", "trace")


@dataclass
class BenchRequest:
    request_id: str
    session: str  # conversation id; "" when the request belongs to none
    turn: int  # 1-based turn within the session; 0 outside sessions
    arrival_s: float  # earliest send time, offset from the start of the run (open loop)
    max_tokens: int
    kind: str
    messages: list[dict] | None = None  # chat form (may hold answer placeholders)
    prompt_ids: list[int] | None = None  # completion form: token ids
    depends_on: str | None = None  # previous turn of the same session: wait for its answer
    tools: list[dict] | None = None  # chat: the tools it may call (`agentic --tools`)
    tool_choice: Any = None  # "required" (a call) or "none" (an answer) when tools are given

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt_ids is None):
            raise ValueError(f"{self.request_id}: set exactly one of messages / prompt_ids")
        if self.kind not in KINDS:
            raise ValueError(f"{self.request_id}: kind {self.kind!r} is not one of {KINDS}")
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens={self.max_tokens} must be >= 1")

    def placeholders(self) -> list[str]:
        """Request ids whose answers this request's messages need."""
        return [m["from"] for m in self.messages or [] if is_placeholder(m)]


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]  # sorted by arrival_s
    seed: int
    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)  # generator's estimates (prompt tokens...)

    def describe(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for r in self.requests:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        duration = self.requests[-1].arrival_s if self.requests else 0.0
        return {
            "name": self.name,
            "requests": len(self.requests),
            "seed": self.seed,
            "params": dict(self.params),
            "kinds": kinds,
            "arrival_span_s": round(duration, 3),
            **self.stats,
        }


def is_placeholder(message: dict) -> bool:
    return message.get("role") == "assistant" and message.get("content") is None and "from" in message


def fill_answers(messages: list[dict], answers: dict[str, str | dict]) -> list[dict]:
    """A copy of `messages` with every answer placeholder replaced by the actual answer: its text,
    or the assistant message of a turn that called tools. A tool result (`{"role": "tool", "from":
    ...}`) answers that turn's first call; when the turn called none (a server without tools), it
    is sent as a user message."""
    out = []
    for m in messages:
        if is_placeholder(m) or m.get("role") == "tool":
            if m["from"] not in answers:
                raise KeyError(f"no answer for {m['from']!r} yet: run it before its follow-up turn")
            answer = answers[m["from"]]
        if is_placeholder(m):
            out.append(dict(answer) if isinstance(answer, dict) else {"role": "assistant", "content": answer})
        elif m.get("role") == "tool":
            calls = answer.get("tool_calls") if isinstance(answer, dict) else None
            body = {k: v for k, v in m.items() if k != "from"}
            out.append({**body, "tool_call_id": calls[0]["id"]} if calls else {"role": "user", "content": m["content"]})
        else:
            out.append(dict(m))
    return out


def poisson_arrivals(n: int, rate_rps: float, seed: int) -> list[float]:
    """`n` open-loop arrival offsets: exponential gaps at `rate_rps`, the first at 0.

    A rate of 0 or infinity means no pacing: everything arrives at once.
    """
    if rate_rps < 0:
        raise ValueError(f"rate_rps={rate_rps} must be >= 0 (0 or inf: all at once)")
    if rate_rps == 0 or rate_rps == float("inf"):
        return [0.0] * n
    rng = random.Random(f"{seed}:arrivals")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate_rps)
        out.append(round(t, 6))
    return out
