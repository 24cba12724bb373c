"""Put one request's generated tokens back in order.

TokenChunks reach the gateway from more than one decoder (relay-decode, then main-decode after
a handoff), over a bus that may reorder or redeliver them. A chunk says where its tokens sit:
`[index, index + len(token_ids))`. Chunks may overlap: after a catch-up handoff main-decode can
resend positions relay-decode already sent.

`TokenReassembler.add(index, ids)` returns the tokens that became contiguous, each position at
most once, and buffers what lies beyond a gap. The first token seen for a position wins; a later,
different token for the same position is counted in `conflicts` (a determinism bug upstream)
and otherwise ignored, since the client may already have it.
"""

from __future__ import annotations

from collections.abc import Sequence


class TokenReassembler:
    """Owns one request's token order on the gateway."""

    def __init__(self, start: int = 0) -> None:
        self._next = start  # every position below this has been returned exactly once
        self._emitted: dict[int, int] = {}  # returned tokens by position, to notice conflicts
        self._pending: dict[int, int] = {}  # positions >= _next, waiting for a gap to fill
        self.conflicts = 0
        self.duplicates = 0  # tokens dropped because their position was already returned or held

    @property
    def next_index(self) -> int:
        """The position of the next token to return: the count of tokens returned so far."""
        return self._next

    @property
    def buffered(self) -> int:
        """Tokens held behind a gap."""
        return len(self._pending)

    @property
    def missing(self) -> list[int]:
        """Positions in the gap(s) below the highest buffered token."""
        if not self._pending:
            return []
        return [i for i in range(self._next, max(self._pending)) if i not in self._pending]

    def add(self, index: int, token_ids: Sequence[int]) -> list[int]:
        if index < 0:
            raise ValueError(f"chunk index must be >= 0, got {index}")
        for offset, token in enumerate(token_ids):
            self._place(index + offset, int(token))
        out: list[int] = []
        while self._next in self._pending:
            token = self._pending.pop(self._next)
            self._emitted[self._next] = token
            out.append(token)
            self._next += 1
        return out

    def _place(self, pos: int, token: int) -> None:
        seen = self._emitted.get(pos) if pos < self._next else self._pending.get(pos)
        if seen is None and pos >= self._next:
            self._pending[pos] = token
            return
        self.duplicates += 1
        if seen is not None and seen != token:
            self.conflicts += 1
