"""The cluster at a glance, as plain data: instances by datacenter (role, state, load, KV
blocks used / cached / free, requests held) and the line between the sites. `pdd status` prints
it and the gateway's dashboard draws it; both build it here from the scheduler's registry view
(`ClusterStatus`) and the line's figures.
"""

from __future__ import annotations

from typing import Any

from shared.config import ClusterConfig
from shared.messages import ClusterStatus


def status_view(cfg: ClusterConfig, status: ClusterStatus, lines: dict | None) -> dict[str, Any]:
    """Plain data for `pdd status --json` and the dashboard: instances by site, and the line."""
    alive = {i.id: i for i in status.instances}
    sites: dict[str, list] = {dc.name: [] for dc in cfg.datacenters}
    for inst in cfg.instances:
        info = alive.get(inst.id)
        row = {"id": inst.id, "role": inst.role, "state": "up" if info else "missing"}
        if info:
            used = info.total_blocks - info.free_blocks - info.cached_blocks
            row |= {
                "running": info.running,
                "waiting": info.waiting,
                "pending": info.pending,
                "held": info.held,
                "capacity": info.capacity,
                "kv_blocks": {"used": used, "cached": info.cached_blocks, "free": info.free_blocks},
                "heartbeat_age_s": round(status.now - info.updated_at, 2),
                "busy_s": info.busy_s,
            }
        sites[inst.dc].append(row)
    wan = {
        "configured": {"bandwidth_mbps": cfg.wan.bandwidth_mbps, "delay_ms": cfg.wan.delay_ms},
        "estimate_mbps": round(status.wan_estimate_mbps, 1),
        "emulated": cfg.wan.enabled,
        "lines": lines,
    }
    return {"datacenters": sites, "wan": wan, "plans": status.plans}
