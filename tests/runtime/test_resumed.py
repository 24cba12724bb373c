"""A migrated attempt in the shipped mixed-precision fleet (prefill float32, decoders bfloat16).

The attempt's prompt ends with the answer so far (`Sampling.resumed` tokens), whose KV a decoder
computed in bfloat16. Its decoder takes prefill's KV only up to where that answer begins,
computes the answer's KV itself in one extend (equal to its decode steps, bit for bit) and
samples the next token: the rest of the answer is the one it would have been had nothing moved.
Taking prefill's float32 KV of the answer and its float32 next token, as before, is not.
"""

from __future__ import annotations

import pytest
import torch

from shared.messages import Sampling
from shared.runtime.engine import Engine
from shared.runtime.kv_payload import KVPayload
from shared.runtime.models import load_model
from shared.runtime.sequence import Sequence

pytestmark = pytest.mark.model

N, CUT = 20, 9  # tokens in all; the earlier attempt's share


@pytest.fixture(scope="module")
def smol_bf16(smol_dir):
    return load_model(smol_dir, "bfloat16")


def _prefill(model: torch.nn.Module, prompt: list[int]) -> tuple[int, KVPayload]:
    """What a prefill instance sends: the prompt's KV and its first token."""
    engine = Engine.for_model(model, 512)
    engine.add(Sequence("p", list(prompt), Sampling(max_tokens=1, ignore_eos=True), hold_kv=True, max_new=1))
    while not (first := [o.token_id for o in engine.step() if o.token_id is not None]):
        pass
    [payload], _ = engine.export_and_release("p", [0])
    return first[0], payload


def _decode(model: torch.nn.Module, seq: Sequence, payload: KVPayload) -> list[tuple[int, float]]:
    """What a decoder streams for it: each token with its log-probability."""
    engine = Engine.for_model(model, 512)
    [(done, error)] = engine.admit_with_kv([(seq, payload)])
    assert done is None and not error, error
    out = []
    for _ in range(2 * N):
        out += [(o.token_id, o.logprob.logprob) for o in engine.step() if o.token_id is not None]
        if not engine.has_work:
            return out
    raise AssertionError(f"{seq.seq_id} did not finish: {out}")


def _sampling(n: int, resumed: int = 0) -> Sampling:
    return Sampling(max_tokens=n, ignore_eos=True, logprobs=0, resumed=resumed)


def test_a_resumed_attempt_goes_on_as_if_nothing_had_moved(smol, smol_bf16, smol_tokenizer):
    prompt = smol_tokenizer("The history of the lighthouse begins with")["input_ids"]
    first, payload = _prefill(smol, prompt)
    alone = _decode(smol_bf16, Sequence("alone", [*prompt, first], _sampling(N), prompt_len=len(prompt)), payload)
    answer = [first] + [t for t, _ in alone]
    steps = {i: lp for i, (_, lp) in enumerate(alone, start=1)}  # answer[i]'s log-probability

    moved = [*prompt, *answer[:CUT]]
    _, moved_payload = _prefill(smol, moved)  # prefill computes the whole moved prompt, in float32
    resumed = Sequence("moved", list(moved), _sampling(N - CUT, resumed=CUT), prompt_len=len(moved))
    rest = _decode(smol_bf16, resumed, moved_payload)
    assert [t for t, _ in rest] == answer[CUT:N]  # the decoder sampled the token after the cut itself
    assert [lp for _, lp in rest] == [steps[i] for i in range(CUT, N)], "not the same bits"

    # as before: prefill's float32 KV of the answer so far, and its float32 next token
    first_again, _ = _prefill(smol, moved)
    before = Sequence("before", [*moved, first_again], _sampling(N - CUT - 1), prompt_len=len(moved))
    assert [lp for _, lp in _decode(smol_bf16, before, moved_payload)] != [steps[i] for i in range(CUT + 1, N)]
