"""Sampling: penalties, greedy, temperature, top-k, top-p, seeded per request and per step.

Penalties first, on the raw logits, from the sequence's own tokens (`History`): OpenAI's
presence and frequency penalties over the tokens generated so far, vLLM's repetition penalty
over prompt and generated tokens, and `min_tokens` banning end-of-sequence and stop tokens
until that many are out. They depend only on the token ids, so main-decode, handed a request's
ids by the relay, penalises exactly as the relay would have.

Log-probabilities (`token_logprobs`, for requests that ask) come from the raw logits, before
penalties and temperature (vLLM's default), one row at a time in float32: a token's figures
depend on its own row alone, so they are the same whichever role sampled it, alone or batched.

A request with a grammar (structured outputs, tool calls) samples only among the tokens its
grammar allows next (shared/runtime/grammar.py); its logprobs stay the model's own.

A seeded request draws its randomness from a generator seeded by `(seed, step)`, where step
is the number of tokens generated before this one. The draw is a pure function of the logits,
the seed and the step, so an instance that picks a request up mid-way (relay-decode hands it to
main-decode) continues exactly as the first instance would have: only the seed travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import Logprob, Sampling

_STEP_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps apart
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class History:
    """What a row's penalties need: its prompt and generated ids, and the ids `min_tokens` bans."""

    prompt: list[int]
    generated: list[int]
    banned: tuple[int, ...] = ()  # end-of-sequence and stop token ids, while under min_tokens


def apply_penalties(logits: torch.Tensor, params: list[Sampling], histories: list[History | None]) -> None:
    """In place, row by row, for the rows that have penalties (the others are not touched)."""
    for i, (p, h) in enumerate(zip(params, histories)):
        if h is None or not p.penalised:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.prompt) | set(h.generated)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and h.generated:
            counts = torch.bincount(torch.tensor(h.generated), minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(h.generated) < p.min_tokens and h.banned:
            row[list(h.banned)] = float("-inf")


def step_seed(seed: int, step: int) -> int:
    return (seed * _STEP_MIX + step * 0x632BE59BD9B4E019 + 1) & _MASK63


def sample(logits: torch.Tensor, params: Sampling, step: int) -> int:
    """Pick the next token from one row of logits `[vocab]` (the batch path with one row, so a
    sequence draws the same token whether it is sampled alone or in a batch)."""
    return sample_batch(logits.unsqueeze(0), [params], [step])[0]


def sample_batch(
    logits: torch.Tensor,
    params: list[Sampling],
    steps: list[int],
    histories: list[History | None] | None = None,
    masks: list[TokenMask | None] | None = None,
) -> list[int]:
    """Sample one token per row. Greedy rows share one argmax; the other rows share each filter's
    tensor ops (temperature, top-k, softmax, top-p over all of them at once: a per-row top-p sort of
    a 49k vocabulary took about a millisecond each) and draw with their own generator. Rows with
    penalties get them first (`histories` gives their tokens), then rows with a grammar lose the
    tokens it does not allow (`masks`, shared/runtime/grammar.py): a greedy row whose argmax the
    grammar allows keeps it (the masked row's argmax is the same token), another greedy row takes
    the best of the allowed ids, a sampled row is masked in full (~0.1 ms for a 49k vocabulary)."""
    if not params:
        return []
    cloned = histories is not None and any(h is not None for h in histories)
    if cloned:
        logits = logits.clone()
        apply_penalties(logits, params, histories)
    out = torch.argmax(logits, dim=-1).tolist()
    masked = [i for i, m in enumerate(masks or ()) if m is not None and not (params[i].greedy and m.allows(out[i]))]
    for i in (i for i in masked if params[i].greedy):  # the best allowed token: argmax over those alone
        ids = masks[i].ids()
        out[i] = int(ids[torch.argmax(logits[i, ids])]) if len(ids) else out[i]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if any(not params[i].greedy for i in masked):
        logits = logits if cloned else logits.clone()
        for i in (i for i in masked if not params[i].greedy):
            logits[i].masked_fill_(~masks[i].allowed(), float("-inf"))
    if rows:
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in rows])
        for j, i in enumerate(rows):
            out[i] = int(torch.multinomial(probs[j], 1, generator=_generator(params[i], steps[i])))
    return out


class TokenMask:
    """The tokens a grammar allows next, for a `vocab`-wide logits row: built from llguidance's
    packed bits (little-endian, 32 to a word) where the mask is computed, on the grammar thread,
    so the engine thread only looks up (ids past the packed vocabulary are not allowed)."""

    def __init__(self, words: torch.Tensor, vocab: int) -> None:
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little").view(np.bool_)
        if len(bits) < vocab:
            bits = np.concatenate([bits, np.zeros(vocab - len(bits), dtype=np.bool_)])
        self._bits = bits[:vocab]
        self._ids = torch.from_numpy(np.flatnonzero(self._bits))

    def allows(self, token: int) -> bool:
        return bool(self._bits[token])

    def allowed(self) -> torch.Tensor:
        """One flag per token id."""
        return torch.from_numpy(self._bits)

    def ids(self) -> torch.Tensor:
        """The allowed token ids, ascending."""
        return self._ids


def token_logprobs(logits: torch.Tensor, params: list[Sampling], tokens: list[int]) -> list[Logprob | None]:
    """Each row's sampled token's log-probability and its `params.logprobs` most likely tokens
    (None for rows that asked for none)."""
    out: list[Logprob | None] = []
    for i, (p, token) in enumerate(zip(params, tokens)):
        if p.logprobs is None:
            out.append(None)
            continue
        row = torch.log_softmax(logits[i].float(), dim=-1)
        top = torch.topk(row, p.logprobs) if p.logprobs else None
        out.append(
            Logprob(
                float(row[token]),
                top.indices.tolist() if top is not None else [],
                top.values.tolist() if top is not None else [],
            )
        )
    return out


def _filtered_probs(logits: torch.Tensor, params: list[Sampling]) -> torch.Tensor:
    """Row-wise: temperature, top-k, softmax, top-p. Each row's result depends on that row alone."""
    vocab = logits.shape[-1]
    logits = logits / torch.tensor([[p.temperature] for p in params])
    ks = torch.tensor([[min(p.top_k, vocab)] for p in params])
    if bool((ks > 0).any()):
        top = torch.topk(logits, int(ks.max()), dim=-1).values
        kth = top.gather(1, (ks - 1).clamp(min=0))
        kth = torch.where(ks > 0, kth, torch.full_like(kth, float("-inf")))  # top_k = 0: keep all
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    nucleus = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        sub = probs[nucleus]
        sorted_p, order = torch.sort(sub, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        top_p = torch.tensor([[params[j].top_p] for j in nucleus])
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p, 0.0)  # keep the smallest prefix reaching top_p
        probs[nucleus] = torch.zeros_like(sub).scatter_(1, order, sorted_p)
    return probs


def _generator(params: Sampling, step: int) -> torch.Generator:
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(step_seed(params.seed, step))
    return generator
