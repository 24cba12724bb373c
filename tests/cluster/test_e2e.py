"""End to end through the HTTP API against real processes: gateway -> scheduler -> prefill
-> (WAN emulator) -> main-decode, over real NATS, Redis and TCP, with the real SmolLM2."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import httpx
import psutil
import pytest

from tests.cluster.conftest import fresh_prompt, in_flight, stream_completion
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_and_whole_outputs_equal_reference(cluster, model_id, reference, smol_tokenizer, prompt):
    body = {"model": model_id, "prompt": prompt, "max_tokens": 20, "temperature": 0}
    whole = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120).json()
    expected = reference(smol_tokenizer(prompt)["input_ids"], 20, draft=whole["choices"][0]["text"])
    assert whole["choices"][0]["text"] == expected
    text, pdd, _ = stream_completion(cluster.url + "/v1/completions", body)
    assert text == expected
    assert pdd["pipeline"] in ("p-md", "p-rld-md") and pdd["instances"]["md"] == "md-0"  # the policy's choice
    assert sum(pdd["tokens_by_role"].values()) == whole["usage"]["completion_tokens"]


def test_chat_applies_the_template(cluster, model_id, reference, smol_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = {"model": model_id, "messages": messages, "max_tokens": 24, "temperature": 0}
    whole = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=120).json()
    ids = smol_tokenizer(template, add_special_tokens=False)["input_ids"]
    expected = reference(ids, 24, draft=whole["choices"][0]["message"]["content"])
    assert whole["choices"][0]["message"]["content"] == expected
    assert "Paris" in expected
    text, _, events = stream_completion(cluster.url + "/v1/chat/completions", body)
    assert text == expected and events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_eight_concurrent_streams(cluster, model_id, reference, smol_tokenizer):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    bodies = [{"model": model_id, "prompt": p, "max_tokens": 12, "temperature": 0} for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: stream_completion(cluster.url + "/v1/completions", b), bodies))
    for prompt, (text, pdd, _) in zip(prompts, results):
        assert text == reference(smol_tokenizer(prompt)["input_ids"], 12, draft=text), prompt
        assert sum(pdd["tokens_by_role"].values()) >= 1


def test_observability_contract(cluster, model_id):
    body = {"model": model_id, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    pdd = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60).json()["pdd"]
    assert set(pdd) >= {
        "request_id",
        "pipeline",
        "handoff",
        "instances",
        "tokens_by_role",
        "handoff_chunks",
        "wan_kv_bytes",
        "local_kv_bytes",
        "prefix_hit_tokens",
        "timings_ms",
    }
    assert set(pdd["instances"]) == {"prefill", "rld", "md"}
    assert set(pdd["tokens_by_role"]) == {"prefill", "rld", "md"}
    assert set(pdd["prefix_hit_tokens"]) == {"prefill", "md"}
    assert set(pdd["timings_ms"]) == {"queue", "prefill", "kv_local", "kv_wan", "extend", "ttft", "e2e"}
    assert pdd["timings_ms"]["ttft"] > 0 and pdd["timings_ms"]["e2e"] >= pdd["timings_ms"]["ttft"]


def test_forced_plan_and_bad_override(cluster, model_id):
    body = {"model": model_id, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    ok = httpx.post(cluster.url + "/v1/completions", json={**body, "pdd": {"pipeline": "p-md"}}, timeout=60)
    assert ok.status_code == 200 and ok.json()["pdd"]["plan_reason"] == "forced"
    bad = httpx.post(cluster.url + "/v1/completions", json={**body, "pdd": {"pipeline": "p-xyz"}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "pdd.pipeline"


def test_metrics_and_health(cluster, model_id):
    httpx.post(cluster.url + "/v1/completions", json={"model": model_id, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    text = httpx.get(cluster.url + "/metrics").text
    assert "pdd:time_to_first_token_seconds_bucket" in text
    assert re.search(r'^pdd:requests_total\{[^}]*outcome="finished"[^}]*\} [1-9]', text, re.M)
    assert httpx.get(cluster.url + "/health").json()["status"] == "ok"


# a few-shot prompt whose answer starts inside a character: the model's first token is a space and
# the first byte of 猫 (two more tokens complete it), so the client's first text is the space alone
CJK_TAIL = "\nEnglish: cat. Chinese: 猫. English: dog. Chinese: 狗. English: bird. Chinese:"


@pytest.mark.parametrize("tail", ["", CJK_TAIL], ids=["ascii", "mid-character"])
def test_the_first_token_never_waits_for_the_line(cluster, model_id, operator, reference, smol_tokenizer, tail):
    """`first_token: prefill` (the default): with main-decode's KV crawling at 1 Mbps (~15 MB, two
    minutes of it), the first token reaches the client from prefill while the line has carried
    almost none of the KV; the rest comes from main-decode once the line opens again. A first
    token that ends inside a character still shows what precedes it (the gateway's detokenizer)."""
    prompt = fresh_prompt(100, "first") + tail  # ~330 tokens: ~15 MB of fp32 KV
    body = {"model": model_id, "prompt": prompt, "max_tokens": 8, "temperature": 0, "pdd": {"pipeline": "p-md"}}
    events: list[dict] = []
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=stream_completion(cluster.url + "/v1/completions", body, timeout=240, events=events)
        )
    )
    before = operator.line_bytes("md-0")
    try:
        operator.wan(bandwidth_mbps=1.0)
        worker.start()
        deadline = time.monotonic() + 120
        while not any(e["choices"] and e["choices"][0].get("text") for e in list(events)):
            assert worker.is_alive() and time.monotonic() < deadline, "no first token while the line crawled"
            time.sleep(0.01)
        crossed = operator.line_bytes("md-0") - before
        first = next(e["choices"][0]["text"] for e in list(events) if e["choices"] and e["choices"][0].get("text"))
    finally:
        operator.wan(bandwidth_mbps=cluster.cfg.wan.bandwidth_mbps)
        worker.join(240)
    text, pdd, _ = result["out"]
    t = pdd["timings_ms"]
    print(
        f"\nWAN KV {pdd['wan_kv_bytes'] / 1e6:.1f} MB at 1 Mbps: first token at {t['ttft']:.0f} ms (prefill "
        f"{t['prefill']:.0f} ms), {crossed / 1e3:.0f} kB of the KV on the line by then"
    )
    assert text == reference(smol_tokenizer(prompt)["input_ids"], 8, draft=text)
    assert pdd["tokens_by_role"] == {"prefill": 1, "rld": 0, "md": 7}, pdd["tokens_by_role"]
    assert crossed < pdd["wan_kv_bytes"] / 4, "the first token came before main-decode had its KV"
    assert first == (" " if tail else text[: len(first)]), (first, text)
    assert t["ttft"] < t["queue"] + t["prefill"] + t["kv_wan"]


def test_client_disconnect_frees_every_stage(cluster, model_id, operator):
    body = {
        "model": model_id,
        "prompt": "Tell me a long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # leave mid-stream
    left = time.monotonic()
    states = operator.idle()
    print(f"\nafter disconnect ({time.monotonic() - left:.2f}s): {states}")
    for instance, s in states.items():
        assert s.requests == [], instance
        assert s.free_blocks + s.figures.engine.cached_blocks == s.total_blocks, instance
    assert operator.request_keys() == []


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    "payload, status, param",
    [
        (b"{not json", 400, None),  # malformed JSON
        (b'{"prompt": "\xff\xfe bad bytes"}', 400, None),  # invalid UTF-8
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),  # unknown model
        ({"max_tokens": 4}, 400, "prompt"),  # missing prompt
        ({"prompt": ""}, 400, "prompt"),  # empty prompt
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),  # wrong types
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),  # over the context
        ({"prompt": "hello " * 9000, "max_tokens": 4}, 400, "prompt"),  # prompt over the context
        ({"prompt": "hello " * 4000, "max_tokens": 4500}, 400, "max_tokens"),  # prompt + max_tokens over it
        ({"prompt": "x", "temperature": 7}, 400, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "stop": 5}, 400, "stop"),  # bad stop
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "x", "pdd": {"route": "p-md"}}, 400, "pdd.route"),  # unknown pdd override
        ({"prompt": "x", "pdd": {"pipeline": "p-fast"}}, 400, "pdd.pipeline"),
        (b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413, None),  # huge body
        ((CHAT, {"max_tokens": 4}), 400, "messages"),  # missing messages
        ((CHAT, {"messages": []}), 400, "messages"),
        ((CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role"),
        ((CHAT, {"messages": "hello"}), 400, "messages"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_leaves_nothing(cluster, operator, payload, status, param):
    path, payload = payload if isinstance(payload, tuple) else ("/v1/completions", payload)
    kwargs = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = httpx.post(cluster.url + path, headers={"content-type": "application/json"}, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    assert in_flight(cluster.url) == 0
    for inst in cluster.cfg.instances:
        assert operator.inspect(inst.id).requests == []


def test_stop_strings_finish_reasons_and_chunk_shape(cluster, model_id, reference, smol_tokenizer):
    """Stop strings cut the text before the first one that occurs, even inside a token and across
    tokens (finish_reason "stop"); max_tokens ends with "length". Every chunk of a stream is one
    text_completion object with one id; the usage chunk comes last when asked for."""
    prompt = "Count: one, two, three,"
    full = reference(smol_tokenizer(prompt)["input_ids"], 24, ignore_eos=True)
    stops = ["zebra", " ten", "ht, ni"]  # "ht, ni" spans " eight" "," " nine": it occurs before " ten"
    assert all(s in full for s in stops[1:]) and "zebra" not in full, full
    expected = full[: min(full.index(s) for s in stops[1:])]
    assert expected and expected.endswith(" eig"), expected
    body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(cluster.url + "/v1/completions", json={**body, "stop": stops}, timeout=120).json()
    assert whole["object"] == "text_completion" and whole["id"]
    assert whole["choices"][0]["text"] == expected and whole["choices"][0]["finish_reason"] == "stop"
    text, _, events = stream_completion(cluster.url + "/v1/completions", {**body, "stop": stops})
    assert text == expected and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(e["object"] == "text_completion" for e in events)
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    whole = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120).json()
    assert whole["choices"][0]["text"] == full and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 24
    text, pdd, events = stream_completion(
        cluster.url + "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert text == full and events[-2]["choices"][0]["finish_reason"] == "length" and "pdd" in events[-2]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24 and usage["id"] == events[0]["id"]
    assert all(e.get("usage") is None or e is usage for e in events)


def test_no_live_instance_of_a_role_is_503_and_health_says_so(cluster, model_id, operator, reference, smol_tokenizer):
    """The only prefill instance dies: once its heartbeat expires /health answers 503 naming the
    role, a request is refused with 503 at once and leaves nothing behind; back, it serves again."""
    body = {"model": model_id, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    cluster.kill("prefill-0")
    try:
        until(
            lambda: httpx.get(cluster.url + "/health").status_code == 503,
            3 * cluster.cfg.heartbeat_ttl_s + 5,
            "/health to notice that prefill-0 is gone",
        )
        assert httpx.get(cluster.url + "/health").json() == {"status": "degraded", "missing_roles": ["prefill"]}
        t0 = time.perf_counter()
        r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        refused_s = time.perf_counter() - t0
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable" and "prefill" in r.json()["error"]["message"]
        assert refused_s < 5, refused_s  # planned and refused, not waited out
        assert in_flight(cluster.url) == 0
        assert operator.request_keys() == []
    finally:
        cluster.start_process("prefill-0")
        registry = operator.redis()
        until(lambda: registry.exists("pdd:instance:prefill-0"), 120, "prefill-0 to register again", every=0.2)
        registry.close()
    assert httpx.get(cluster.url + "/health").status_code == 200
    out = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text
    text = out.json()["choices"][0]["text"]
    assert text == reference(smol_tokenizer(body["prompt"])["input_ids"], 6, draft=text)
    _all_forked_from_one_server(cluster)  # the restarted prefill-0 too


def _all_forked_from_one_server(cluster) -> None:
    """Every service of the cluster is a child of the one fork server (pdd/forkserver.py) that
    imported torch and the rest for all of them."""
    (server,) = {p.server for p in cluster.procs.values()}
    for name, proc in cluster.procs.items():
        assert psutil.Process(proc.pid).ppid() == server.proc.pid, name
