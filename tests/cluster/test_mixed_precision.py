"""The heterogeneous fleet (the demo's default: prefill float32, relay and main-decode bfloat16)
against its one-process reference (tests/cluster/conftest.py `mixed_reference`): every pipeline
says what prefill-in-float32-then-decode-in-bfloat16 says, the KV is converted on receive, the
handoff's extend runs in main-decode's precision, and the decode-side cache works across
precisions (only the new tokens' KV crosses). Narrower KV on the WAN lands too."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import KEYS, fresh_prompt, stream_completion

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
FP32_KV_PER_TOKEN = 46_080  # prefill's KV crosses in its own precision unless a narrower wire is chosen


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


@pytest.mark.parametrize("pipeline, handoff", [("p-md", None), ("p-rld", None), ("p-rld-md", "oneshot")])
def test_every_pipeline_equals_the_mixed_reference(keyed, mixed_reference, smol_tokenizer, pipeline, handoff):
    for prompt in ("def quicksort(items):", fresh_prompt(30, pipeline)):
        text, pdd = run(keyed, prompt, 32, pipeline, handoff)
        ids = smol_tokenizer(prompt)["input_ids"]
        relay = pdd["tokens_by_role"]["rld"] if pipeline == "p-rld-md" and pdd["tokens_by_role"]["md"] else None
        assert text == mixed_reference(ids, 32, ignore_eos=True, handoff_after=relay), (pipeline, prompt, pdd)
        assert pdd["pipeline"] == pipeline


def test_catch_up_in_bfloat16_keeps_the_relays_tokens_and_hands_over(keyed, mixed_reference, smol_tokenizer):
    """Catch-up extends the relay's tokens chunk by chunk; in bfloat16 a chunked extend is not bit
    for bit a one-step one, so the one-process reference is exact up to the handoff (the relay's
    tokens) and the request is handed over; docs/kv-wire.md measures how often they part."""
    prompt = fresh_prompt(40, "catchup-bf16")
    text, pdd = run(keyed, prompt, 48, "p-rld-md", "catchup")
    ref = mixed_reference(smol_tokenizer(prompt)["input_ids"], 48, ignore_eos=True, ids=True)
    relay = pdd["tokens_by_role"]["rld"]
    assert relay >= 1 and sum(pdd["tokens_by_role"].values()) == 48
    assert text.startswith(smol_tokenizer.decode(ref[: max(relay - 1, 0)], skip_special_tokens=True))
    print(
        f"\ncatch-up in bfloat16: relay {relay} tokens, {pdd['handoff_chunks']} chunks; "
        f"{'equal to' if text == smol_tokenizer.decode(ref, skip_special_tokens=True) else 'parted from'} "
        "the one-step reference after the handoff"
    )


def test_the_decode_side_cache_and_incremental_kv_work_across_precisions(keyed):
    system = fresh_prompt(150, "drc-mixed")
    first = run(keyed, system + " First question?", 4, "p-md")[1]
    second = run(keyed, system + " Second question?", 4, "p-md")[1]
    assert first["prefix_hit_tokens"]["md"] == 0 and second["prefix_hit_tokens"]["md"] >= 144  # bf16 blocks reused
    fresh = first["wan_kv_bytes"] // FP32_KV_PER_TOKEN
    assert second["wan_kv_bytes"] < first["wan_kv_bytes"] / 5 and fresh > 144  # only the new tokens' KV crossed


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_narrower_kv_on_the_wan_lands_and_serves(keyed, wire):
    """A narrower wire format for the WAN leg: the KV crosses in fewer bytes and main-decode,
    restoring it into bfloat16, serves the request (its output is measured, not asserted equal:
    docs/kv-wire.md)."""
    _, native = run(keyed, fresh_prompt(60, f"native-{wire}"), 6, "p-md")
    text, narrow = run(keyed, fresh_prompt(60, f"wire-{wire}"), 6, "p-md", kv_wire=wire)
    assert (native["kv_wire"], narrow["kv_wire"], narrow["kv_wire_reason"]) == ("native", wire, "forced")
    ratio = narrow["wan_kv_bytes"] / native["wan_kv_bytes"]
    assert ratio < {"bf16": 0.55, "int8": 0.3}[wire], ratio  # 0.50x and 0.27x of float32, plus framing
    assert text and sum(narrow["tokens_by_role"].values()) == 6
