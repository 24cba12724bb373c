"""Operable like the serving stacks people run, against the live cluster: the official OpenAI
SDK works unchanged, every process serves Prometheus metrics under vLLM's names, one request id
can be followed through every service's log, and `pdd status` shows both sites and the line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdd.control import format_status, gather_status, write_state
from tests.cluster.conftest import fresh_prompt, stream_completion
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused-on-an-open-gateway", max_retries=0)


def test_sdk_chat_and_completions_streamed_and_whole(client, model_id, reference, smol_tokenizer):
    prompt = "The capital of France is"
    whole = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0)
    expected = reference(smol_tokenizer(prompt)["input_ids"], 8, draft=whole.choices[0].text)
    assert whole.choices[0].text == expected and whole.usage.completion_tokens >= 1
    stream = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0)
    streamed = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    parts = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in parts) == chat.choices[0].message.content
    assert parts[0].object == "chat.completion.chunk" and parts[-1].choices[0].finish_reason in ("stop", "length")


def test_sdk_models_and_unsupported_parameters(client, model_id):
    assert client.models.retrieve(model_id).id == model_id and client.models.list().data[0].created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for kwargs, param in (
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"n": 2}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs
            )
        assert e.value.body["param"] == param, (kwargs, e.value.body)


def test_a_client_that_times_out_leaves_every_stage_idle(cluster, model_id, operator):
    impatient = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=model_id, prompt=fresh_prompt(300, "impatient"), max_tokens=200, temperature=0
        )
    gone = time.monotonic()
    states = operator.idle()
    assert all(s.requests == [] for s in states.values()), {i: s.requests for i, s in states.items()}
    print(f"\nevery stage idle {time.monotonic() - gone:.2f} s after the client gave up")


def _metrics(url: str) -> dict[str, dict]:
    text = httpx.get(url, timeout=10).text
    return {
        f.name: {
            tuple(sorted(s.labels.items())): s.value
            for s in f.samples
            if s.name.endswith(("_total", "_bucket", "_count", "_sum")) or s.name == f.name
        }
        for f in text_string_to_metric_families(text)
    }


def test_every_process_serves_prometheus_metrics(cluster, model_id):
    urls = {"gateway": cluster.url + "/metrics", "scheduler": f"http://127.0.0.1:{cluster.cfg.scheduler.metrics_port}"}
    urls |= {i.id: f"http://127.0.0.1:{i.metrics_port}" for i in cluster.cfg.instances}
    before = _metrics(urls["gateway"]).get("pdd:request_success", {})
    stop = (("finished_reason", "stop"), ("instance", "gateway"), ("model_name", model_id))
    used = (("instance", "prefill-0"), ("model_name", model_id), ("outcome", "used"))

    def early(outcome: str = "used") -> float:
        counts = _metrics(urls["prefill-0"]).get("pdd:kv_early_connections", {})
        return sum(v for k, v in counts.items() if outcome in ("any", dict(k)["outcome"]))

    settled_before = early("any")
    body = {
        "model": model_id,
        "prompt": "Count: one, two, three,",
        "max_tokens": 24,
        "temperature": 0,
        "stop": [" four"],
        "ignore_eos": True,
        "pdd": {"pipeline": "p-md"},
    }
    _, _, events = stream_completion(cluster.url + "/v1/completions", body, timeout=60)
    assert next(e for e in reversed(events) if e["choices"])["choices"][0]["finish_reason"] == "stop"
    # its first token (prefill's) may be " four": the request ends there, and its KV push with it
    # (its early connection counted unused), or the push got there first; either way it settles
    until(lambda: early("any") >= settled_before + 1, 30, "the first request's early connection to settle")
    early_before = early()
    body = {**body, "prompt": fresh_prompt(8, "gaps"), "max_tokens": 8, "stop": []}  # tokens apart: gaps
    roles = stream_completion(cluster.url + "/v1/completions", body, timeout=60)[1]["tokens_by_role"]
    assert roles == {"prefill": 1, "rld": 0, "md": 7}  # the first token is prefill's
    # the KV crossed the WAN on the connection prefill dialed when the task came (counted as its
    # push ends, which may be after the user's stream: main-decode streams once it has the KV)
    until(lambda: early() >= early_before + 1, 30, "prefill to count the early connection used")
    families = {name: _metrics(url) for name, url in urls.items()}
    assert families["gateway"]["pdd:request_success"][stop] == before.get(stop, 0) + 1
    assert families["prefill-0"]["pdd:kv_early_connections"][used] == early_before + 1
    zero_gaps = [v for k, v in families["gateway"]["pdd:inter_token_latency_seconds"].items() if ("le", "1e-06") in k]
    assert zero_gaps and max(zero_gaps) == 0  # no inter-token observation is (almost) zero
    md = families["md-0"]["pdd:num_requests_running"]
    assert (("instance", "md-0"), ("model_name", model_id)) in md
    for name, fam in families.items():
        assert all(dict(labels).get("model_name") == model_id for f in fam.values() for labels in f), name
    assert "pdd:prefix_cache_hits" in families["prefill-0"] and "pdd:kv_transfer_bytes" in families["prefill-0"]
    assert "pdd:wan_bandwidth_estimate_mbps" in families["scheduler"] and "pdd:plans" in families["scheduler"]
    # every process froze its startup objects (shared/heap.py): a full collection no longer walks
    # the model's and the libraries' ~370k objects while a step waits
    for name, fam in families.items():
        assert max(fam["pdd:gc_frozen_objects"].values()) > 50_000, name


def test_a_request_id_is_found_in_every_services_log(cluster, model_id):
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"prompt": fresh_prompt(10, "grep"), "max_tokens": 4, "temperature": 0, "pdd": {"pipeline": "p-rld-md"}},
        headers={"X-Request-Id": "trace-me-42"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-42" and r.json()["id"] == "trace-me-42"

    def logged(name: str) -> bool:
        return "trace-me-42" in (cluster.run_dir / f"{name}.log").read_text()

    deadline = time.monotonic() + 10
    while not all(map(logged, ("gateway", "scheduler", "prefill-0", "rld-0", "md-0"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(map(logged, ("gateway", "scheduler", "prefill-0", "rld-0", "md-0")))
    line = next(x for x in (cluster.run_dir / "gateway.log").read_text().splitlines() if "request_id=trace-me-42" in x)
    assert "pipeline=p-rld-md" in line and "outcome=finished" in line


def test_pdd_status_shows_both_sites_and_the_line(cluster, tmp_path):
    view = asyncio.run(gather_status(cluster.cfg))
    assert {r["id"] for r in view["datacenters"]["A"]} == {"prefill-0", "rld-0"}
    assert [r["id"] for r in view["datacenters"]["B"]] == ["md-0"]
    assert all(r["state"] == "up" and "kv_blocks" in r for rows in view["datacenters"].values() for r in rows)
    assert set(view["wan"]["lines"]) == {"a-b", "b-a"} and view["wan"]["estimate_mbps"] > 0
    assert "datacenter B" in format_status(view)
    env = {**os.environ, "PDD_STATE_DIR": str(tmp_path)}
    os.environ["PDD_STATE_DIR"] = str(tmp_path)
    try:
        write_state(cluster.url, cluster.cfg.port, cluster.config_path)
    finally:
        del os.environ["PDD_STATE_DIR"]
    out = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout)["datacenters"]["B"][0]["id"] == "md-0"


def test_sdk_penalties_change_the_output_and_survive_a_handoff(client, model_id):
    kw = {"model": model_id, "prompt": "Fruit: apple, apple, apple, apple,", "max_tokens": 24, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    knobs = {"frequency_penalty": 1.5, "presence_penalty": 1.0, "extra_body": {"repetition_penalty": 1.2}}
    runs = [client.completions.create(**kw, **knobs).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1] != plain
    relay = {"repetition_penalty": 1.2, "pdd": {"pipeline": "p-rld-md", "handoff": "catchup"}}
    assert client.completions.create(**kw, **{**knobs, "extra_body": relay}).choices[0].text == runs[0]
    early = client.completions.create(**kw, extra_body={"min_tokens": 6, "stop_token_ids": [11]})
    assert early.usage.completion_tokens >= 6
