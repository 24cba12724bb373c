"""Relay-decode through the HTTP API against real processes: eager tokens, token-id handoff
(one-shot and catch-up), every pipeline exact against the reference."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.cluster.conftest import completion, fresh_prompt, stream_completion

pytestmark = pytest.mark.slow

PLANS = [("p-md", None), ("p-rld-md", "oneshot"), ("p-rld-md", "catchup"), ("p-rld", None)]
PROMPTS = ["def quicksort(items):", "Water boils at"]


def _body(model_id: str, prompt: str, n: int, pipeline: str, handoff: str | None, **extra) -> dict:
    pdd = {"pipeline": pipeline, **({"handoff": handoff} if handoff else {})}
    return {"model": model_id, "prompt": prompt, "max_tokens": n, "temperature": 0, "pdd": pdd, **extra}


@pytest.mark.parametrize("pipeline, handoff", PLANS)
def test_every_pipeline_equals_reference(cluster, model_id, reference, smol_tokenizer, pipeline, handoff):
    for prompt in PROMPTS:
        body = _body(model_id, prompt, 24, pipeline, handoff)
        text, pdd, _ = stream_completion(cluster.url + "/v1/completions", body)
        assert text == reference(smol_tokenizer(prompt)["input_ids"], 24), (pipeline, handoff, prompt)
        assert pdd["pipeline"] == pipeline
        roles = pdd["tokens_by_role"]
        if pipeline == "p-rld-md" and roles["md"]:  # handed over (unless it ended on relay first)
            assert roles["rld"] >= 1 and pdd["handoff_chunks"] >= 1 and pdd["handoff"] == handoff
        if pipeline == "p-rld":
            assert roles["md"] == 0 and pdd["wan_kv_bytes"] == 0
        if pipeline == "p-md":
            assert roles["rld"] == 0 and pdd["local_kv_bytes"] == 0


def test_relay_hands_over_to_main(cluster, model_id, reference, smol_tokenizer):
    prompt = "Write a short poem about the sea."
    body = _body(model_id, prompt, 48, "p-rld-md", "oneshot", ignore_eos=True)
    text, pdd, _ = stream_completion(cluster.url + "/v1/completions", body)
    assert pdd["tokens_by_role"]["rld"] >= 1 and pdd["tokens_by_role"]["md"] >= 1
    assert pdd["handoff_chunks"] == 1 and pdd["timings_ms"]["extend"] > 0
    assert sum(pdd["tokens_by_role"].values()) == 48


def test_seeded_sampling_is_identical_through_every_pipeline(cluster, model_id):
    texts = {}
    for pipeline, handoff in PLANS:
        body = _body(model_id, "My favourite animal is", 32, pipeline, handoff, seed=1234, ignore_eos=True)
        body.update(temperature=0.9, top_p=0.95)
        texts[(pipeline, handoff)] = completion(cluster.url, body)["choices"][0]["text"]
    assert len(set(texts.values())) == 1, texts


def _slow_wan_run(cluster, operator, body: dict, mbps: float) -> tuple[str, dict]:
    try:
        assert operator.wan(bandwidth_mbps=mbps).ok
        text, pdd, _ = stream_completion(cluster.url + "/v1/completions", body)
    finally:
        operator.wan(bandwidth_mbps=cluster.cfg.wan.bandwidth_mbps)
    return text, pdd


def test_relay_hides_a_slow_wan(cluster, model_id, operator, reference, smol_tokenizer):
    runs = {}
    for pipeline in ("p-md", "p-rld-md"):
        for speed in ("fast", "slow"):
            prompt = fresh_prompt(40, pipeline + speed)  # ~130 tokens: ~6 MB of KV, uncached
            body = _body(model_id, prompt, 64, pipeline, "oneshot" if pipeline == "p-rld-md" else None)
            if speed == "fast":
                text, runs[pipeline, speed], _ = stream_completion(cluster.url + "/v1/completions", body)
            else:
                text, runs[pipeline, speed] = _slow_wan_run(cluster, operator, body, mbps=20)
            assert text == reference(smol_tokenizer(prompt)["input_ids"], 64)
    ttft = {k: v["timings_ms"]["ttft"] for k, v in runs.items()}
    print("\nTTFT ms (WAN 1000 Mbps -> 20 Mbps): " + ", ".join(f"{p} {ttft[p, 'fast']:.0f} -> {ttft[p, 'slow']:.0f}"
                                                           for p in ("p-md", "p-rld-md")))  # fmt: skip
    transfer_s = runs["p-md", "slow"]["wan_kv_bytes"] * 8 / 20e6
    assert ttft["p-md", "slow"] - ttft["p-md", "fast"] > 600 * transfer_s
    assert ttft["p-rld-md", "slow"] < ttft["p-rld-md", "fast"] + 0.3 * transfer_s * 1000
    slow = runs["p-rld-md", "slow"]
    assert slow["tokens_by_role"]["rld"] > 1 and slow["tokens_by_role"]["md"] >= 1


def test_catch_up_has_a_smaller_stall_than_one_shot(cluster, model_id, operator, reference, smol_tokenizer):
    gaps, chunks = {}, {}
    for handoff in ("oneshot", "catchup"):
        body = _body(model_id, fresh_prompt(40, handoff), 160, "p-rld-md", handoff, ignore_eos=True)
        _, pdd = _slow_wan_run(cluster, operator, body, mbps=6)  # ~8 s of WAN: a backlog of ~70 tokens
        gaps[handoff], chunks[handoff] = pdd["handoff_gap_ms"], pdd["handoff_chunks"]
        assert pdd["tokens_by_role"]["md"] >= 1, pdd
    print(f"\nhandoff stall: one-shot {gaps['oneshot']:.0f} ms ({chunks['oneshot']} chunk), "
          f"catch-up {gaps['catchup']:.0f} ms ({chunks['catchup']} chunks)")
    assert chunks["oneshot"] == 1 and chunks["catchup"] >= 2
    assert gaps["catchup"] < gaps["oneshot"]


def test_mixed_concurrent_pipelines_complete_and_free_every_block(cluster, model_id, operator, reference,
                                                                  smol_tokenizer):  # fmt: skip
    jobs = [(p, h, f"Fact number {i}: the sun") for i, (p, h) in enumerate(PLANS * 2)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(
            lambda j: stream_completion(cluster.url + "/v1/completions", _body(model_id, j[2], 20, j[0], j[1])), jobs))
    for (pipeline, handoff, prompt), (text, _, _) in zip(jobs, results):
        assert text == reference(smol_tokenizer(prompt)["input_ids"], 20), (pipeline, handoff)
    for state in operator.idle(timeout=2.0).values():
        assert state.requests == [], state
        assert state.free_blocks + state.extra["cached_blocks"] == state.total_blocks, state
