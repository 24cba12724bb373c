"""The benchmark workloads: determinism, the agentic skew, context budgets, trace rescaling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.trace import MOONCAKE_TRACE
from benchmarks.workloads import (
    AgenticParams,
    BenchRequest,
    Workload,
    agentic,
    estimated_hit_rates,
    fill_answers,
    load_workload,
    random_workload,
    trace,
)


def _as_data(w: Workload) -> list[tuple]:
    return [
        (r.request_id, r.session, r.turn, r.arrival_s, r.messages, r.prompt_ids, r.max_tokens, r.kind, r.depends_on)
        for r in w.requests
    ]


def _prompt_tokens(req: BenchRequest, tokenizer, answers: dict[str, str]) -> list[int]:
    if req.prompt_ids is not None:
        return req.prompt_ids
    text = tokenizer.apply_chat_template(
        fill_answers(req.messages, answers), tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _assert_fits(w: Workload, tokenizer, max_context: int) -> None:
    """Every prompt, with every earlier answer as long as its max_tokens allows, fits."""
    answers: dict[str, str] = {}
    for req in w.requests:
        assert len(_prompt_tokens(req, tokenizer, answers)) + req.max_tokens <= max_context, req.request_id
        answers[req.request_id] = " ".join(["file"] * req.max_tokens)  # exactly max_tokens SmolLM2 tokens


@pytest.fixture(scope="module")
def agentic200(smol_tokenizer) -> tuple[Workload, dict]:
    w = agentic(200, 0, 2.0, smol_tokenizer)
    return w, estimated_hit_rates(w, smol_tokenizer)


# -- determinism --------------------------------------------------------------------------------
def test_same_seed_same_workload_different_seed_differs(tmp_path):
    path = _trace_file(tmp_path)
    for make in (
        lambda s: agentic(60, s, 1.0),
        lambda s: random_workload(20, s, 1.0, input_tokens=32),
        lambda s: trace(path, seed=s),
    ):
        assert _as_data(make(3)) == _as_data(make(3))
        assert _as_data(make(3)) != _as_data(make(4))


def test_arrivals_are_sorted_poisson_at_the_rate():
    w = agentic(400, 1, 4.0)
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and times[0] == 0.0
    assert 0.8 / 4.0 < times[-1] / (len(times) - 1) < 1.2 / 4.0
    assert {r.arrival_s for r in random_workload(5, 0, float("inf"), input_tokens=4).requests} == {0.0}


# -- agentic ------------------------------------------------------------------------------------
def test_agentic_has_the_reports_hit_skew(agentic200):
    w, est = agentic200
    assert 0.8 <= est["mean_hit"] <= 0.95
    assert 0.6 <= est["share_above_95"] <= 0.85
    assert 0.02 <= est["anomalous_share"] <= 0.05
    by_kind = est["mean_hit_by_kind"]
    assert by_kind["new"] < 0.7 and by_kind["continue"] > 0.93  # the low-hit minority is new sessions
    assert by_kind["anomalous"] < 0.3
    assert 0.08 <= est["count_by_kind"]["new"] / len(w.requests) <= 0.2


def test_agentic_prompts_are_sized_for_a_small_cpu(agentic200):
    w, est = agentic200
    sessions = [n for r, n in zip(w.requests, est["prompt_tokens"]) if r.kind != "anomalous"]
    assert 800 <= est["mean_prompt_tokens"] <= 2500
    assert sum(300 <= n <= 2500 for n in sessions) / len(sessions) >= 0.85


def test_anomalous_requests_are_long_input_short_output(agentic200):
    w, est = agentic200
    anomalous = [(r, n) for r, n in zip(w.requests, est["prompt_tokens"]) if r.kind == "anomalous"]
    assert anomalous
    for r, n in anomalous:
        assert n >= 2000 and r.max_tokens <= 8  # DESIGN: anomalous means < 500 output tokens
        assert r.session == "" and r.depends_on is None and r.placeholders() == []
    others = [n for r, n in zip(w.requests, est["prompt_tokens"]) if r.kind != "anomalous"]
    assert min(n for _, n in anomalous) > sorted(others)[len(others) // 2]


def test_sessions_chain_their_turns_and_extend_the_previous_prompt(agentic200):
    w, _ = agentic200
    by_id = {r.request_id: r for r in w.requests}
    order = {r.request_id: i for i, r in enumerate(w.requests)}
    for r in w.requests:
        if r.kind == "new":
            assert r.turn == 1 and r.depends_on is None and r.placeholders() == []
        if r.kind != "continue":
            continue
        prev = by_id[r.depends_on]
        assert prev.session == r.session and prev.turn == r.turn - 1 and order[prev.request_id] < order[r.request_id]
        assert r.placeholders()[-1] == prev.request_id
        assert all(by_id[p].session == r.session for p in r.placeholders())
        # the previous prompt, its answer, then new user text: exactly what a real client resends
        assert r.messages[: len(prev.messages)] == prev.messages
        assert r.messages[len(prev.messages)]["from"] == prev.request_id
        assert r.messages[-1]["role"] == "user"
    assert max(r.turn for r in w.requests) >= 4


def test_fill_answers_replaces_placeholders_and_leaves_the_input_alone(agentic200):
    w, _ = agentic200
    req = next(r for r in w.requests if r.turn >= 3)
    answers = {p: f"answer of {p}" for p in req.placeholders()}
    filled = fill_answers(req.messages, answers)
    assistant = [m for m in filled if m["role"] == "assistant"]
    assert [m["content"] for m in assistant] == [answers[p] for p in req.placeholders()]
    assert all(set(m) == {"role", "content"} for m in filled)
    assert all(m["content"] is None for m in req.messages if m["role"] == "assistant")
    with pytest.raises(KeyError, match=req.placeholders()[0]):
        fill_answers(req.messages, {})


def test_agentic_tools_sessions_call_then_feed_the_result_back():
    w = agentic(60, 0, 2.0, None, tools=True)
    assert w.name == "agentic-tools" and all(r.tools for r in w.requests if r.messages and r.kind != "anomalous")
    firsts = [r for r in w.requests if r.kind == "new"]
    assert firsts and all(r.tool_choice == "required" for r in firsts)
    assert {r.tool_choice for r in w.requests if r.kind == "continue"} == {"required", "none"}
    by_id = {r.request_id: r for r in w.requests}
    later = next(r for r in w.requests if r.kind == "continue" and by_id[r.depends_on].tool_choice == "required")
    call = {"id": "call_7", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
    answers = {p: {"role": "assistant", "content": None, "tool_calls": [call]} for p in later.placeholders()}
    filled = fill_answers(later.messages, answers)
    assert filled[-2] == answers[later.depends_on] and filled[-1]["role"] == "tool"
    assert filled[-1]["tool_call_id"] == "call_7" and "from" not in filled[-1]
    # a server that called no tool answered in text: the result goes back as the user's message
    texts = fill_answers(later.messages, {p: "text" for p in later.placeholders()})
    assert texts[-2] == {"role": "assistant", "content": "text"} and texts[-1]["role"] == "user"


def test_every_agentic_request_fits_the_context(agentic200, smol_tokenizer):
    _assert_fits(agentic200[0], smol_tokenizer, 8192)


def test_small_context_ends_sessions_and_still_fits(smol_tokenizer):
    w = agentic(150, 2, 1.0, smol_tokenizer, max_context=2048, concurrent_sessions=2, new_session_share=0.0)
    _assert_fits(w, smol_tokenizer, 2048)
    assert sum(r.kind == "new" for r in w.requests) > 3  # sessions that hit the budget made room


def test_estimates_without_a_tokenizer_are_conservative(smol_tokenizer):
    _assert_fits(agentic(80, 5, 1.0, max_context=2048), smol_tokenizer, 2048)


def test_agentic_params_are_validated():
    with pytest.raises(ValueError, match="anomalous_output_tokens"):
        AgenticParams(anomalous_output_tokens=(100, 600))
    with pytest.raises(ValueError, match="max_context=1000"):
        AgenticParams(max_context=1000)
    with pytest.raises(TypeError, match="tool_length"):
        agentic(5, 0, 1.0, tool_length=3)


def test_describe_names_the_workload(agentic200):
    d = agentic200[0].describe()
    assert d["name"] == "agentic" and d["requests"] == 200 and d["seed"] == 0
    assert d["params"]["anomalous_share"] == 0.035 and d["kinds"]["anomalous"] == 7
    assert 800 < d["est_mean_prompt_tokens"] < 3000


# -- trace --------------------------------------------------------------------------------------
def _trace_file(tmp_path: Path) -> Path:
    """The first 20 lines of the repository's trace, plus two lines that reuse the first line's
    leading hash ids, as agent turns do in real Mooncake traces."""
    rows = [json.loads(line) for line in MOONCAKE_TRACE.read_text().splitlines()[:20]]
    head = rows[0]["hash_ids"][:3]
    rows.append(
        {
            "timestamp": rows[-1]["timestamp"] + 100,
            "input_length": 4 * 512,
            "output_length": 50,
            "hash_ids": head + [10**6],
        }
    )
    rows.append(
        {
            "timestamp": rows[-1]["timestamp"] + 100,
            "input_length": 4 * 512 + 200,
            "output_length": 900,
            "hash_ids": head + [10**6 + 1, 10**6 + 2],
        }
    )
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_equal_hash_ids_give_equal_blocks(tmp_path):
    w = trace(_trace_file(tmp_path), block_tokens=16)
    first, a, b = w.requests[0].prompt_ids, w.requests[-2].prompt_ids, w.requests[-1].prompt_ids
    assert a[:48] == b[:48] == first[:48]  # three shared 512-token blocks -> 48 shared tokens
    assert a[48:64] != b[48:64]  # a different hash id, a different block
    assert len(a) == 64 and len(b) == 64 + round(200 * 16 / 512)
    assert all(100 <= t < 49152 for t in a + b)
    others = [r.prompt_ids[:16] for r in w.requests[1:-2] if len(r.prompt_ids) >= 16]
    assert first[:16] not in others
    est = estimated_hit_rates(w, block_size=16)
    assert est["per_request"][-2] == pytest.approx(48 / 64) and est["per_request"][-1] == pytest.approx(48 / 70)


def test_trace_scales_lengths_times_and_outputs(tmp_path):
    path = _trace_file(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    base = trace(path)
    for r, row in zip(base.requests[:20], rows):
        assert len(r.prompt_ids) == max(1, round(row["input_length"] * 16 / 512))
        assert r.max_tokens == max(1, row["output_length"]) and r.kind == "trace" and r.messages is None
    fast = trace(path, time_scale=0.5, output_scale=0.1, block_tokens=8)
    for r, f in zip(base.requests, fast.requests):
        assert f.arrival_s == pytest.approx(r.arrival_s * 0.5)
        assert f.max_tokens == max(1, round(r.max_tokens * 0.1))
    assert [r.request_id for r in trace(path, max_requests=5).requests] == [r.request_id for r in base.requests[:5]]


def test_trace_fits_the_context(tmp_path):
    path = _trace_file(tmp_path)
    w = trace(path, block_tokens=64, max_context=1024)
    assert all(len(r.prompt_ids) + r.max_tokens <= 1024 for r in w.requests)
    long_out = w.requests[-1]  # 281 prompt tokens asked for 900 output tokens: the prompt's end goes
    assert long_out.max_tokens == 900 and len(long_out.prompt_ids) == 1024 - 900
    assert long_out.prompt_ids == trace(path, block_tokens=64).requests[-1].prompt_ids[:124]
    huge = trace(path, block_tokens=64, max_context=1024, output_scale=20.0).requests[-1]
    assert huge.max_tokens == 1023 and len(huge.prompt_ids) == 1


# -- random and the loader ----------------------------------------------------------------------
def test_random_workload_has_exact_lengths_and_no_sharing():
    w = random_workload(30, 0, 2.0, input_tokens=100, output_tokens=7)
    assert all(len(r.prompt_ids) == 100 and r.max_tokens == 7 and r.kind == "random" for r in w.requests)
    heads = {tuple(r.prompt_ids[:16]) for r in w.requests}
    assert len(heads) == 30
    assert estimated_hit_rates(w)["mean_hit"] == 0.0


def test_load_workload_parses_specs(tmp_path, smol_tokenizer):
    path = _trace_file(tmp_path)
    opts = {"block_tokens": 16, "time_scale": 2.0, "output_scale": 1.0, "max_requests": None}
    a = load_workload("agentic", n_requests=12, seed=1, rate_rps=1.0, tokenizer=smol_tokenizer, **opts)
    assert a.name == "agentic" and len(a.requests) == 12
    assert len(load_workload("random", n_requests=4, seed=1, rate_rps=1.0, tokenizer=None).requests) == 4
    t = load_workload(f"trace:{path}", n_requests=6, seed=0, rate_rps=1.0, tokenizer=None, **opts)
    assert len(t.requests) == 6 and t.params["time_scale"] == 2.0 and t.name == "trace:trace.jsonl"
    for bad in ("sharegpt", "trace:"):
        with pytest.raises(ValueError, match="unknown workload"):
            load_workload(bad, n_requests=1, seed=0, rate_rps=1.0)
