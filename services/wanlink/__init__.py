"""WAN emulator between datacenter A and B: a shaped, faultable TCP proxy for the KV plane.

Run it as a process (`python -m services.wanlink --config FILE`) or in the event loop
(`WanLink(cfg.wan, bus, redis).start()`). Production services never import this package.
"""

from services.wanlink.ledger import bytes_key, state_key, total_key
from services.wanlink.link import WanLink

__all__ = ["WanLink", "bytes_key", "state_key", "total_key"]
