"""Factories for simulator tests: a trivial chip whose timings are easy to compute by hand.

Trivial chip: prefill 1 ms per token, decode step 10 ms flat (+1 ms per extra extend token),
1,000 B of KV per token. Trivial WAN: 8 Mbps (1,000 B per ms), 5 ms one way, no jitter.
In-DC: 8,000 Mbps (1,000,000 B per ms), no delay.
"""

from __future__ import annotations

from typing import Any

from sim.config import SimConfig
from sim.profiles import ChipProfile
from sim.request import SimRequest

TRIVIAL = ChipProfile(
    name="trivial",
    kv_bytes_per_token=1000,
    kv_tokens=100_000,
    max_running=8,
    prefill_ms_per_token=1.0,
    step_fixed_ms=10.0,
    step_ms_per_extra_token=1.0,
)


def make_config(**overrides: Any) -> SimConfig:
    base = {
        "profiles": {"trivial": TRIVIAL},
        "chips": {"A": "trivial", "B": "trivial"},
        # only KV pays the line here, so the timings below stay simple to compute by hand;
        # control messages crossing it: tests/sim/test_timings.py::test_control_messages_*
        "wan": {"bandwidth_mbps": 8.0, "delay_ms": 5.0, "jitter_ms": 0.0, "control_crosses": False},
        "local": {"mbps": 8000.0, "delay_ms": 0.0},
        "handoff": {"chunk_tokens": 4, "final_tokens": 2},
        "scheduler": {"ttft_slo_ms": 10_000.0},
        "fleets": {"default": {"prefill": 1, "rld": 1, "md": 1}},
    }
    return SimConfig(**{**base, **overrides})


def make_request(
    rid: str = "r0",
    prompt: int = 100,
    output: int = 3,
    arrival_ms: float = 0.0,
    shared: int = 0,
    depends_on: str | None = None,
) -> SimRequest:
    """`prompt` tokens in 16-token blocks, the first `shared` blocks common to every request."""
    n = prompt // 16
    blocks = tuple(("s", k) if k < shared else (rid, k) for k in range(n))
    done = blocks + tuple((rid, "a", k) for k in range((prompt + output) // 16 - n))
    return SimRequest(rid, arrival_ms, prompt, output, blocks, done, 16, "continue", depends_on=depends_on)
