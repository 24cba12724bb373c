"""Logprobs through the official OpenAI SDK against the live float32 cluster, on every pipeline:
each token's log-probability comes from the role that sampled it (prefill the first, the relay
until the handoff, main-decode after it), and the figures are the same, to the last bit, whichever
route the request took (the batch-invariant kernels make a row's logits its own)."""

from __future__ import annotations

import math

import openai
import pytest

from tests.cluster.conftest import fresh_prompt
from tests.cluster.test_relay import PLANS

pytestmark = pytest.mark.slow
N = 24


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused-on-an-open-gateway", max_retries=0)


def _extra(pipeline: str, handoff: str | None) -> dict:
    return {"ignore_eos": True, "pdd": {"pipeline": pipeline, **({"handoff": handoff} if handoff else {})}}


def test_completion_logprobs_are_the_same_on_every_pipeline(client, model_id, reference, smol_tokenizer):
    prompt = fresh_prompt(30, "logprobs-")
    seen = {}
    for pipeline, handoff in PLANS:
        r = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=N, temperature=0, logprobs=3, extra_body=_extra(pipeline, handoff)
        )
        choice, pdd = r.choices[0], r.model_extra["pdd"]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
        assert "".join(lp.tokens) == choice.text
        for value, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert len(top) == 3 and value <= 0 and math.isclose(max(top.values()), value)  # greedy: the top one
            assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
        seen[(pipeline, handoff)] = (choice.text, lp.token_logprobs, lp.top_logprobs, pdd["tokens_by_role"])
    p_md = seen[("p-md", None)]
    assert p_md[0] == reference(smol_tokenizer(prompt)["input_ids"], N, ignore_eos=True, draft=p_md[0])
    for plan, (text, values, tops, _) in seen.items():
        assert (text, values, tops) == p_md[:3], plan  # bit for bit
    assert any(roles["rld"] and roles["md"] for *_, roles in seen.values()), "some token was sampled on each side"


def test_chat_logprobs_streamed_equal_whole_across_the_handoff(client, model_id):
    messages = [{"role": "user", "content": fresh_prompt(12, "chat-logprobs-")}]
    kwargs = dict(model=model_id, messages=messages, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs, extra_body=_extra("p-md", None))
    content = whole.choices[0].logprobs.content
    assert len(content) == N and "".join(e.token for e in content) == whole.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(bytes(e.bytes) == e.token.encode() for e in content)
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body=_extra("p-rld-md", "catchup"))
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in content
    ]
