"""When a sequence stops, and what its penalties see: functions of its token ids alone.

Every instance that holds a request's ids decides alike: prefill on its first token, the relay,
main-decode after the handoff (prefill's first token is checked again on the decoder, where it
is the first of the stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.runtime.sampling import History
from shared.runtime.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class StopRules:
    eos_token_ids: tuple[int, ...] = ()
    decode_text: Callable[[list[int]], str] | None = None  # needed only for stop strings

    def reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` stops now that `token` (its last) was sampled, or None."""
        p = seq.params
        if seq.num_output < p.min_tokens:  # nothing stops it before min_tokens but its budget
            return FinishReason.LENGTH if seq.num_generated >= p.max_tokens else None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if p.stop and self.decode_text is not None and self._hits_stop_string(seq):
            return FinishReason.STOP
        if seq.num_generated >= p.max_tokens:
            return FinishReason.LENGTH
        if seq.max_new is not None and seq.sampled_here >= seq.max_new:
            return FinishReason.LENGTH
        return None

    def history(self, seq: Sequence) -> History:
        """What the penalties of the next token see."""
        p = seq.params
        banned = () if p.ignore_eos else self.eos_token_ids
        start = seq.output_start
        return History(seq.token_ids[:start], seq.token_ids[start:], tuple({*banned, *p.stop_token_ids}))

    def _hits_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        tail = seq.token_ids[max(seq.prompt_len, len(seq.token_ids) - longest - 4) :]
        text = self.decode_text(tail)
        return any(s in text for s in seq.params.stop)
