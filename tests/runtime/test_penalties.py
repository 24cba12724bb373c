"""Penalties and min_tokens in the sampler and the engine: what each does to the logits, that
they change greedy output deterministically, and that min_tokens holds stops back."""

from __future__ import annotations

import torch

from shared.messages import Sampling
from shared.runtime.sampling import History, apply_penalties, sample_batch
from shared.runtime.sequence import Sequence
from tests.helpers import make_engine, random_prompts, run_to_completion


def test_each_penalty_on_the_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    h = History(prompt=[1], generated=[3, 3, 2])
    p = Sampling(frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(out := logits.clone(), [p], [h])
    assert out.tolist() == [[2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 1.0 - 0.25]]
    apply_penalties(out := logits.clone(), [Sampling(repetition_penalty=2.0)], [h])
    assert out.tolist() == [[2.0, -2.0, 0.25, 1.5]]  # seen tokens (prompt and generated): / 2 if > 0, * 2 if not
    apply_penalties(out := logits.clone(), [Sampling(min_tokens=5)], [History([1], [3], banned=(3,))])
    assert out[0, 3] == float("-inf") and out[0, 0] == 2.0
    apply_penalties(out := logits.clone(), [Sampling(min_tokens=1)], [History([1], [3], banned=(3,))])
    assert out[0, 3] == 3.0  # one token already out: no ban


def test_only_penalised_rows_change():
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    picks = sample_batch(logits, [Sampling(), Sampling(presence_penalty=2.0)], [0, 1], [None, History([0], [1])])
    assert picks == [1, 0] and logits.tolist() == [[0.0, 1.0], [0.0, 1.0]]  # the caller's logits untouched


def _run(model, prompt, **params) -> list[int]:
    e = make_engine(model, eos_token_ids=(5,))
    e.add(Sequence("s", list(prompt), Sampling(max_tokens=20, **params)))
    return run_to_completion(e)["s"]


def test_penalties_change_greedy_output_deterministically(tiny):
    [prompt] = random_prompts(tiny.config.vocab_size, [24], seed=9)
    plain = _run(tiny, prompt, ignore_eos=True)
    for knob in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.5}):
        penalised = _run(tiny, prompt, ignore_eos=True, **knob)
        assert penalised != plain and penalised == _run(tiny, prompt, ignore_eos=True, **knob), knob
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(_run(tiny, prompt, ignore_eos=True, frequency_penalty=2.0)) <= repeats(plain)


def test_min_tokens_holds_back_stop_tokens_and_eos(tiny):
    [prompt] = random_prompts(tiny.config.vocab_size, [24], seed=9)
    plain = _run(tiny, prompt, ignore_eos=True)
    stop = plain[2]  # greedy decoding would stop at its third token
    assert len(_run(tiny, prompt, ignore_eos=True, stop_token_ids=(stop,))) == 3
    held = _run(tiny, prompt, ignore_eos=True, stop_token_ids=(stop,), min_tokens=8)
    assert len(held) >= 8 and stop not in held[:7]
