"""What a cluster's KV pools take of this host's memory once they fill, said at `pdd up`.

An instance's pool is committed as its blocks are first written (shared/runtime/memory.py), so
a cluster starts small and grows to its pools' size on a busy day. Pools that together exceed
what the host has start fine and are killed by the kernel once they fill: `pdd up` says so at
start, while it is a line in a config to change.
"""

from __future__ import annotations

from pathlib import Path

from shared.config import ClusterConfig
from shared.model_info import load_model_info

GB = 1e9


def pool_bytes(cfg: ClusterConfig) -> dict[str, int]:
    """Each instance's KV pool at capacity."""
    model = load_model_info(cfg.model)
    return {i.id: i.kv_tokens * model.kv_bytes_per_token(i.dtype) for i in cfg.instances}


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of what new work may take without swapping (`MemAvailable`)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def summary(pools: dict[str, int], available: int | None) -> tuple[str, bool]:
    """The line `pdd up` prints, and whether the pools fit what is available."""
    total = sum(pools.values())
    each = ", ".join(f"{iid} {n / GB:.2f}" for iid, n in pools.items())
    line = f"KV pools at capacity (resident as they fill): {each} GB; {total / GB:.2f} GB in all"
    if available is None:
        return line, True
    fits = total <= available
    line += f", {available / GB:.1f} GB available on this host"
    if not fits:
        line += ": full pools would not fit and the kernel would kill an instance; lower kv_tokens"
    return line, fits
