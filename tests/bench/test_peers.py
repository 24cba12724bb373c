"""`pdd bench peers`: the figures, the agreement with vLLM and the report, from recorded requests
(no server is started: the bench itself is too heavy for `make test`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import peer_plan, peers
from benchmarks.runner import Target, _body, token_logprobs
from benchmarks.workloads import BenchRequest

RECORDED = Path(__file__).parent / "data" / "peers-run"


def rec(rid: str, engine: str, tokens: list[tuple[str, float, float]], ok: bool = True, **extra):
    """A request record: each token (text, its logprob, the best alternative's)."""
    return {
        "request_id": rid,
        "mode": engine,
        "workload": "single",
        "ok": ok,
        "error": "" if ok else "the stream carried no output token",
        "sent_s": 0.0,
        "token_times_s": [0.1 * (i + 1) for i in range(len(tokens))],
        "text": "".join(t for t, _, _ in tokens),
        "output_tokens": len(tokens),
        "prompt_tokens": 10,
        "logprobs": [[[t, lp], ["alt", alt]] for t, lp, alt in tokens],
        **extra,
    }


def test_the_same_text_a_near_tie_and_a_plain_difference_are_told_apart():
    ref = [
        rec("a", "vllm", [("x", -0.1, -3.0), ("y", -0.2, -2.0)]),
        rec("b", "vllm", [("x", -0.1, -3.0), ("y", -0.700, -0.705)]),  # y or z: 0.005 nats apart
        rec("c", "vllm", [("x", -0.1, -3.0), ("y", -0.1, -2.5)]),
        rec("d", "vllm", [("x", -0.1, -3.0)], ok=False),
    ]
    other = [
        rec("a", "pdd", [("x", -0.1, -3.0), ("y", -0.2, -2.0)]),
        rec("b", "pdd", [("x", -0.1, -3.0), ("z", -0.70, -0.71)]),
        rec("c", "pdd", [("q", -0.1, -3.0), ("y", -0.1, -2.5)]),
        rec("d", "pdd", [("x", -0.1, -3.0)]),  # the reference failed it: not compared
    ]
    got = peers.agreement(ref, other)
    assert got == {"compared": 3, "same": 1, "near_ties": 1, "first_differing_token": [1, 0]}


def test_failed_requests_and_their_errors_are_counted_never_timed():
    figures = peers.engine_figures([rec("a", "vllm", [("x", -0.1, -1.0)] * 3), rec("b", "vllm", [], ok=False)], 2.0)
    assert (figures["completed"], figures["failed"]) == (1, 1)
    assert figures["errors"] == ["the stream carried no output token"]
    assert figures["median_ttft_ms"] == pytest.approx(100.0) and figures["median_tpot_ms"] == pytest.approx(100.0)


def test_logprobs_of_both_endpoints_read_the_same_and_each_is_asked_its_way():
    chat = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]}]}
    completion = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"b": -2.0, "a": -0.5}]}
    assert token_logprobs(chat) == [[["a", -0.5], ["a", -0.5]]]
    assert token_logprobs(completion) == [[["a", -0.5], ["a", -0.5], ["b", -2.0]]]
    target = Target("http://x", logprobs=2)
    prompt = BenchRequest("r", "", 0, 0.0, 4, "random", prompt_ids=[1, 2])
    chat_req = BenchRequest("r", "s", 0, 0.0, 4, "new", messages=[{"role": "user", "content": "hi"}])
    assert _body(prompt, {}, target.extra())[1]["logprobs"] == 2
    body = _body(chat_req, {}, target.extra())[1]
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    assert "logprobs" not in _body(prompt, {}, Target("http://x").extra())[1]


def test_vllm_gets_this_processes_cores_and_the_project_venv_is_never_its_own():
    argv, env = peers.vllm_command(Path("/v"), Path("/m/smol"), 8391, [0, 1, 2, 5])
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--served-model-name") + 1] == "smol"
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("4", "0-2,5")
    assert not str(peer_plan.DEFAULT_VENV).startswith(str(Path(__file__).resolve().parents[2]))


def test_the_command_refuses_without_vllm_unless_asked_to_install(tmp_path, capsys):
    import argparse

    from benchmarks.args import add_bench_arguments, add_peers_arguments

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    add_peers_arguments(p)
    args = p.parse_args(["--vllm-venv", str(tmp_path / "none"), "--engines", "vllm", "--out", str(tmp_path)])
    assert peers.main(args) == 2 and "add --install" in capsys.readouterr().err
    args = p.parse_args(["--engines", "vllm,sglang"])
    assert peers.main(args) == 2 and "unknown engine(s) ['sglang']" in capsys.readouterr().err
