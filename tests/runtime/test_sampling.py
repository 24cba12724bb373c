"""Sampling: seeded draws are a pure function of (logits, seed, step); filters and stops hold."""

from __future__ import annotations

import pytest
import torch

from shared.messages import Sampling
from shared.runtime.sampling import TokenMask, sample, sample_batch
from shared.runtime.sequence import Sequence
from tests.helpers import make_engine, random_prompts, run_to_completion


def test_seeded_sampling_is_reproducible_and_step_dependent():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = Sampling(temperature=1.0, seed=42)
    draws = [sample(logits, p, step) for step in range(20)]
    assert draws == [sample(logits, p, step) for step in range(20)]
    assert len(set(draws)) > 5  # different steps draw differently
    other = [sample(logits, Sampling(temperature=1.0, seed=43), s) for s in range(20)]
    assert draws != other


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -2.0])
    top_k = {sample(logits, Sampling(temperature=2.0, top_k=2, seed=1), s) for s in range(200)}
    assert top_k == {0, 1}
    probs = torch.softmax(logits, -1)  # p0 ~0.66, p0+p1 ~0.90
    top_p = {sample(logits, Sampling(temperature=1.0, top_p=0.8, seed=2), s) for s in range(200)}
    assert top_p == {0, 1} and probs[0] < 0.8


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_bad_parameters_name_the_value(bad):
    assert next(iter(bad)) in Sampling(**bad).problem(vocab_size=100, context_len=64)
    assert Sampling().problem(vocab_size=100, context_len=64) == ""


def test_seeded_request_continues_identically_on_another_engine(tiny):
    """The handoff property: stop on engine A after 6 tokens, continue on engine B."""
    [prompt] = random_prompts(tiny.config.vocab_size, [30], seed=30)
    params = Sampling(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    whole = make_engine(tiny)
    whole.add(Sequence("w", list(prompt), params))
    expected = run_to_completion(whole)["w"]

    first = make_engine(tiny)
    first.add(Sequence("a", list(prompt), params, max_new=6))
    head = run_to_completion(first)["a"]
    second = make_engine(tiny)  # recomputes the prompt and the 6 tokens: an extend
    second.add(Sequence("b", list(prompt) + head, params, prompt_len=len(prompt)))
    assert head + run_to_completion(second)["b"] == expected


def test_stop_token_and_max_tokens(tiny):
    [prompt] = random_prompts(tiny.config.vocab_size, [12], seed=31)
    engine = make_engine(tiny)
    engine.add(Sequence("free", list(prompt), Sampling(max_tokens=10, ignore_eos=True)))
    free = run_to_completion(engine)["free"]
    stop_at = free[4]
    engine.add(Sequence("stop", list(prompt), Sampling(max_tokens=10, stop_token_ids=(stop_at,))))
    outs = engine.step() + engine.step()
    while engine.has_work:
        outs += engine.step()
    tokens = [o.token_id for o in outs]
    assert tokens == free[: free.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"


def test_eos_stops_unless_ignored(tiny):
    [prompt] = random_prompts(tiny.config.vocab_size, [12], seed=32)
    engine = make_engine(tiny)
    engine.add(Sequence("free", list(prompt), Sampling(max_tokens=10, ignore_eos=True)))
    free = run_to_completion(engine)["free"]
    eos_engine = make_engine(tiny, eos_token_ids=(free[2],))
    eos_engine.add(Sequence("eos", list(prompt), Sampling(max_tokens=10)))
    assert run_to_completion(eos_engine)["eos"] == free[: free.index(free[2]) + 1]


def test_stop_strings(smol, smol_tokenizer):
    prompt = smol_tokenizer("The days of the week are Monday, Tuesday,")["input_ids"]
    decode = smol_tokenizer.decode
    engine = make_engine(smol, decode_text=decode)
    engine.add(Sequence("free", list(prompt), Sampling(max_tokens=12, ignore_eos=True)))
    free_text = decode(run_to_completion(engine)["free"])
    assert "Thursday" in free_text
    engine.add(Sequence("stop", list(prompt), Sampling(max_tokens=12, stop=("Thursday",))))
    out = run_to_completion(engine)["stop"]
    assert decode(out).endswith("Thursday") or "Thursday" in decode(out[-3:])
    assert len(out) < 12


def _mask(allowed: list[int], vocab: int) -> TokenMask:
    bits = [0] * ((vocab + 31) // 32)
    for t in allowed:
        bits[t >> 5] |= 1 << (t & 31)
    return TokenMask(torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32), vocab)


def test_a_grammar_mask_picks_the_best_allowed_token_and_leaves_other_rows_alone():
    vocab = 70
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    logits[0, 5] = logits[0, 40] = 9.0  # a tie among allowed tokens: the lower id, as argmax takes it
    allowed = [5, 31, 40, 63]
    mask = _mask(allowed, vocab)
    assert [t for t in range(vocab) if mask.allows(t)] == allowed and mask.ids().tolist() == allowed
    params = [Sampling(), Sampling(), Sampling(temperature=1.0, seed=1), Sampling()]
    picks = sample_batch(logits, params, [0] * 4, masks=[mask, None, mask, mask])
    free = logits.argmax(-1).tolist()
    assert picks[0] == 5 and picks[1] == free[1] and picks[2] in allowed
    assert picks[3] == allowed[int(logits[3, allowed].argmax())]
    assert sample_batch(logits[:2], params[:2], [0, 0]) == free[:2]  # without masks: the argmax
