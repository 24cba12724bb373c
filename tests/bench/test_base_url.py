"""`pdd bench --base-url` against a server that is not PDD: a stub OpenAI server (no `pdd`
object, no NATS) on a thread. What the bench sends (model, API key, ignore_eos, lengths, at most
--max-concurrency in flight) and what it writes (vLLM's keys; PDD-only figures missing, not 0)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from benchmarks import bench
from benchmarks.args import add_bench_arguments, add_handoff_arguments
from benchmarks.environment import environment
from benchmarks.runner import NO_OUTPUT, Target, replay, warm_up
from benchmarks.summary import build_results
from benchmarks.workloads import random_workload

TOKEN_GAP_S = 0.02


def stub_app(seen: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if seen.get("starting", 0) > 0:  # like `pdd up` before its instances registered
            seen["starting"] -= 1
            return JSONResponse({"error": {"message": "no alive prefill instance"}}, status_code=503)
        if isinstance(body["prompt"], list):  # not a warm-up
            seen["bodies"].append(body)
            seen["auth"].append(request.headers.get("authorization"))

        async def stream():
            seen["in_flight"] += 1
            seen["max_in_flight"] = max(seen["max_in_flight"], seen["in_flight"])
            try:
                if isinstance(body["prompt"], list):
                    await together(seen)
                n = body["max_tokens"]
                for i in range(n):
                    await asyncio.sleep(TOKEN_GAP_S)
                    text = "" if seen.get("empty") else f" t{i}"  # empty: vLLM on a folder without its embedding
                    choice = {"index": 0, "text": text, "finish_reason": "length" if i == n - 1 else None}
                    yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                seen["in_flight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


async def together(seen: dict[str, Any]) -> None:
    """Hold a request until `seen["together"]` are in flight or every request has come: how many
    the bench keeps in flight is then what it sends at once, not how much of a short stream the
    next request happened to overlap on a busy machine. A bench that sends fewer at once is held
    for the deadline and shows it."""
    deadline = time.monotonic() + 10
    while seen["in_flight"] < seen["together"] and len(seen["bodies"]) < seen["requests"]:
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.005)


@pytest.fixture
def stub_server():
    seen: dict[str, Any] = {"bodies": [], "auth": [], "in_flight": 0, "max_in_flight": 0, "together": 1, "requests": 1}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(stub_app(seen), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("what", nargs="?", default="run")
    add_bench_arguments(p)
    add_handoff_arguments(p)
    return p.parse_args(list(argv))


def test_base_url_run_against_a_server_that_is_not_pdd(stub_server, tmp_path, monkeypatch) -> None:
    url, seen = stub_server
    seen |= {"together": 2, "requests": 6}
    monkeypatch.setenv("PDD_STATE_DIR", str(tmp_path / "state"))  # no `pdd up` cluster of ours here
    flags = "--workload random --requests 6 --rate 0 --random-input-len 20 --random-output-len 5 --max-concurrency 2"
    flags += " --ignore-eos --goodput ttft:60000 tpot:1 --label stub --api-key sk-test"
    args = bench_args("--base-url", url + "/v1/", "--out", str(tmp_path), *flags.split())
    assert bench.main(args) == 0

    assert len(seen["bodies"]) == 6 and seen["auth"] == ["Bearer sk-test"] * 6
    for body in seen["bodies"]:
        assert body["model"] == "stub-model" and body["ignore_eos"] is True and body["stream"] is True
        assert body["max_tokens"] == 5 and len(body["prompt"]) == 20
    assert seen["max_in_flight"] == 2  # six arrive at once; two at a time

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["target"] == {
        "base_url": url,
        "model": "stub-model",
        "pdd_cluster_on_this_host": False,
    }
    m = results["modes"]["stub"]
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (6, 0, 120, 30)
    assert m["request_throughput"] == pytest.approx(6 / m["duration"])
    assert m["output_throughput"] == pytest.approx(30 / m["duration"])
    assert m["request_goodput"] == 0.0  # tpot is ~20 ms > 1 ms
    assert m["median_ttft_ms"] >= TOKEN_GAP_S * 1000 and m["p99_itl_ms"] > 0 and m["mean_e2el_ms"] > m["mean_ttft_ms"]
    # figures only the pdd object (or our own fleet) can give are missing, not zeros
    assert (m["wan_kv_bytes"], m["tokens_by_role"], m["hit_rate"], m["cost"], m["bcr"], m["busy"]) == (None,) * 6
    report = (tmp_path / "report.md").read_text()
    assert "As `vllm bench serve` names them" in report and "| RLD tokens | n/a |" in report
    assert "Busy fraction" not in report


def test_replay_without_a_cap_sends_open_loop(stub_server) -> None:
    url, seen = stub_server
    seen |= {"together": 4, "requests": 4}
    workload = random_workload(4, seed=3, rate_rps=0, input_tokens=8, output_tokens=3)
    records, _ = asyncio.run(replay(Target(url), workload, "open"))
    assert seen["max_in_flight"] == 4 and seen["auth"] == [None] * 4
    assert all("model" not in b and "ignore_eos" not in b for b in seen["bodies"])  # PDD serves one model
    assert all(r["ok"] and r["pdd"] == {} and len(r["token_times_s"]) == 3 for r in records)


def test_streams_that_carry_no_token_fail_and_a_starting_server_is_waited_for(stub_server, capsys) -> None:
    """A server that answers 200 and streams only empty pieces (finish reason, usage, [DONE]) is
    broken: every request fails, none counts as a 0 ms TTFT or a matching output; the warm-up says
    so. Its first 503s (still starting) are asked again."""
    url, seen = stub_server
    seen |= {"together": 1, "requests": 3, "empty": True, "starting": 3}
    asyncio.run(warm_up(Target(url)))
    assert seen["starting"] == 0 and "is the server whole?" in capsys.readouterr().err
    records, _ = asyncio.run(replay(Target(url), random_workload(3, seed=1, rate_rps=0, output_tokens=4), "broken"))
    assert [(r["ok"], r["error"], r["output_tokens"]) for r in records] == [(False, NO_OUTPUT, 4)] * 3
    summary = build_results({"name": "random"}, {"duration_s": {"broken": 1.0}}, records)["modes"]["broken"]
    assert (summary["completed"], summary["failed"], summary["median_ttft_ms"]) == (0, 3, None)


def test_bad_flags_are_refused(tmp_path) -> None:
    for argv in (("--goodput", "ttft"), ("--goodput", "latency:5"), ("--max-concurrency", "0")):
        assert bench.main(bench_args("--base-url", "http://127.0.0.1:9", *argv, "--out", str(tmp_path))) == 2


def test_server_root_and_environment() -> None:
    for given in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert bench.server_root(given) == "http://h:8000"
    env = environment({"prefill-0": 1})
    assert env["cpu_count"] >= 1 and env["cpus_usable"] >= 1 and env["cpu_model"]
    assert env["packages"]["pdd"] and env["instance_threads"] == {"prefill-0": 1}
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
