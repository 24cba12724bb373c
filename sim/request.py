"""What the simulator serves (`SimRequest`) and what it records about each (`RequestRun`).

A `SimRequest` is a benchmark request reduced to what costs time: prompt length, output length,
and the names of its prompt's full blocks (`blocks`) and of prompt-plus-answer's full blocks
(`done_blocks`, what a decoder's DRC holds once the request finished there). `block_tokens` is
the tokens per block name (16 for token-level workloads, the trace's rescaled block otherwise).

`eos`: the answer ended on the model's end-of-sequence token, a special token the gateway
detokenizes to no text, so the client receives no chunk for it (sim.records leaves its time out
of the client's token times; usage still counts it, as the real `output_tokens` does).

A `RequestRun` is one request's life in one simulated cluster, in explicit states, with the
timestamps `sim.records` turns into a `pdd bench` request record.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import IntEnum

from shared.pipelines import Handoff, Role


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_ms: float
    prompt_len: int
    output_len: int
    blocks: tuple[Hashable, ...]
    done_blocks: tuple[Hashable, ...]
    block_tokens: int = 16
    kind: str = "random"
    session: str = ""
    turn: int = 0
    depends_on: str | None = None
    eos: bool = False  # the model stopped on its end-of-sequence token before max_tokens

    def hit_tokens(self, blocks: int) -> int:
        return min(blocks * self.block_tokens, self.prompt_len)


class RunState(IntEnum):
    WAITING_DEPENDENCY = 0
    PREFILL_QUEUED = 1
    PREFILLING = 2
    KV_IN_FLIGHT = 3
    DECODING_RLD = 4
    HANDING_OFF = 5
    DECODING_MD = 6
    FINISHED = 7


@dataclass
class RequestRun:
    req: SimRequest
    sent_ms: float = 0.0
    state: RunState = RunState.WAITING_DEPENDENCY
    pipeline: str = ""
    handoff: str = Handoff.NONE.value
    reason: str = ""
    handoff_reason: str = ""
    estimates: dict = field(default_factory=dict)
    instances: dict[Role, str] = field(default_factory=dict)
    hit: dict[Role, int] = field(default_factory=lambda: {Role.PREFILL: 0, Role.MD: 0})
    token_times: list[float] = field(default_factory=list)
    tokens_by_role: dict[Role, int] = field(default_factory=lambda: dict.fromkeys(Role, 0))
    wan_bytes: int = 0
    local_bytes: int = 0
    handoff_chunks: int = 0
    marks: dict[str, float] = field(default_factory=dict)  # event name -> ms (see sim.records)
    planned_ms: float = 0.0  # when the plan reached the gateway: nothing reaches the client before

    def emit(self, at_ms: float, role: str) -> None:
        """A token reaches the client at `at_ms`, or once the plan is back if that is later (the
        gateway streams only once it knows the plan)."""
        self.token_times.append(max(at_ms, self.planned_ms))
        self.tokens_by_role[role] += 1

    @property
    def emitted(self) -> int:
        return len(self.token_times)

    @property
    def done(self) -> bool:
        return self.emitted >= self.req.output_len
