"""WAN emulator between datacenter A and B: a shaped, faultable line of TCP port forwards.

Run it as a process (`python -m services.wanlink --config FILE`) or in the event loop
(`WanLink(cfg.wan, forwards, bus).start()`). Production services never import this package.
"""

from services.wanlink.link import Forward, WanLink, forwards_of

__all__ = ["Forward", "WanLink", "forwards_of"]
