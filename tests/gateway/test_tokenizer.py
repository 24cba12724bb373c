"""The gateway's torch-free tokenizer against transformers' AutoTokenizer on the same folder:
same ids for prompts, same text back, same chat rendering (the template's own defaults too)."""

from __future__ import annotations

import pytest

from services.gateway.tokenizer import TemplateError, TextTokenizer

TEXTS = ["The capital of France is", "def f(x):\n    return x  # ünïcødé ✓ 中文", "  leading spaces\t\ttabs\n\n", ""]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye ✓"},
    ],
]


@pytest.fixture(scope="module")
def ours(smol_dir) -> TextTokenizer:
    return TextTokenizer(smol_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, smol_tokenizer, text):
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == ids
    assert ours.decode(ids) == smol_tokenizer.decode(ids, skip_special_tokens=True)
    with_special = ids + [smol_tokenizer.eos_token_id]
    assert ours.decode(with_special, skip_special_tokens=False) == smol_tokenizer.decode(with_special)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(ours, smol_tokenizer, messages):
    expected = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == expected


def test_a_template_that_raises_is_a_template_error(tmp_path, smol_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smol_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="alternate"):
        TextTokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
