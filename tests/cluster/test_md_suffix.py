"""Main-decode computes a short suffix itself (services/scheduler/policy.py `choose_suffix`),
against real processes: float32 prefill and main-decode across a slow line, where pushing a
token of KV takes 18 ms and main-decode extends one in a few. A session's second turn lacks a
short suffix at main-decode: no KV of it crosses, main-decode computes it, and the answer is
the model's own."""

from __future__ import annotations

import httpx
import pytest

from pdd.launcher import Cluster
from tests.cluster.conftest import Operator, completion, fresh_prompt
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow

KV_BYTES_PER_TOKEN = 46_080  # SmolLM2 fp32
SUFFIX_CAP = 64  # the first turn's prompt is longer: pushed
BLOCK = 16


@pytest.fixture(scope="module")
def slow_line():
    """Prefill and main-decode in float32 (the instances' default), 20 Mbps between them, no
    relay: every request runs p-md. The scheduler's prior for the line is the line's figure."""
    settings = {
        "port": 0,
        "wan": {"bandwidth_mbps": 20.0, "delay_ms": 10.0, "jitter_ms": 0.0},
        "scheduler": {"wan_mbps": 20.0, "md_suffix_max_tokens": SUFFIX_CAP},
        "instances": [
            {"id": "prefill-0", "role": "prefill", "dc": "A", "kv_tokens": 4096, "threads": 1},
            {"id": "md-0", "role": "md", "dc": "B", "kv_tokens": 4096, "threads": 1},
        ],
    }
    with Cluster(log=lambda m: None, **settings) as cluster:
        yield cluster


def test_a_second_turn_sends_no_kv_and_main_decode_computes_its_suffix(slow_line, reference, smol_tokenizer):
    op = Operator(slow_line)
    model = httpx.get(slow_line.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    first_ids = smol_tokenizer(fresh_prompt(40, "suffix"))["input_ids"]
    assert len(first_ids) > SUFFIX_CAP
    first = completion(slow_line.url, {**body, "prompt": first_ids})["pdd"]
    assert (first["pipeline"], first["md_computes_suffix"], first["md_suffix_reason"]) == ("p-md", 0, "over-cap")
    assert first["wan_kv_bytes"] >= len(first_ids) * KV_BYTES_PER_TOKEN

    # main-decode's cache of the first prompt reaches the prefix index the second is planned on
    held = len(first_ids) // BLOCK * BLOCK
    redis = op.redis()
    try:
        until(lambda: redis.scard("pdd:kv:md-0") >= held // BLOCK, 10, "md-0's blocks in the prefix index")
    finally:
        redis.close()

    second_ids = first_ids + smol_tokenizer(" Now list the next three items.")["input_ids"]
    before = op.line_bytes("md-0")
    out = completion(slow_line.url, {**body, "prompt": second_ids})
    crossed = op.line_bytes("md-0") - before
    pdd, text = out["pdd"], out["choices"][0]["text"]
    suffix = len(second_ids) - held
    print(
        f"\nsecond turn: {len(second_ids)} tokens, md holds {pdd['md_cached_tokens']}, computes {suffix}: "
        f"{pdd['md_suffix_reason']} (push {pdd['plan_estimates']['md_push_ms']:.0f} ms, extend "
        f"{pdd['plan_estimates']['md_extend_ms']:.0f} ms); {pdd['wan_kv_bytes']} B of transfer, {crossed} B on the line"
    )
    assert (pdd["pipeline"], pdd["md_suffix_reason"]) == ("p-md", "extend-cheaper")
    assert (pdd["md_cached_tokens"], pdd["md_computes_suffix"]) == (held, suffix) and 0 < suffix <= SUFFIX_CAP
    assert pdd["plan_estimates"]["md_push_ms"] > pdd["plan_estimates"]["md_extend_ms"] > 0
    # no KV crossed: the transfer was its header and the first token, less than a token's KV
    assert 0 < pdd["wan_kv_bytes"] < KV_BYTES_PER_TOKEN and crossed < KV_BYTES_PER_TOKEN
    assert (pdd["prefix_hit_tokens"]["md"], pdd["recomputed_tokens"]) == (held, 0)
    assert text == reference(second_ids, 16, ignore_eos=True, draft=text)
