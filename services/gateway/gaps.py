"""When a request's next token is late enough that its chunk is presumed lost.

Core NATS is at-most-once: a chunk lost on the way never comes, and the gateway must ask its
decoders again (`Resend`, services/gateway/flow.py). Asking too early only costs a message
(the answer holds nothing new), asking too late stalls the stream: the bound is a few of the
request's own token gaps (a step, or a chunk of them) plus the line's round trip twice, at least
`GAP_MIN_S`, and doubles after each ask while nothing comes.
"""

from __future__ import annotations

import statistics

GAP_MIN_S = 0.5  # the least wait for a missing token before its decoders are asked again
GAP_BACKOFF_MAX = 16  # an unanswered gap is asked about again after 2x, 4x ... this many times the bound


class GapWatch:
    def __init__(self, token_gaps: list[float], rtt_s: float, now: float) -> None:
        self._gaps = token_gaps  # the request's gaps between tokens (FlowStats.token_gaps), growing
        self._rtt_s = rtt_s
        self._since = now  # the stream gained a token in order, or its decoders were asked
        self._backoff = 1

    def advanced(self, now: float) -> None:
        self._since, self._backoff = now, 1

    def due(self, now: float) -> float:
        """Seconds until the next token may count as lost, at the earliest (<= 0: it does now).
        Within `GAP_MIN_S` of the last token or ask it is that floor: a waiter wakes, finds it
        not yet due and waits again."""
        early = self._since + GAP_MIN_S * self._backoff - now
        if early > 0:  # the usual case, on every chunk: no median needed to know it is not due
            return early
        gaps = self._gaps[-16:]
        itl = statistics.median(gaps) if gaps else 0.1
        return self._since + max(GAP_MIN_S, 4 * itl + 2 * self._rtt_s) * self._backoff - now

    def ask_now(self, now: float) -> bool:
        """True when the decoders should be asked now; the next ask is then due later."""
        if self.due(now) > 0:
            return False
        self._since, self._backoff = now, min(self._backoff * 2, GAP_BACKOFF_MAX)
        return True
