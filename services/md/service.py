"""Main-decode (datacenter B): receives KV across the WAN and finishes requests.

Lifecycle of a request here (the decode side, shared with relay-decode, is `shared/decoder.py`;
the handoff, both sides, is `shared/handoff.py`):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill through the WAN -> stitched onto what the decode-side radix cache (DRC)
   already holds, imported into the pool, and cached at once for the next turn.
   - `p-md`: the sequence joins the batch and streams from prefill's first token on.
   - `p-rld-md`: relay-decode is already streaming. The sequence joins as a *shadow* (computes
     KV, samples nothing) and the relay is told `KVReady`.
3. Handoff (`p-rld-md`), token ids only:
   - a non-final `HandoffChunk` is appended to the shadow; its KV is computed in one extend
     inside the running batch; the ack goes back once the shadow has caught up;
   - the final chunk is appended, the shadow becomes a normal sequence and is acked at once;
     its next step extends the last tokens and samples the next one from the last position.
4. Tokens stream to the gateway with their index; the final chunk carries the stats.
5. Abort or a KV deadline drops the request and frees its blocks (a shadow whose KV never came
   tells the relay to finish the request).
"""

from __future__ import annotations

from shared.decoder import DecoderService
from shared.instance import service_main


def main(argv: list[str] | None = None) -> None:
    service_main(DecoderService, "md", argv)
