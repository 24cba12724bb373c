"""The shipped config's instances lend each other their idle cores (shared/cores.py): main-decode
decoding a `p-md` request while prefill and the relay have no work steps on every core of the
host, not on its one-thread share, and its answer is the one it gives on its share. While
prefill computes a prompt, main-decode waits for it (`yield_to_prefill_s`), answers unchanged."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.cluster.conftest import KEYS, Operator, fresh_prompt, stream_completion

pytestmark = pytest.mark.slow  # an end-to-end test: it runs with the keyed cluster's group (tests/conftest.py)
ADMIN = {"Authorization": f"Bearer {KEYS['tenant-a']}"}


def lent(op: Operator, instance: str) -> int:
    return op.inspect(instance).figures.engine.lent_steps


def test_main_decode_alone_decodes_on_the_relays_cores_too(keyed, mixed_reference, smol_tokenizer):
    op = Operator(keyed)
    md = keyed.cfg.instance("md-0")
    share, cores = md.threads, len(os.sched_getaffinity(0))
    op.idle()
    before = {i: lent(op, i) for i in ("prefill-0", "rld-0", "md-0")}
    prompt = fresh_prompt(12, "lend")
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    text, obj, _ = stream_completion(keyed.url + "/v1/completions", body, headers=ADMIN)
    assert obj["pipeline"] == "p-md"
    assert text == mixed_reference(smol_tokenizer(prompt)["input_ids"], 24, ignore_eos=True)
    op.idle()
    after = {i: lent(op, i) for i in before}
    assert after["rld-0"] == before["rld-0"]  # it had no work
    assert after["prefill-0"] == before["prefill-0"]  # its share is every core already
    if cores > share:
        # its 23 decode steps ran after prefill was done, with the relay idle: on every core (a
        # step or two may meet prefill warming an earlier answer into its cache)
        assert after["md-0"] - before["md-0"] >= 12, (before, after)
    else:
        assert after["md-0"] == before["md-0"]  # a host of one core has none to lend


def test_main_decode_waits_while_prefill_computes_a_prompt_on_its_host(keyed, mixed_reference, smol_tokenizer):
    op = Operator(keyed)
    url = keyed.url + "/v1/completions"
    op.idle()
    yielded = lambda: op.inspect("md-0").figures.engine.yielded_s  # noqa: E731
    before = yielded()
    # ~420 tokens: the reference prefills in one 512-token step
    decoding, long = fresh_prompt(12, "yield-decoding"), fresh_prompt(130, "yield-prompt")
    first = {"prompt": decoding, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    events: list[dict] = []
    done: dict[str, tuple] = {}
    worker = threading.Thread(target=lambda: done.update(a=stream_completion(url, first, events=events, headers=ADMIN)))
    worker.start()
    deadline = time.monotonic() + 120
    while len(events) < 3 and worker.is_alive():  # main-decode is decoding it
        assert time.monotonic() < deadline, "no tokens"
        time.sleep(0.01)
    second = {"prompt": long, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    text, obj, _ = stream_completion(url, second, headers=ADMIN)
    worker.join(timeout=120)
    assert not worker.is_alive() and "a" in done
    assert done["a"][0] == mixed_reference(smol_tokenizer(decoding)["input_ids"], 64, ignore_eos=True)
    assert text == mixed_reference(smol_tokenizer(long)["input_ids"], 4, ignore_eos=True)
    # the first request's steps met the second's prompt on prefill: main-decode waited for it
    assert yielded() > before, (before, yielded())
