"""The simulator's workloads: agent sessions at fleet scale named by segments, the reuse they have,
and the line sized for them (sim/sizing.py), each against figures computed by hand."""

from __future__ import annotations

import pytest

from benchmarks.agentic import AgenticParams, agent_sessions
from sim.link import BandwidthSchedule
from sim.request import RequestRun, SimRequest
from sim.sizing import mean_factors, smallest_line_gbps
from sim.workload import AGENT_BLOCK, agents, from_segments, reuse


def test_a_sessions_next_turn_starts_with_everything_the_turn_before_left_in_a_drc():
    reqs, info = agents(300, 0, 10.0)
    assert info["block_tokens"] == AGENT_BLOCK == 256 and info["params"]["max_context"] == 131072
    by_id = {r.request_id: r for r in reqs}
    turns = [r for r in reqs if r.depends_on]
    assert turns and all(r.kind == "continue" for r in turns)
    for r in turns:
        before = by_id[r.depends_on]
        assert r.blocks[: len(before.done_blocks)] == before.done_blocks  # prompt + answer, block for block
        assert r.prompt_len > before.prompt_len + before.output_len  # plus its tool result
    systems = {r.blocks[0] for r in reqs}
    assert len(systems) == 1  # one shared system prompt opens every conversation


def test_segments_count_exactly_what_the_template_adds():
    params = AgenticParams(max_context=8192, new_session_share=1.0, anomalous_share=0.0)
    w = agent_sessions(1, 0, 1.0, params)
    [r] = from_segments(w, block_tokens=16)
    system, task = (m["content"] for m in w.requests[0].messages)
    assert r.prompt_len == (3 + system.tokens + 2) + (3 + task.tokens + 2) + 3  # two messages, generation prompt
    assert len(r.blocks) == r.prompt_len // 16 and len(r.done_blocks) == (r.prompt_len + r.output_len) // 16


def test_reuse_counts_leading_blocks_seen_before():
    a = SimRequest("a", 0.0, 64, 16, ("x", "y", "z", "w"), ("x", "y", "z", "w", "A"), 16)
    b = SimRequest("b", 1.0, 96, 16, ("x", "y", "z", "w", "A", "q"), ("x", "y", "z", "w", "A", "q", "B"), 16)
    out = reuse([a, b])
    assert out["prompts_mean"] == pytest.approx((0 + 64 / 96) / 2)  # b's first 4 blocks were a's prompt
    assert out["prompts_and_answers_mean"] == pytest.approx((0 + 80 / 96) / 2)  # ... and a's answer block
    assert out["prompts_and_answers_token_weighted"] == pytest.approx(80 / 160)


def _run(at_s: float, nbytes: int) -> RequestRun:
    run = RequestRun(SimRequest("r", 0.0, 1, 1, (), (), 16))
    run.wan_bytes, run.marks["prefill_end"] = nbytes, at_s * 1000.0
    return run


def test_the_line_is_sized_on_the_p99_window_over_the_bound():
    # 10 s windows carrying 10, 20, ..., 100 Gbit: 1-10 Gbps; p99 of ten (linear) = 9.91 Gbps;
    # / 0.8 = 12.4 Gbps -> a 20 Gbps line (multiples of 10)
    runs = [_run(10.0 * k + 1.0, (k + 1) * 10 * 125_000_000) for k in range(10)]
    out = smallest_line_gbps(runs, BandwidthSchedule(1000.0))
    assert out["exact_gbps"] == pytest.approx(9.91 / 0.8)
    assert out["line_gbps"] == 20.0 and out["demand_mean_gbps"] == pytest.approx(5.5)


def test_a_line_that_swings_to_half_needs_twice_the_capacity():
    # square wave: 10 s at 100%, 10 s at 50%; a flat 5 Gbps demand needs 10 Gbps nominal in the low windows
    square = BandwidthSchedule(1000.0, "square", low=0.5, period_s=10.0)
    assert mean_factors(square, 4) == pytest.approx([1.0, 0.5, 1.0, 0.5])
    runs = [_run(10.0 * k + 1.0, 50 * 125_000_000) for k in range(4)]
    assert smallest_line_gbps(runs, square, bound=1.0, step_gbps=1.0)["exact_gbps"] == pytest.approx(10.0)
