"""Turn a request's token stream into text pieces, and cut the text at stop strings.

1. `IncrementalDetokenizer.add(ids)` per TokenChunk: the text those tokens complete.
2. `StopChecker.add(piece)`: the part of that text safe to send, or the text before a stop string.
3. At the end, `IncrementalDetokenizer.flush()` then `StopChecker.flush()` release what was held.

The detokenizer decodes only a short window of tokens per step (the prefix-offset /
read-offset technique of TGI and vLLM), so a token costs the same at position 10 and 10,000.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes and every token carries at least one, so a tail that is
# still U+FFFD after this many held tokens is not a character being completed: the model really
# produced U+FFFD (or bytes that can never decode), and holding it longer would stall the stream.
MAX_HELD_TOKENS = 4


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Owns one request's generated ids. Concatenated output == tokenizer.decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # [prefix_offset, read_offset) is already sent and decoded as context for what follows;
        # [read_offset, len(ids)) is held back until it decodes to complete characters.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._sent = 0  # characters past _prefix_text released while the tail was incomplete

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is complete."""
        pieces = []
        for token_id in token_ids:  # one at a time, so a held tail is always a few tokens
            self._ids.append(int(token_id))
            pieces.append(self._step(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """The end of the stream: whatever is held, even an incomplete character."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text):
            return ""
        new = text[len(self._prefix_text) :]
        held = len(self._ids) - self._read_offset
        if new.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS and not final:
            # the tokens end inside a character: what comes before it is complete and goes now
            # (a first token of a space and a character's first byte shows its space at once)
            complete = new.rstrip(REPLACEMENT)
            delta, self._sent = complete[self._sent :], max(self._sent, len(complete))
            return delta
        delta, self._sent = new[self._sent :], 0
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


class StopResult(NamedTuple):
    text: str  # safe to send now
    stopped: bool  # a stop string was reached: `text` ends just before it; generation should end


class StopChecker:
    """Cuts one request's text before the first stop string, which itself is never sent.

    A tail that could be the start of a stop string is held until the next piece settles it.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(dict.fromkeys(stops))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def add(self, piece: str) -> StopResult:
        if self._stopped:
            return StopResult("", True)
        text = self._held + piece
        cut = self._first_stop(text)
        if cut is not None:
            self._held, self._stopped = "", True
            return StopResult(text[:cut], True)
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The end of the stream without a stop: the held tail was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _partial_tail(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
