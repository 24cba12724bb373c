"""Constrained decoding: each constrained sequence's grammar state, and the token mask it allows.

A request with a grammar (`Sampling.grammar`, llguidance's format: a JSON schema for
`response_format`, a Lark grammar for tool calls, built by the gateway) may only sample tokens
the grammar allows next. The grammar's state is a function of the grammar and the tokens
generated so far, nothing else, so it never travels: whichever instance samples the request's
next token (prefill its first, the relay, main-decode after a handoff, a catch-up chunk, a
migrated attempt whose prompt ends with its own output, `Sampling.resumed`) feeds the ids it
holds to a fresh matcher and lands in the state the last instance left. `sync` does that
lazily and keeps checking that the matcher saw exactly the sequence's ids (a sequence re-added
under its id starts over).

Costs (SmolLM2's 49k vocabulary): building the vocabulary once per process ~0.4 s; a matcher
~1 ms per request and instance; a mask 0.16-0.24 ms per token with its expansion to flags and
allowed ids, on a grammar thread while the step's forward runs (`prefetch`), so the engine
thread adds ~0.1 ms a step for 4 constrained rows (`pdd bench grammar`, docs/tools.md). Rows
without a grammar are not touched.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import torch

from shared.runtime.sampling import TokenMask
from shared.runtime.sequence import Sequence

Masks = tuple[dict[str, TokenMask], dict[str, str]]  # by sequence id: allowed tokens; errors


class GrammarError(ValueError):
    """A grammar that does not compile, or tokens it does not allow (the request fails alone)."""


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    fed: list[int] = field(default_factory=list)  # the generated ids the matcher consumed


class Grammars:
    """The grammar state of every constrained sequence of one engine: used by the engine thread,
    and by its grammar thread while a forward runs (the engine waits for it before going on)."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        eos = list(eos_token_ids) or None
        self.vocab = llguidance.LLTokenizer(str(tokenizer_file), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._states: dict[str, _State] = {}
        # one thread: masks are computed while the model's forward runs (llguidance drops the GIL)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def prefetch(self, seqs: list[Sequence]) -> Future[Masks]:
        """`masks` on a worker thread: the engine starts it with the step's forward, which the
        masks do not depend on (their tokens are known before it), and collects it after."""
        return self._worker.submit(self.masks, [s for s in seqs if s.params.grammar])

    def masks(self, seqs: list[Sequence], ready: Masks | None = None) -> Masks:
        """Each constrained sequence's allowed tokens, and the errors of those whose grammar
        failed (they sample nothing; the engine fails them). `ready`: masks prefetched."""
        out: dict[str, TokenMask] = dict(ready[0]) if ready else {}
        failed: dict[str, str] = dict(ready[1]) if ready else {}
        for seq in seqs:
            if not seq.params.grammar or seq.seq_id in out or seq.seq_id in failed:
                continue
            try:
                out[seq.seq_id] = self._allowed(self.sync(seq))
            except GrammarError as e:
                failed[seq.seq_id] = str(e)
        return out, failed

    def finished(self, seq: Sequence) -> bool:
        """The grammar is complete and allows nothing more (the JSON object closed). A grammar
        error is left for the next `masks`, which fails the sequence."""
        try:
            return bool(seq.params.grammar) and self.sync(seq).matcher.is_stopped()
        except GrammarError:
            return False

    def sync(self, seq: Sequence) -> _State:
        """The sequence's matcher, fed every generated id it has not seen. Raises GrammarError."""
        generated = seq.token_ids[seq.output_start :]
        state = self._states.get(seq.seq_id)
        n = len(state.fed) if state else 0
        if state is None or len(generated) < n or (n and generated[n - 1] != state.fed[-1]):
            state = self._states[seq.seq_id] = _State(self._compile(seq.params.grammar))
        new = generated[len(state.fed) :]
        if new:
            if not state.matcher.consume_tokens(new):
                error = state.matcher.get_error()
                del self._states[seq.seq_id]
                raise GrammarError(f"the generated tokens do not fit the request's grammar: {error}")
            state.fed += new
        return state

    def drop(self, seq_id: str) -> None:
        self._states.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.vocab, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the request's grammar does not compile: {matcher.get_error()}")
        return matcher

    def _allowed(self, state: _State) -> TokenMask:
        words = torch.zeros(self._words, dtype=torch.int32)
        state.matcher.unsafe_compute_mask_ptr(words.data_ptr(), self._words * 4)
        if state.matcher.is_error():
            raise GrammarError(f"the request's grammar failed: {state.matcher.get_error()}")
        return TokenMask(words, self.vocab_size)
