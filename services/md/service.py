"""Main-decode (datacenter B): receives KV across the WAN and finishes requests.

Lifecycle of a request here (the decode side is shared with relay-decode, see
`shared/decoder.py`):
1. DecodeTask from the scheduler -> pending, acked.
2. KV from prefill through the WAN link -> imported into the pool, the sequence joins the batch.
3. Tokens stream to the gateway with their index; the final chunk carries the stats.
4. Abort or a KV deadline drops the request and frees its blocks.
"""

from __future__ import annotations

from shared.decoder import DecoderService


class MainDecoder(DecoderService):
    role = "md"
