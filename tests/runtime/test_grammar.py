"""Constrained decoding in the engine, on the real SmolLM2: a JSON-schema answer parses and
validates; rows without a grammar sample exactly as they would alone; the grammar state is a
function of the generated ids (a second engine handed some of them, or a migrated attempt whose
prompt ends with them, goes on exactly); a grammar the tokens do not fit fails its row alone."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from shared.messages import Sampling
from shared.runtime.grammar import Grammars
from shared.runtime.sequence import FinishReason, Sequence
from tests.helpers import make_engine

pytestmark = pytest.mark.model

EOS = (2,)  # SmolLM2-Instruct's <|im_end|>
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "wind": {
            "type": "object",
            "properties": {"speed": {"type": "integer"}, "dir": {"enum": ["N", "S", "E", "W"]}},
            "required": ["speed", "dir"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "days", "wind"],
    "additionalProperties": False,
}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema({**SCHEMA, "x-guidance": STYLE})


@pytest.fixture(scope="module")
def grammars(smol, smol_dir):
    return Grammars(smol_dir / "tokenizer.json", smol.config.vocab_size, EOS)


def chat(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def engine(smol, grammars):
    return make_engine(smol, 512, eos_token_ids=EOS, grammars=grammars, invariant=True)


def run(e) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Every sequence's tokens, finish reason and error, stepped to the end."""
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    while e.has_work:
        for o in e.step():
            tokens, _, _ = out.get(o.seq_id, ([], None, None))
            out[o.seq_id] = (tokens + ([o.token_id] if o.token_id is not None else []), o.finish_reason, o.error)
    return out


def test_a_json_schema_answer_parses_and_validates(smol, grammars, smol_tokenizer):
    prompt = chat(smol_tokenizer, "What is the weather in Paris this week? Answer in JSON.")
    e = engine(smol, grammars)
    e.add(Sequence("s", prompt, Sampling(max_tokens=120, grammar=GRAMMAR)))
    tokens, reason, error = run(e)["s"]
    answer = json.loads(smol_tokenizer.decode(tokens, skip_special_tokens=True))
    jsonschema.validate(answer, SCHEMA)
    assert reason == FinishReason.STOP and error is None
    assert len(grammars) == 0  # the finished sequence's matcher is gone


def test_rows_without_a_grammar_sample_as_they_would_alone(smol, grammars, smol_tokenizer):
    prompts = [chat(smol_tokenizer, q) for q in ("Name three rivers.", "What is 2+2?", "Say hello.")]
    alone = {}
    for i, p in enumerate(prompts):
        e = engine(smol, grammars)
        e.add(Sequence(f"u{i}", list(p), Sampling(max_tokens=24, ignore_eos=True)))
        alone |= run(e)
    e = engine(smol, grammars)
    for i, p in enumerate(prompts):
        e.add(Sequence(f"u{i}", list(p), Sampling(max_tokens=24, ignore_eos=True)))
        e.add(Sequence(f"c{i}", list(p), Sampling(max_tokens=24, grammar=GRAMMAR)))
    mixed = run(e)
    assert all(mixed[f"u{i}"][0] == alone[f"u{i}"][0] for i in range(3))
    assert all(mixed[f"c{i}"][0] != mixed[f"u{i}"][0] for i in range(3))  # the mask did act on its own rows


def test_the_grammar_state_is_rebuilt_from_the_ids(smol, grammars, smol_tokenizer):
    """What main-decode does after a handoff (the relay's ids are its generated tokens) and a
    migrated attempt (the prompt ends with the output so far, `resumed` says how much of it)."""
    prompt = chat(smol_tokenizer, "Describe the weather in Oslo as JSON.")
    e = engine(smol, grammars)
    e.add(Sequence("s", prompt, Sampling(max_tokens=120, grammar=GRAMMAR)))
    whole, _, _ = run(e)["s"]
    for k in (1, len(whole) // 2):
        handed = engine(smol, grammars)
        handed.add(Sequence("h", prompt + whole[:k], Sampling(max_tokens=120, grammar=GRAMMAR), prompt_len=len(prompt)))
        migrated = engine(smol, grammars)
        again = Sampling(max_tokens=120 - k, grammar=GRAMMAR, resumed=k)
        migrated.add(Sequence("m", prompt + whole[:k], again))
        assert run(handed)["h"][0] == whole[k:], k
        assert run(migrated)["m"][0] == whole[k:], k


def test_tokens_the_grammar_does_not_allow_fail_their_row_alone(smol, grammars, smol_tokenizer):
    prompt = chat(smol_tokenizer, "Say hello.")
    not_json = smol_tokenizer.encode("hello", add_special_tokens=False)
    e = engine(smol, grammars)
    e.add(Sequence("bad", prompt + not_json, Sampling(max_tokens=8, grammar=GRAMMAR), prompt_len=len(prompt)))
    e.add(
        Sequence("broken", list(prompt), Sampling(max_tokens=8, grammar='{"grammars": [{"lark_grammar": "start: ("}]}'))
    )
    e.add(Sequence("fine", list(prompt), Sampling(max_tokens=8, ignore_eos=True)))
    out = run(e)
    assert out["bad"][1] == FinishReason.ERROR and "do not fit" in out["bad"][2]
    assert out["broken"][1] == FinishReason.ERROR and "does not compile" in out["broken"][2]
    assert len(out["fine"][0]) == 8 and out["fine"][2] is None
    no_support = make_engine(smol, 64, eos_token_ids=EOS)
    no_support.add(Sequence("s", prompt, Sampling(max_tokens=8, grammar=GRAMMAR)))
    assert "no grammar support" in run(no_support)["s"][2]
