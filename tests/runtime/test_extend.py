"""Extend: k known tokens computed in one forward give the same next token and the same KV
as k single decode steps (this is the relay -> main handoff)."""

from __future__ import annotations

import pytest
import torch

from shared.runtime.kv_payload import export_kv
from shared.runtime.sequence import Sequence
from tests.helpers import Reference, greedy, make_engine, random_prompts, reference_generate, run_to_completion


def _prefilled(engine, prompt: list[int], k: int) -> tuple[Sequence, int]:
    """The prompt prefilled, with room for k more tokens; and its greedy next token."""
    s = Sequence("s", list(prompt), greedy(k + 1))
    s.block_table = engine.pool.allocator.allocate(engine.pool.blocks_for(len(prompt) + k + 1))
    first = int(engine.runner.forward([(s, len(prompt))]).logits[0].argmax())
    s.num_computed = len(prompt)
    return s, first


CASES = [("tiny", k) for k in (1, 16, 64, 100)] + [("smol", k) for k in (1, 16, 64, 100)]


def _decode_steps(engine, prompt: list[int], k: int, tokens: list[int] | None = None) -> tuple[Sequence, list[int]]:
    """The prompt's prefill, then k decode steps fed `tokens` (None: the runtime's own greedy
    choices); returns the sequence and the k + 1 tokens the forwards predicted."""
    s, first = _prefilled(engine, prompt, k)
    predicted = [first]
    for i in range(k):
        s.token_ids.append(tokens[i] if tokens is not None else predicted[-1])
        predicted.append(int(engine.runner.forward([(s, 1)]).logits[0].argmax()))
        s.num_computed += 1
    return s, predicted


@pytest.mark.parametrize("model_name, k", CASES)
def test_extend_matches_decode_steps(request, model_name, k):
    model = request.getfixturevalue(model_name)
    ref = request.getfixturevalue(f"{model_name}_ref")
    [prompt] = random_prompts(model.config.vocab_size, [37], seed=k)
    # the reference's greedy k + 1 tokens: the decode steps' own, where one forward of the reference
    # shows they are (tests/helpers.py Reference); otherwise generated, and the steps rerun on them
    decode_engine = make_engine(model)
    dec, drafted = _decode_steps(decode_engine, prompt, k)
    expected = Reference(ref, tokenizer=None).verify_tokens(prompt, k + 1, drafted)
    if expected is None:
        expected = reference_generate(ref, prompt, k + 1)
        decode_engine = make_engine(model)
        dec, _ = _decode_steps(decode_engine, prompt, k, expected)

    extend_engine = make_engine(model)
    ext, _ = _prefilled(extend_engine, prompt, k)
    ext.token_ids += expected[:k]
    result = extend_engine.runner.forward([(ext, k)])  # ONE forward for all k tokens
    assert int(result.logits[0].argmax()) == expected[k]

    n = len(prompt) + k
    a = export_kv(extend_engine.pool, ext.block_table, 0, n)
    b = export_kv(decode_engine.pool, dec.block_table, 0, n)
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        torch.testing.assert_close(ka, kb, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(va, vb, atol=1e-4, rtol=1e-4)


def test_extend_joins_a_running_batch(tiny, tiny_ref):
    """An extend is one more sequence in the batch, stepping alongside decodes."""
    p1, p2 = random_prompts(tiny.config.vocab_size, [25, 30], seed=7)
    handed = reference_generate(tiny_ref, p2, 20)
    engine = make_engine(tiny)
    engine.add(Sequence("decoding", list(p1), greedy(10)))
    engine.step()  # prefill of "decoding"
    engine.add(Sequence("handed", p2 + handed[:12], greedy(20), prompt_len=len(p2)))
    outs = engine.step()
    assert {o.seq_id for o in outs} == {"decoding", "handed"}
    assert [o.token_id for o in outs if o.seq_id == "handed"] == [handed[12]]
    assert [o.index for o in outs if o.seq_id == "handed"] == [12]


def test_shadow_catches_up_then_decodes(tiny, tiny_ref):
    """Main-decode's catch-up: extend chunks without sampling, then take over decoding."""
    [prompt] = random_prompts(tiny.config.vocab_size, [21], seed=8)
    expected = reference_generate(tiny_ref, prompt, 30)
    engine = make_engine(tiny)
    s = Sequence("md", list(prompt) + expected[:1], greedy(30), prompt_len=len(prompt), shadow=True)
    engine.add(s)
    assert [(o.caught_up, o.token_id) for o in engine.step()] == [(True, None)]  # the prompt
    assert s.num_pending == 1  # the last known token waits for the final handoff
    s.token_ids += expected[1:10]  # a handoff chunk of 9 tokens
    [out] = engine.step()
    assert out.caught_up and out.index == 10 and s.num_computed == len(prompt) + 9
    assert engine.step() == []  # a caught-up shadow is idle
    s.token_ids += expected[10:14]  # the final chunk
    s.shadow = False
    outs = run_to_completion(engine)
    assert expected[:14] + outs["md"] == expected


def test_final_handoff_with_no_new_tokens(tiny, tiny_ref):
    """Relay handed over before producing anything beyond prefill's token: md decodes on."""
    [prompt] = random_prompts(tiny.config.vocab_size, [21], seed=9)
    expected = reference_generate(tiny_ref, prompt, 8)
    engine = make_engine(tiny)
    s = Sequence("md", list(prompt) + expected[:1], greedy(8), prompt_len=len(prompt), shadow=True)
    engine.add(s)
    engine.step()
    s.shadow = False
    assert expected[:1] + run_to_completion(engine)["md"] == expected


def test_the_engine_says_when_its_next_step_samples_a_first_token_here(tiny):
    """The steps a decoder does not hold back for a prompt on its host (shared/cores.py)."""
    [prompt] = random_prompts(tiny.config.vocab_size, [21], seed=10)
    engine = make_engine(tiny)
    s = Sequence("md", list(prompt), greedy(4), shadow=True)
    engine.add(s)
    assert not engine.samples_a_first_token  # a shadow samples nothing
    engine.step()
    s.shadow = False
    assert engine.samples_a_first_token  # main-decode's first token after the handoff
    engine.step()
    assert s.sampled_here == 1 and not engine.samples_a_first_token  # plain decode steps from here
    engine.add(Sequence("fresh", list(prompt), greedy(4)))
    assert engine.samples_a_first_token  # a waiting request's first
