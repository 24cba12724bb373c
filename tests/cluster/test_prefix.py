"""Prefix caches on both sides, against real processes: prefill skips the cached prefix, the
decode-side RadixCache keeps main-decode aligned with it, and only new KV crosses the WAN.
Two prefill and two main-decode instances, so routing has to follow the cache."""

from __future__ import annotations

import threading

import httpx
import pytest

from pdd.launcher import Cluster
from shared.messages import InstanceState
from tests.cluster.conftest import Operator, fresh_prompt, tls_overhead
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow

KV_BYTES_PER_TOKEN = 46_080  # SmolLM2 fp32
FRAMING = 4096  # frame headers, msgpack header and DONE: far below one token's KV


@pytest.fixture(scope="module")
def pcluster(fleet):
    return fleet


@pytest.fixture(scope="module")
def pop(fleet_operator) -> Operator:
    return fleet_operator


def chat(cluster: Cluster, messages: list[dict], n: int, **extra) -> dict:
    body = {"messages": messages, "max_tokens": n, "temperature": 0, **extra}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def reference_chat(tok, reference, messages, n, draft: str | None = None) -> str:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference(tok(text, add_special_tokens=False)["input_ids"], n, draft=draft)


def test_five_turns_send_only_new_kv_over_the_wan(pcluster, pop, smol_tokenizer, reference):
    messages = [{"role": "system", "content": "You are a terse assistant. " + fresh_prompt(60)}]
    previous_total, mds = 0, set()
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: name one prime number above {turn * 10}."})
        before = sum(pop.line_bytes(i.id) for i in pop.cluster.cfg.of_role("md"))
        out = chat(pcluster, messages, 16)
        line = sum(pop.line_bytes(i.id) for i in pop.cluster.cfg.of_role("md")) - before
        pdd, usage = out["pdd"], out["usage"]
        text = out["choices"][0]["message"]["content"]
        assert text == reference_chat(smol_tokenizer, reference, messages, 16, draft=text), turn
        wan, hit_md, hit_p = pdd["wan_kv_bytes"], pdd["prefix_hit_tokens"]["md"], pdd["prefix_hit_tokens"]["prefill"]
        print(
            f"\nturn {turn}: prompt {usage['prompt_tokens']} tokens, prefill hit {hit_p}, md hit {hit_md}, "
            f"WAN {wan / 1e6:.2f} MB via {pdd['instances']}"
        )
        assert wan < line <= wan + tls_overhead(wan)  # the KV crossed the line, in TLS, and nothing else
        assert wan - FRAMING <= (usage["prompt_tokens"] - hit_md) * KV_BYTES_PER_TOKEN <= wan
        if turn > 0:
            new_tokens = usage["prompt_tokens"] - previous_total
            assert wan <= (new_tokens + 2 * 16) * KV_BYTES_PER_TOKEN + FRAMING  # new tokens, within a block
            assert abs(hit_md - hit_p) <= 16 and hit_md > 0
            mds.add(pdd["instances"]["md"])
        previous_total = usage["prompt_tokens"] + usage["completion_tokens"]
        messages.append({"role": "assistant", "content": text})
    assert len(mds) == 1  # the conversation stays where its cache is


def _md_state(pop: Operator, md: str) -> InstanceState:
    return pop.inspect(md)


def test_shared_system_prompt_is_stored_once(pcluster, pop):
    system = {"role": "system", "content": fresh_prompt(120, "shared")}
    a = chat(pcluster, [system, {"role": "user", "content": "First question?"}], 8, pdd={"pipeline": "p-md"})
    md = a["pdd"]["instances"]["md"]
    pop.idle()
    before = _md_state(pop, md).figures.engine.cached_blocks
    b = chat(
        pcluster, [system, {"role": "user", "content": "A different second question?"}], 8, pdd={"pipeline": "p-md"}
    )
    assert b["pdd"]["instances"]["md"] == md and b["pdd"]["prefix_hit_tokens"]["md"] >= 100
    pop.idle()
    after = _md_state(pop, md).figures.engine.cached_blocks
    computed = b["usage"]["prompt_tokens"] + b["usage"]["completion_tokens"] - 1  # last token has no KV
    hit_blocks = b["pdd"]["prefix_hit_tokens"]["md"] // 16
    print(f"\nmd cached blocks: {before} -> {after}; B added {computed // 16} blocks of which {hit_blocks} shared")
    assert after - before == computed // 16 - hit_blocks


def test_many_conversations_under_a_small_pool(pcluster, pop, smol_tokenizer, reference):
    """md pools hold 2048 tokens: these conversations do not fit, eviction keeps them going."""
    convs = [[{"role": "system", "content": fresh_prompt(90, f"c{i}")}] for i in range(8)]
    for turn in range(2):
        for i, conv in enumerate(convs):
            conv.append({"role": "user", "content": f"Question {turn} of conversation {i}?"})
            out = chat(pcluster, conv, 8)
            text = out["choices"][0]["message"]["content"]
            assert text == reference_chat(smol_tokenizer, reference, conv, 8, draft=text), (i, turn)
            conv.append({"role": "assistant", "content": text})
    for state in pop.idle().values():
        assert state.requests == [] and state.free_blocks + state.figures.engine.cached_blocks == state.total_blocks


def test_prefix_evicted_in_flight_is_recomputed(pcluster, pop, smol_tokenizer, reference):
    conv = [{"role": "system", "content": fresh_prompt(150, "evict")}, {"role": "user", "content": "Say something."}]
    first = chat(pcluster, conv, 8, pdd={"pipeline": "p-md"})
    md = first["pdd"]["instances"]["md"]
    conv += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And now something else, please."},
    ]
    result = {}
    try:
        pop.wan(bandwidth_mbps=2.0)  # the ~20 new tokens take ~4 s to cross
        worker = threading.Thread(target=lambda: result.update(chat(pcluster, conv, 8, pdd={"pipeline": "p-md"})))
        worker.start()
        until(lambda: pop.inspect(md).requests, 10, f"{md} to hold the second turn")
        flushed = pop.flush(md)
        assert flushed.figures.engine.cached_blocks == 0
        worker.join(60)
    finally:
        pop.wan(bandwidth_mbps=pcluster.cfg.wan.bandwidth_mbps)
    pdd = result["pdd"]
    print(f"\nplanned md prefix {pdd['md_cached_tokens']}, recomputed {pdd['recomputed_tokens']} after the flush")
    assert pdd["instances"]["md"] == md and pdd["md_cached_tokens"] > 0
    assert pdd["recomputed_tokens"] == pdd["md_cached_tokens"]
    text = result["choices"][0]["message"]["content"]
    assert text == reference_chat(smol_tokenizer, reference, conv, 8, draft=text)


def test_restarted_md_clears_its_index_and_requests_go_on(pcluster, pop):
    conv = [{"role": "system", "content": fresh_prompt(80, "restart")}, {"role": "user", "content": "Hi?"}]
    md = chat(pcluster, conv, 4, pdd={"pipeline": "p-md"})["pdd"]["instances"]["md"]
    r = pop.redis()
    assert r.scard(f"pdd:kv:{md}") > 0
    pcluster.kill(md)
    until(lambda: not r.exists(f"pdd:instance:{md}"), 3 * pcluster.cfg.heartbeat_ttl_s, f"{md}'s heartbeat to expire")
    during = chat(pcluster, conv, 4)
    assert during["pdd"]["instances"]["md"] != md  # the scheduler no longer counts on it
    pcluster.start_process(md)
    until(lambda: r.exists(f"pdd:instance:{md}"), 60, f"{md} to register again", every=0.2)
    assert r.scard(f"pdd:kv:{md}") == 0  # restarted empty: its old entries are gone
    after = chat(pcluster, conv, 4)
    assert after["choices"][0]["message"]["content"] == during["choices"][0]["message"]["content"]
    r.close()


def test_the_next_turn_finds_the_previous_answer_in_prefills_cache(pcluster, pop, smol_tokenizer):
    """The answer of a turn is generated by main-decode in B; prefill in A never computed it. Once
    the turn ends, its prompt and answer go back to its prefill (token ids), which computes the
    answer into its cache while idle: the next turn's prefill hit covers the answer too."""
    from tests.cluster.test_operability import _metrics

    def warmed() -> float:
        urls = [f"http://127.0.0.1:{i.metrics_port}" for i in pcluster.cfg.of_role("prefill")]
        return sum(v for url in urls for v in _metrics(url).get("pdd:prefill_answers_warmed", {}).values())

    messages = [
        {"role": "system", "content": "You answer in full sentences. " + fresh_prompt(40)},
        {"role": "user", "content": "Describe a harbour at dawn."},
    ]
    before, n = warmed(), 48
    first = chat(pcluster, messages, n, ignore_eos=True, pdd={"pipeline": "p-md"})
    until(lambda: warmed() >= before + 1, 60, "the answer to be warmed in prefill's cache")
    rendered = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turn1 = len(smol_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And at dusk?"},
    ]
    second = chat(pcluster, messages, 4, pdd={"pipeline": "p-md"})
    hit, block = second["pdd"]["prefix_hit_tokens"]["prefill"], pcluster.cfg.block_size
    print(f"\nturn 1: {turn1} prompt tokens + {n} generated; turn 2's prefill hit {hit}")
    assert second["pdd"]["instances"]["prefill"] == first["pdd"]["instances"]["prefill"]
    # past the first prompt's own blocks by at least two of the answer's (its last few tokens may
    # tokenize differently once rendered as text)
    assert hit >= (turn1 // block + 2) * block, (hit, turn1)
