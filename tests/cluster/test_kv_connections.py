"""Standing KV connections against the real processes: two requests planned p-md in a row, and
the second one's KV crosses the line on the connection the first one's push left standing: prefill
counts no new handshake to main-decode (`pdd:kv_connections_total{how="dialed"}` unchanged, one
more `reused`), and the line accepted no new connection for md-0's KV port."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.conftest import fresh_prompt, stream_completion
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow


def _prefill_counts(cluster) -> dict[str, float]:
    """prefill-0's KV connections to md-0 by how (dialed, reused, stale) and its WAN pushes done."""
    port = cluster.cfg.instance("prefill-0").metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts = {"dialed": 0.0, "reused": 0.0, "stale": 0.0, "pushes": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdd:kv_connections_total" and s.labels.get("decoder") == "md-0":
                counts[s.labels["how"]] += s.value
            if s.name == "pdd:kv_transfer_seconds_count" and s.labels.get("path") == "wan":
                counts["pushes"] += s.value
    return counts


def test_a_second_p_md_request_pushes_its_kv_without_a_handshake(
    cluster, model_id, operator, reference, smol_tokenizer
):
    timings = []
    for turn in range(2):
        before, accepted = _prefill_counts(cluster), operator.wan().accepted.get("md-0", 0)
        prompt = fresh_prompt(40, f"standing-{turn}")
        body = {"model": model_id, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        text, pdd, _ = stream_completion(cluster.url + "/v1/completions", {**body, "pdd": {"pipeline": "p-md"}})
        assert text == reference(smol_tokenizer(prompt)["input_ids"], 8, ignore_eos=True, draft=text)
        assert pdd["pipeline"] == "p-md" and pdd["wan_kv_bytes"] > 0
        # the push is counted once its ACK is read, its connection back in the pool (main-decode
        # may have streamed the answer before prefill read the ACK)
        until(lambda b=before: _prefill_counts(cluster)["pushes"] >= b["pushes"] + 1, 30, "prefill to count the push")
        after = _prefill_counts(cluster)
        timings.append(pdd["timings_ms"]["kv_wan"])
        if turn == 0:  # dialed now, or standing from an earlier test's push: one connection either way
            assert after["dialed"] + after["reused"] == before["dialed"] + before["reused"] + 1, (before, after)
        else:  # the first request's connection carried it: no TCP or TLS handshake through the line
            assert after["dialed"] == before["dialed"], (before, after)
            assert after["reused"] == before["reused"] + 1, (before, after)
            assert operator.wan().accepted.get("md-0", 0) == accepted  # the line saw no new connection
    print(f"\nKV over the line (pdd timings_ms.kv_wan): first request {timings[0]} ms, second {timings[1]} ms")
    assert all(s.requests == [] for s in operator.idle().values())


def test_a_long_prompts_kv_leaves_chunk_by_chunk_while_prefill_runs(cluster, model_id, reference, smol_tokenizer):
    """`stream_kv`: a cold prompt longer than prefill's step is prefilled in chunks, and each
    chunk's KV is pushed as soon as it is computed, the last chunk's layer by layer while its
    forward runs: all of it left before the first token (prefill's count, carried to the
    response), and the answer is the model's."""
    chunk = cluster.cfg.step_tokens_of(cluster.cfg.instance("prefill-0"))  # 512: this cluster streams its KV
    prompt = fresh_prompt(int(chunk * 0.6), "streamed")
    ids = smol_tokenizer(prompt)["input_ids"]
    assert chunk < len(ids) <= 3 * chunk
    body = {"model": model_id, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text, pdd, _ = stream_completion(cluster.url + "/v1/completions", {**body, "pdd": {"pipeline": "p-md"}})
    assert text == reference(ids, 8, ignore_eos=True, draft=text)
    assert pdd["pipeline"] == "p-md" and pdd["wan_kv_bytes"] > 0
    hit = pdd["prefix_hit_tokens"]["prefill"]  # a fresh prompt: none, or a block of its opening
    assert (len(ids) - 1 - hit) // chunk * chunk >= chunk  # chunks before the last one
    assert pdd["streamed_kv_tokens"] == len(ids) - pdd["md_cached_tokens"], pdd  # and the last one
    print(f"\n{len(ids)} tokens: {pdd['streamed_kv_tokens']} of them pushed before the first token")
