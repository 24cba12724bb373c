"""Deterministic pseudo-English for synthetic prompts, and a token counter that works without
a tokenizer.

Every word of `WORDS` is one SmolLM2 token (with its leading space), so a text of n words is
close to n tokens; two texts drawn from different seeds part ways within the first word or two,
which is all a prefix cache can tell apart.
"""

from __future__ import annotations

import random
from typing import Any

_WORD_LIST = """
the a an and or but if then else when while for with without into onto from to of in on at by
as is are was were be been being has have had do does did can could should would will may might
must not no yes all any each every some many more most less few other same new old first last next
file files folder path line lines code function method class module package test tests error errors
value values list map key keys table row rows column query index cache block blocks request requests
response server client service user users agent tool tools step steps task tasks plan result results
output input data config option options setting settings build run runs check checks change changes
fix bug issue patch commit branch merge review note notes log logs report status time date number
string name names type types field fields record records event events message messages queue batch
read write open close start stop create delete update find search load save send receive return call
use make take give keep show add remove move copy parse format print match split join sort count
small large long short fast slow simple clear exact empty full valid invalid missing current previous
"""
WORDS = _WORD_LIST.split()

# SmolLM2 tokens per word of `pseudo_text` (measured: 1.13 over 1000 words).
TOKENS_PER_WORD = 1.13
# A safe upper bound when no tokenizer is at hand: SmolLM2 averages ~5 characters a token here.
CHARS_PER_TOKEN_LOW = 3


def pseudo_text(rng: random.Random, n_words: int) -> str:
    """`n_words` words in sentences of 6-14 words, lines of a few sentences."""
    out: list[str] = []
    sentence_left = rng.randint(6, 14)
    for i in range(n_words):
        out.append(rng.choice(WORDS))
        sentence_left -= 1
        if sentence_left == 0 or i == n_words - 1:
            out[-1] += "." if rng.random() < 0.7 else ".\n"
            sentence_left = rng.randint(6, 14)
    return " ".join(out).replace("\n ", "\n")


def text_of_tokens(rng: random.Random, n_tokens: int) -> str:
    """Pseudo-text of about `n_tokens` SmolLM2 tokens."""
    return pseudo_text(rng, max(1, round(n_tokens / TOKENS_PER_WORD)))


class TokenCounter:
    """Token counts from the real tokenizer, or a conservative estimate from characters."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text) // CHARS_PER_TOKEN_LOW + 1
        return len(self.tokenizer.encode(text, add_special_tokens=False))
