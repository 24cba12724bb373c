"""Relay-decode (datacenter A, a small pool): hide the WAN by streaming at once, then let go.

Lifecycle of a request here (the decode side, shared with main-decode, is `shared/decoder.py`;
the handoff, both sides, is `shared/handoff.py`):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill arrives in-DC (tens of ms) -> imported; decoding starts at once and tokens
   stream to the user ("eager tokens") while main-decode's copy is still on the WAN.
3. `KVReady` from main-decode starts the handoff, token ids only (`HandoffChunk`):
   - one-shot: stop, send every token main-decode lacks as the final chunk, let go;
   - catch-up: while the backlog is over `final_tokens`, send up to `chunk_tokens` and keep
     streaming; main-decode acks once it has extended them; then stop and send the rest.
4. If a handoff chunk cannot be delivered, the relay keeps the request (recomputing its
   tokens if it had stopped) and finishes it itself: the user's stream never breaks.
5. `p-rld` requests (anomalous traffic, or no main-decode reachable), requests that end before
   main-decode is ready, and requests main-decode will never get (`FinishOnRelay`) finish here;
   main-decode is then told to drop its copy.
"""

from __future__ import annotations

from shared.decoder import DecoderService
from shared.instance import service_main


def main(argv: list[str] | None = None) -> None:
    service_main(DecoderService, "rld", argv)
