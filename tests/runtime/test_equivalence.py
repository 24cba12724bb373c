"""Greedy output of the runtime equals transformers' `generate()` token for token."""

from __future__ import annotations

import os

import pytest

from shared.runtime.fused import FusedDecoder
from tests.helpers import make_engine, random_prompts, reference_generate, run_to_completion, seq

MODELS = ["tiny", "smol"]


@pytest.fixture(params=MODELS)
def pair(request):
    name = request.param
    return request.getfixturevalue(name), request.getfixturevalue(f"{name}_ref")


def test_single_sequence(pair):
    model, ref = pair
    [prompt] = random_prompts(model.config.vocab_size, [23])
    engine = make_engine(model)
    engine.add(seq("a", prompt, 12))
    assert run_to_completion(engine)["a"] == reference_generate(ref, prompt, 12)


def test_batch_of_different_lengths(pair):
    model, ref = pair
    prompts = random_prompts(model.config.vocab_size, [5, 40, 17, 71, 33], seed=1)
    engine = make_engine(model)
    for i, p in enumerate(prompts):
        engine.add(seq(str(i), p, 10))
    outs = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == reference_generate(ref, p, 10), f"sequence {i}"
    assert engine.steps == 10  # all five prefilled together, then decoded together


def test_prefill_joins_running_batch(pair):
    model, ref = pair
    early, late = random_prompts(model.config.vocab_size, [20, 45], seed=2)
    engine = make_engine(model)
    engine.add(seq("early", early, 12))
    outs: dict[str, list[int]] = {}
    for _ in range(4):  # "early" decodes alone for a few steps
        for o in engine.step():
            outs.setdefault(o.seq_id, []).append(o.token_id)
    engine.add(seq("late", late, 8))
    for sid, toks in run_to_completion(engine).items():
        outs.setdefault(sid, []).extend(toks)
    assert outs["early"] == reference_generate(ref, early, 12)
    assert outs["late"] == reference_generate(ref, late, 8)


def test_chunked_prefill(pair):
    model, ref = pair
    long, short = random_prompts(model.config.vocab_size, [150, 9], seed=3)
    engine = make_engine(model, max_step_tokens=32)  # 150 tokens take 5 chunks
    engine.add(seq("long", long, 8))
    engine.add(seq("short", short, 8))
    outs = run_to_completion(engine)
    assert outs["long"] == reference_generate(ref, long, 8)
    assert outs["short"] == reference_generate(ref, short, 8)
    assert engine.steps >= 150 // 32 + 7


def test_chat_prompt_through_real_tokenizer(smol, smol_ref, smol_tokenizer):
    text = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = smol_tokenizer(text)["input_ids"]
    engine = make_engine(smol)
    engine.add(seq("chat", prompt, 16))
    out = run_to_completion(engine)["chat"]
    assert out == reference_generate(smol_ref, prompt, 16)
    assert "Paris" in smol_tokenizer.decode(out)


@pytest.mark.skipif(os.environ.get("PDD_TEST_DEVICE", "cpu") != "cpu", reason="skinny.c and oneDNN are CPU kernels")
@pytest.mark.parametrize("kernel", ["skinny", "onednn"])
def test_smollm2_batch_on_each_packed_kernel(smol, smol_ref, kernel):
    """The real model's projections through each kernel, not only the one this machine's decoder
    picks: a 166-token prefill step (over skinny.c's 128 rows: MKL there), then batched decodes
    of 5 rows."""
    decoder = FusedDecoder.for_model(smol)  # the non-invariant decoder, which picks its kernels
    chosen = decoder.kernel
    decoder.use_kernel(kernel)
    try:
        assert {d.kernel for d in decoder._denses} == {kernel}
        prompts = random_prompts(smol.config.vocab_size, [5, 40, 17, 71, 33], seed=11)
        engine = make_engine(smol, invariant=False)
        assert engine.runner.decoder is decoder
        for i, p in enumerate(prompts):
            engine.add(seq(str(i), p, 8))
        outs = run_to_completion(engine)
    finally:
        decoder.use_kernel(chosen)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == reference_generate(smol_ref, p, 8), f"sequence {i}"
