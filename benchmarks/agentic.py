"""Multi-turn agent sessions with the report's prefix-hit skew.

How a workload is drawn (all from `seed`):
1. One shared system prompt of agent instructions (`system_tokens` of pseudo-text).
2. Each request's kind is fixed up front with exact shares, shuffled: `anomalous_share`
   anomalous, `new_session_share` new sessions, the rest follow-up turns.
   - anomalous: the system prompt plus a long fresh document (`anomalous_input_tokens`, cut to
     fit the context) with a 4-8 token answer budget, outside any session;
   - new: the system prompt plus a fresh task (`task_tokens`), so only the system prompt is
     shared; the oldest of the `concurrent_sessions` open sessions ends to make room;
   - continue: the next turn of a random open session: its whole conversation so far, the
     previous answer (a placeholder the runner fills) and a fresh tool result (`tool_tokens`,
     log-uniform). A session whose next turn would not fit `max_context` (answers budgeted at
     their max_tokens, plus `context_margin`) ends and a new session takes the request.
3. Arrivals are Poisson at `rate_rps`; a follow-up turn also waits for its `depends_on`.

Skew targets (DESIGN section 1): mean prefix hit ~0.9, 70-80% of requests above 0.95, a low-hit
minority of new sessions, 3-4% anomalous requests. With the defaults and SmolLM2's tokenizer,
`estimated_hit_rates` (infinite cache of prompts and answers, 16-token blocks) gives mean
~0.885, ~0.75 above 0.95, new sessions ~0.56, anomalous ~0.15; prompts mostly 1.0-2.1K tokens.
Why the tool results are short: a follow-up turn leaves ~tool_tokens + 16 tokens uncached (its
tool message, chat-template tokens, a partly filled last block), and it clears 0.95 only when its
prompt is over 20x that. Production agents have tens of thousands of tokens of context and tool
outputs of hundreds; scaled to a 2-core CPU's 1-2K-token prompts, tool outputs shrink alike.
(With 40-120-token tool outputs the skew needs ~2.2K-token prompts and still tops out near 0.65.)

With `tools` (`pdd bench --workload agentic-tools`), every chat request carries three coding
tools (benchmarks/agent_tools.py: read_file, run_tests, search_code): a session's first turn
must call one (`tool_choice: "required"`), each later turn calls one with probability
`tool_turn_share` or answers in text (`"none"`); the tool result that follows a call goes back as
a `tool` message answering that call, after an answer as the user's next message. The report
adds the time to the complete tool call.

`agent_sessions` draws the same sessions at fleet scale for the simulator: every length of
`AgenticParams.scaled(k)` k times the bench's (a 128K context at k = 16), message bodies as
named `Segment`s of a known length instead of text (sim/workload.py names their blocks), so a
run of tens of thousands of 64K-token prompts is drawn in seconds. Same rules, same shares.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.agent_tools import TOOLS, TOOLS_PROMPT_TOKENS
from benchmarks.pseudo_text import TokenCounter, text_of_tokens
from benchmarks.workload_model import BenchRequest, Workload, poisson_arrivals

MESSAGE_OVERHEAD = 5  # <|im_start|> role \n ... <|im_end|> \n
GENERATION_PROMPT = 3  # <|im_start|> assistant \n
SYSTEM_PREAMBLE = "You are a coding agent. Use the tools, keep answers short. Instructions follow.\n"
ANOMALOUS_ASK = "Read the document below and answer in one word: does it describe a bug?\n\n"


@dataclass(frozen=True)
class AgenticParams:
    max_context: int = 8192
    output_tokens: tuple[int, int] = (16, 48)
    anomalous_share: float = 0.035
    new_session_share: float = 0.12
    concurrent_sessions: int = 8
    system_tokens: int = 550
    task_tokens: tuple[int, int] = (250, 550)
    tool_tokens: tuple[int, int] = (8, 48)  # drawn log-uniform: mostly short, sometimes long
    anomalous_input_tokens: tuple[int, int] = (2048, 4096)
    anomalous_output_tokens: tuple[int, int] = (4, 8)
    context_margin: int = 64  # slack for tokenizing answers differently from how they were made
    tools: bool = False  # chat requests carry TOOLS and call them (see the module docstring)
    tool_turn_share: float = 0.7  # with tools: later turns that call a tool (the rest answer)
    tool_call_tokens: int = 128  # with tools: the answer budget of a turn that must call (one call)

    def __post_init__(self) -> None:
        for name in (
            "output_tokens",
            "task_tokens",
            "tool_tokens",
            "anomalous_input_tokens",
            "anomalous_output_tokens",
        ):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={(lo, hi)} must be a range 1 <= lo <= hi")
        shares = (self.anomalous_share, self.new_session_share)
        if min(shares) < 0 or sum(shares) > 1:
            raise ValueError(f"anomalous_share + new_session_share = {sum(shares)} must lie in [0, 1]")
        if self.anomalous_output_tokens[1] >= 500:
            raise ValueError(f"anomalous_output_tokens={self.anomalous_output_tokens}: anomalous means < 500")
        first_turn = self.system_tokens + self.task_tokens[1] + self.output_tokens[1] + self.context_margin
        if first_turn * 1.5 > self.max_context:  # 1.5: room for the estimate without a tokenizer
            raise ValueError(f"max_context={self.max_context} leaves no room for a first turn of ~{first_turn}")

    def scaled(self, k: int) -> AgenticParams:
        """Every length (context, prompts, tools, answers) k times longer; shares and the anomalous
        answer budget (short by definition) unchanged."""

        def times(pair: tuple[int, int]) -> tuple[int, int]:
            return (pair[0] * k, pair[1] * k)

        return AgenticParams(
            max_context=self.max_context * k,
            output_tokens=times(self.output_tokens),
            anomalous_share=self.anomalous_share,
            new_session_share=self.new_session_share,
            concurrent_sessions=self.concurrent_sessions,
            system_tokens=self.system_tokens * k,
            task_tokens=times(self.task_tokens),
            tool_tokens=times(self.tool_tokens),
            anomalous_input_tokens=times(self.anomalous_input_tokens),
            anomalous_output_tokens=self.anomalous_output_tokens,
            context_margin=self.context_margin * k,
            tools=self.tools,
            tool_turn_share=self.tool_turn_share,
            tool_call_tokens=self.tool_call_tokens * k,
        )


class _Text:
    """Message bodies as pseudo-text, counted by the tokenizer (or estimated): what `pdd bench` sends."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.counter = TokenCounter(tokenizer)

    def draw(self, rng: random.Random, n_tokens: int) -> str:
        return text_of_tokens(rng, n_tokens)

    def join(self, lead: str, body: str) -> str:
        return lead + body

    def tokens(self, body: str) -> int:
        return self.counter.count(body)

    def shrink(self, body: str) -> str:
        return body[: len(body) * 9 // 10]


@dataclass(frozen=True)
class Segment:
    """A message body known by name and length only (equal names, equal content)."""

    name: str
    tokens: int


class _Segments:
    """Message bodies as `Segment`s: each draw a fresh name; a lead's text counts ~5 characters a token."""

    def __init__(self) -> None:
        self.drawn = 0

    def draw(self, rng: random.Random, n_tokens: int) -> Segment:
        self.drawn += 1
        return Segment(f"m{self.drawn}", n_tokens)

    def join(self, lead: str, body: Segment) -> Segment:
        return Segment(body.name, body.tokens + len(lead) // 5 + 1)

    def tokens(self, body: Segment) -> int:
        return body.tokens

    def shrink(self, body: Segment) -> Segment:
        return Segment(body.name, body.tokens * 9 // 10)


@dataclass
class _Session:
    session_id: str
    messages: list[dict]
    tokens: int  # conversation so far incl. template overhead, answers budgeted at max_tokens
    turn: int = 1
    last_request: str = ""
    last_max_tokens: int = 0
    last_called: bool = False  # the last turn had to call a tool (tools mode)


@dataclass
class _Builder:
    params: AgenticParams
    seed: int
    material: _Text | _Segments
    rng: random.Random = field(init=False)
    pool: list[_Session] = field(default_factory=list)
    sessions_started: int = 0
    prompt_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:agentic")
        body = self.material.draw(random.Random(f"{self.seed}:system"), self.params.system_tokens)
        text = self.material.join(SYSTEM_PREAMBLE, body)
        self.system = {"role": "system", "content": text}
        self.system_cost = self.cost(text)
        if self.params.tools:  # the tools are described in the system message too (a template without tools)
            self.system_cost += self.material.tokens(json.dumps(TOOLS)) + TOOLS_PROMPT_TOKENS

    def log_uniform(self, lo: int, hi: int) -> int:
        """Mostly short, sometimes long: how tool outputs are sized."""
        return round(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))

    def cost(self, body: str | Segment) -> int:
        return self.material.tokens(body) + MESSAGE_OVERHEAD

    def plan_kinds(self, n: int) -> list[str]:
        """Exact shares, shuffled: a 200-request run has its 7 anomalous requests, not 3 or 12."""
        n_anomalous = round(n * self.params.anomalous_share)
        n_new = round(n * self.params.new_session_share)
        kinds = ["anomalous"] * n_anomalous + ["new"] * n_new + ["continue"] * (n - n_anomalous - n_new)
        self.rng.shuffle(kinds)
        return kinds

    def next_request(self, kind: str, rid: str, t: float) -> BenchRequest:
        if kind == "anomalous":
            return self.anomalous(rid, t)
        if kind == "new" or not self.pool:
            return self.new_session(rid, t)
        return self.continue_session(self.rng.choice(self.pool), rid, t)

    def anomalous(self, rid: str, t: float) -> BenchRequest:
        p = self.params
        max_tokens = self.rng.randint(*p.anomalous_output_tokens)
        room = p.max_context - self.system_cost - GENERATION_PROMPT - max_tokens - p.context_margin
        doc = self.material.draw(self.rng, min(self.rng.randint(*p.anomalous_input_tokens), room))
        while self.cost(self.material.join(ANOMALOUS_ASK, doc)) > room:  # only without a tokenizer: estimates run high
            doc = self.material.shrink(doc)
        user = {"role": "user", "content": self.material.join(ANOMALOUS_ASK, doc)}
        self.prompt_tokens.append(self.system_cost + self.cost(user["content"]) + GENERATION_PROMPT)
        return BenchRequest(rid, "", 0, t, max_tokens, "anomalous", messages=[dict(self.system), user])

    def new_session(self, rid: str, t: float) -> BenchRequest:
        if len(self.pool) >= self.params.concurrent_sessions:
            self.pool.pop(0)  # the oldest session ends
        self.sessions_started += 1
        task = self.material.join("Task: ", self.material.draw(self.rng, self.rng.randint(*self.params.task_tokens)))
        session = _Session(
            f"s{self.sessions_started:04d}",
            [dict(self.system), {"role": "user", "content": task}],
            self.system_cost + self.cost(task),
        )
        self.pool.append(session)
        return self.emit(session, rid, t, "new", depends_on=None)

    def continue_session(self, s: _Session, rid: str, t: float) -> BenchRequest:
        p = self.params
        body = self.material.draw(self.rng, self.log_uniform(*p.tool_tokens))
        tool = self.material.join(f"Tool result (step {s.turn}):\n", body)
        grown = s.tokens + s.last_max_tokens + MESSAGE_OVERHEAD + self.cost(tool)
        longest = max(p.output_tokens[1], p.tool_call_tokens if p.tools else 0)
        if grown + GENERATION_PROMPT + longest + p.context_margin > p.max_context:
            self.pool.remove(s)
            return self.new_session(rid, t)
        answer = {"role": "assistant", "content": None, "from": s.last_request}  # the runner fills it in
        result = {"role": "tool", "content": tool, "from": s.last_request} if s.last_called else None
        s.messages += [answer, result or {"role": "user", "content": tool}]
        s.tokens, s.turn = grown, s.turn + 1
        return self.emit(s, rid, t, "continue", depends_on=s.last_request)

    def emit(self, s: _Session, rid: str, t: float, kind: str, depends_on: str | None) -> BenchRequest:
        p = self.params
        max_tokens = self.rng.randint(*p.output_tokens)
        calls = p.tools and (kind == "new" or self.rng.random() < p.tool_turn_share)
        if calls:
            max_tokens = p.tool_call_tokens  # a call cut short would not parse
        s.last_request, s.last_max_tokens, s.last_called = rid, max_tokens, calls
        self.prompt_tokens.append(s.tokens + GENERATION_PROMPT)
        messages = [dict(m) for m in s.messages]
        tools = {"tools": TOOLS, "tool_choice": "required" if calls else "none"} if p.tools else {}
        return BenchRequest(
            rid, s.session_id, s.turn, t, max_tokens, kind, messages=messages, depends_on=depends_on, **tools
        )


def agentic(n_requests: int, seed: int, rate_rps: float, tokenizer: Any | None = None, **knobs: Any) -> Workload:
    """Multi-turn agent sessions (see the module docstring); `knobs` are `AgenticParams` fields.

    With a tokenizer, context budgets count real tokens; without, a conservative estimate.
    """
    counts = "tokenizer" if tokenizer is not None else "estimated (chars/3)"
    params = AgenticParams(**knobs)
    name = "agentic-tools" if params.tools else "agentic"
    return _draw(name, n_requests, seed, rate_rps, params, _Text(tokenizer), counts)


def agent_sessions(n_requests: int, seed: int, rate_rps: float, params: AgenticParams) -> Workload:
    """The same sessions with `Segment` bodies (see the module docstring), for the simulator."""
    return _draw("agents", n_requests, seed, rate_rps, params, _Segments(), "segments (exact)")


def _draw(name: str, n: int, seed: int, rate_rps: float, params: AgenticParams, material, counts: str) -> Workload:
    builder = _Builder(params, seed, material)
    arrivals = poisson_arrivals(n, rate_rps, seed)
    kinds = builder.plan_kinds(n)
    prefix = "ags" if name == "agents" else "ag"
    requests = [builder.next_request(k, f"{prefix}-{i:05d}", t) for i, (k, t) in enumerate(zip(kinds, arrivals))]
    tokens = builder.prompt_tokens
    stats = {
        "sessions": builder.sessions_started,
        "token_counts": counts,
        "est_mean_prompt_tokens": round(sum(tokens) / max(1, len(tokens)), 1),
        "est_max_prompt_tokens": max(tokens, default=0),
        "system_prompt_tokens": builder.system_cost,
    }
    return Workload(name, requests, seed, {"rate_rps": rate_rps, **asdict(params)}, stats)
