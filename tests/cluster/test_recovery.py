"""Lost messages, against real processes: core NATS is at-most-once, so a token chunk can vanish
(a leaf reconnect, a NATS restart, a slow consumer). A failpoint in the decoder drops exactly one
chunk (shared/failpoints.py); the gateway notices the gap, asks the decoder again by index, and
the stream ends whole, equal to the reference, in seconds rather than `timeouts.request_s`."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import fresh_prompt, stream_completion

pytestmark = pytest.mark.slow
N = 24


@pytest.mark.parametrize(
    "pipeline, fault",
    [
        ("p-md", "md-0/decoder.token_chunk=drop@5"),  # mid-stream: later chunks wait behind the gap
        ("p-md", "md-0/decoder.final_chunk=drop@1"),  # the last one: nothing comes after it
        ("p-rld-md", "rld-0/decoder.token_chunk=drop@2"),  # the relay's, before the handoff
    ],
)
def test_a_lost_chunk_is_asked_again(cluster, operator, model_id, reference, smol_tokenizer, pipeline, fault):
    prompt = fresh_prompt(30, "lost-")
    body = {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "pdd": {"pipeline": pipeline},
    }
    operator.failpoints(fault)
    try:
        t0 = time.perf_counter()
        text, pdd, _ = stream_completion(cluster.url + "/v1/completions", body, timeout=60)
        elapsed = time.perf_counter() - t0
    finally:
        operator.failpoints("")
    assert text == reference(smol_tokenizer(prompt)["input_ids"], N, ignore_eos=True, draft=text)
    assert pdd["resends"] >= 1, "the gap was filled by a resend, not by chance"
    assert pdd["migrations"] == 0, "nothing died: the request stayed where it was"
    assert sum(pdd["tokens_by_role"].values()) >= N
    # recovered within a few gap bounds (0.5 s and up), far below request_s (90 s in this cluster)
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert not operator.idle()["md-0"].requests
