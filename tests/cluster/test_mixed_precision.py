"""The shipped heterogeneous fleet (configs/single-host.yaml: prefill float32, relay and main-decode
bfloat16) against its one-process reference (tests/cluster/conftest.py `mixed_reference`): every
plan, handoff mode, repeat and load says what prefill-in-float32-then-decode-in-bfloat16 says
(the batch-invariant kernels), the KV is converted on receive, and the decode-side cache works
across precisions (only the new tokens' KV crosses). Narrower KV on the WAN lands too."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from tests.cluster.conftest import KEYS, fresh_prompt, stream_completion
from tests.cluster.test_migration import restart, until

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
# float32 prefill's native KV into a bfloat16 main-decode crosses as bf16 (shared/model_info.py
# `link_wire`): 30 layers x K and V x 3 heads x 64 x 2 bytes per token
BF16_KV_PER_TOKEN = 23_040


def run(
    keyed, prompt: str, n: int, pipeline: str, handoff: str | None = None, kv_wire: str | None = None
) -> tuple[str, dict]:
    pdd = {
        "pipeline": pipeline,
        **({"handoff": handoff} if handoff else {}),
        **({"kv_wire": kv_wire} if kv_wire else {}),
    }
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "pdd": pdd}
    text, obj, _ = stream_completion(keyed.url + "/v1/completions", body, headers=ADMIN)
    return text, obj


CHATS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is your favourite drink, and why?",
    "Explain recursion to a child.",
    "List three uses of a paperclip.",
    "What happens when water freezes?",
    "Give me a tip for learning to cook.",
    "Describe a cat in two sentences.",
]
PLANS = [("p-md", None), ("p-rld-md", "oneshot"), ("p-rld-md", "catchup"), ("p-rld", None)]


SEEDED = "Tell me a short story about a lighthouse."  # sampled at temperature 0.8 with a seed


def chat(keyed, content: str, pdd: dict | None = None, headers: dict = ADMIN) -> tuple[str, dict]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 64, "temperature": 0}
    if content == SEEDED:
        body |= {"temperature": 0.8, "seed": 7}
    text, obj, _ = stream_completion(keyed.url + "/v1/chat/completions", {**body, "pdd": pdd or {}}, headers=headers)
    return text, obj


def burst(keyed, requests: list[tuple[str, dict | None]]) -> list[tuple[str, dict]]:
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: chat(keyed, *r), requests))


def test_one_answer_per_prompt_on_every_plan_load_and_repeat(keyed, mixed_reference, smol_tokenizer):
    """The shipped fleet (prefill float32, decoders bfloat16) gives each greedy chat prompt one
    text: through p-md, a one-shot and a catch-up handoff and the relay alone, twice each (the
    second time from both sides' prefix caches), and once more in a burst of 16 with 8 unrelated
    requests; and that text is the one-process mixed reference. Each plan's 8 prompts run at once,
    so every answer is also computed in a batch of 9: a seeded sampled request rides along, and
    it too has one text. Prints the divergence table."""
    texts: dict[str, list[tuple[str, str]]] = {c: [] for c in [*CHATS, SEEDED]}
    for repeat in range(2):
        for pipeline, handoff in PLANS:
            pdd = {"pipeline": pipeline, **({"handoff": handoff} if handoff else {})}
            for content, (text, obj) in zip([*CHATS, SEEDED], burst(keyed, [(c, pdd) for c in [*CHATS, SEEDED]])):
                assert obj["pipeline"] == pipeline, obj
                texts[content].append((f"{pipeline}{'-' + handoff if handoff else ''}#{repeat + 1}", text))
    unrelated = [(f"Count from {i} to {i + 20}, one number per line.", None) for i in range(8)]
    for content, (text, _) in zip(CHATS, burst(keyed, [(c, None) for c in CHATS] + unrelated)):
        texts[content].append(("burst-of-16", text))
    seeded = texts.pop(SEEDED)
    assert len({t for _, t in seeded}) == 1, seeded
    print("\nprompt | distinct texts | routes that part from the reference")
    parted = {}
    for content, runs in texts.items():
        template = smol_tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        ref = mixed_reference(smol_tokenizer(template, add_special_tokens=False)["input_ids"], 64)
        parted[content] = [route for route, text in runs if text != ref]
        print(f"{content[:32]:32} | {len({t for _, t in runs})} | {', '.join(parted[content]) or '-'}")
    assert not any(parted.values()), parted


def test_the_decode_side_cache_and_incremental_kv_work_across_precisions(keyed):
    system = fresh_prompt(150, "drc-mixed")
    first = run(keyed, system + " First question?", 4, "p-md")[1]
    second = run(keyed, system + " Second question?", 4, "p-md")[1]
    assert first["prefix_hit_tokens"]["md"] == 0 and second["prefix_hit_tokens"]["md"] >= 144  # bf16 blocks reused
    fresh = first["wan_kv_bytes"] // BF16_KV_PER_TOKEN
    assert second["wan_kv_bytes"] < first["wan_kv_bytes"] / 5 and fresh > 144  # only the new tokens' KV crossed
    assert (second["md_computes_suffix"], second["md_suffix_reason"]) == (0, "dtypes-differ")  # never in bf16 at md


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_narrower_kv_on_the_wan_lands_and_serves(keyed, wire):
    """A wire format forced for the WAN leg: the KV crosses in its bytes and main-decode,
    restoring it into bfloat16, serves the request (its output is measured, not asserted equal:
    docs/kv-wire.md). Native KV into this bfloat16 main-decode already crosses as bf16, so a
    forced bf16 costs the same bytes and int8 about half of them."""
    _, native = run(keyed, fresh_prompt(60, f"native-{wire}"), 6, "p-md")
    text, narrow = run(keyed, fresh_prompt(60, f"wire-{wire}"), 6, "p-md", kv_wire=wire)
    assert (native["kv_wire"], narrow["kv_wire"], narrow["kv_wire_reason"]) == ("native", wire, "forced")
    ratio = narrow["wan_kv_bytes"] / native["wan_kv_bytes"]
    low, high = {"bf16": (0.95, 1.05), "int8": (0.45, 0.6)}[wire]  # int8: 1 byte + a scale per 64 vs 2 bytes
    assert low < ratio < high, ratio
    assert text and sum(narrow["tokens_by_role"].values()) == 6


def test_logprobs_on_the_shipped_fleet_are_the_same_on_every_plan(keyed):
    """Prefill's first token has float32 figures, the relay's and main-decode's bfloat16 ones:
    whichever decoder sampled a token, a bfloat16 row's logits are its own (batch-invariant
    kernels), so the figures are the same bits on every plan here too."""
    prompt = fresh_prompt(24, "mixed-logprobs-")
    seen = {}
    for pipeline, handoff in PLANS:
        pdd = {"pipeline": pipeline, **({"handoff": handoff} if handoff else {})}
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 2, "pdd": pdd}
        r = httpx.post(keyed.url + "/v1/completions", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 24
        seen[(pipeline, handoff)] = (
            choice["text"],
            choice["logprobs"]["token_logprobs"],
            choice["logprobs"]["top_logprobs"],
        )
    assert len(set(map(repr, seen.values()))) == 1, seen


def test_a_tool_call_on_the_shipped_fleet_is_the_same_on_every_plan(keyed):
    """The grammar on the heterogeneous fleet: prefill samples the call's first token in float32,
    the decoders the rest in bfloat16, each under the same grammar state; one call, every plan."""
    import json

    import jsonschema

    from tests.cluster.test_structured import ASK, FLIGHT, TOOLS

    calls = set()
    for pipeline, handoff in PLANS:
        body = {
            "messages": [{"role": "user", "content": ASK["book_flight"]}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "book_flight"}},
            "max_tokens": 120,
            "temperature": 0,
            "pdd": {"pipeline": pipeline, **({"handoff": handoff} if handoff else {})},
        }
        r = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        [call] = r.json()["choices"][0]["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), FLIGHT)
        calls.add((call["function"]["name"], call["function"]["arguments"]))
    assert len(calls) == 1, calls


def test_a_request_moved_off_a_killed_main_decode_keeps_the_fleets_answer(keyed, mixed_reference, smol_tokenizer):
    """main-decode (bfloat16) is killed mid-stream: the request moves to the relay, the one decoder
    left (p-rld), with a prompt that now ends with the answer so far. The relay computes that tail
    itself, in bfloat16, and samples the next token, so the text is still the fleet's one answer.
    (When prefill, in float32, recomputed the tail and sampled the next token, it was not: the
    chaos bench's kill-md fault gave a wrong answer.)"""
    prompt = fresh_prompt(40, "mixed-migration")
    n = 64
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    events: list[dict] = []
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=stream_completion(keyed.url + "/v1/completions", body, headers=ADMIN, timeout=240, events=events)
        )
    )
    worker.start()
    try:
        until(lambda: sum(bool(e["choices"] and e["choices"][0]["text"]) for e in events) >= 8, 60, "md-0's tokens")
        keyed.kill("md-0")
        worker.join(240)
        text, pdd, _ = result["out"]
        print(f"\nmd-0 killed: migrations {pdd['migrations']}, tokens {pdd['tokens_by_role']}, on {pdd['instances']}")
        assert pdd["migrations"] == 1 and pdd["tokens_by_role"]["rld"] > 0, pdd
        assert text == mixed_reference(smol_tokenizer(prompt)["input_ids"], n, ignore_eos=True)
    finally:
        worker.join(240)
        if keyed.procs["md-0"].poll() is not None:
            restart(keyed, "md-0")
