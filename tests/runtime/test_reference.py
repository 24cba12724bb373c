"""The end-to-end tests' reference (tests/helpers.py `Reference`): a server's text verified in one
forward pass must be exactly what step-by-step greedy generation gives, and anything else must
be answered by generating. Its premise is measured here, on the machine that runs the suite."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import Reference, reference_generate

PROMPTS = ["def quicksort(items):", "Water boils at", " ".join(f"item{i}" for i in range(300))]


@pytest.fixture(scope="module")
def eos_model(smol):
    model = copy.deepcopy(smol)
    model.set_attn_implementation("sdpa")
    return model


def _ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


@torch.inference_mode()
def test_whole_sequence_logits_stay_far_inside_the_margin(smol_ref, smol_tokenizer):
    """Verification rests on this: the logits of one forward pass over prompt + output and those of
    step-by-step decoding differ by far less than the lead it requires, so no verified token can
    differ from the generated one."""
    worst = 0.0
    for text in PROMPTS:
        prompt = _ids(smol_tokenizer, text)
        out = smol_ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        stepwise, tokens = torch.cat(out.logits), out.sequences[0, len(prompt) :].tolist()
        whole = smol_ref(torch.tensor([prompt + tokens]), use_cache=False, logits_to_keep=len(tokens) + 1).logits[0]
        worst = max(worst, (whole[:-1] - stepwise).abs().max().item())
    margin = Reference(smol_ref, smol_tokenizer).margin
    print(f"\nlargest logit difference {worst:.2e}; margin {margin:.0e}")
    assert worst < margin / 10


QUESTIONS = ["What is 2+2?", "Name a colour.", "What is the capital of France?", "Say hello."]


def test_correct_drafts_are_verified_to_the_same_tokens(smol_ref, eos_model, smol_tokenizer):
    """Plain prompts run to the token limit (EOS disabled, as `ignore_eos`); chat turns end with
    EOS, which verification must see coming after the draft's last token."""
    cases = [(smol_ref, smol_tokenizer(text)["input_ids"]) for text in PROMPTS[:2]]
    for q in QUESTIONS:
        chat = [{"role": "user", "content": q}]
        text = smol_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        cases.append((eos_model, smol_tokenizer(text, add_special_tokens=False)["input_ids"]))
    verified, verified_eos = 0, False
    for model, prompt in cases:
        ref = Reference(model, smol_tokenizer)
        generated = reference_generate(model, prompt, 32)
        tokens = ref.verify(prompt, 32, smol_tokenizer.decode(generated, skip_special_tokens=True))
        assert tokens in (None, generated)  # verified means equal; None (a near-tie) falls back to generating
        verified += tokens is not None
        if model is eos_model and tokens is not None:
            verified_eos |= tokens[-1] in ref.eos and len(tokens) < 32
    print(f"\n{verified} of {len(cases)} verified")
    assert verified >= len(cases) - 2 and verified_eos, "verification should answer most references"


def test_a_wrong_draft_is_answered_by_generating(smol_ref, smol_tokenizer):
    ref = Reference(smol_ref, smol_tokenizer)
    prompt = _ids(smol_tokenizer, PROMPTS[0])
    generated = reference_generate(smol_ref, prompt, 12)
    right = smol_tokenizer.decode(generated)
    for wrong in (
        smol_tokenizer.decode(generated[:-1] + [generated[-1] + 1]),  # the last token off by one
        smol_tokenizer.decode(generated[:-1]),  # one token short (no EOS model: it cannot stop there)
        right + " extra",  # longer than asked for
        "",
    ):
        assert ref.verify(prompt, 12, wrong) is None, wrong
        assert ref(prompt, 12, draft=wrong) == right
    assert ref(prompt, 12, draft=right) == right
    assert (ref.verified, ref.generated) == (1, 4)
