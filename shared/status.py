"""The cluster at a glance, as plain data: instances by datacenter (role, state, load, KV
blocks used / cached / free, requests held) and the line between the sites. `pdd status` prints
it and the gateway's dashboard draws it; both build it here from the scheduler's registry view
(`ClusterStatus`) and the line's figures.
"""

from __future__ import annotations

from typing import Any

from shared.config import ClusterConfig
from shared.messages import ClusterStatus


def status_view(
    cfg: ClusterConfig, status: ClusterStatus, lines: dict | None, members: list[dict] | None = None
) -> dict[str, Any]:
    """Plain data for `pdd status --json` and the dashboard: instances by site, the line, and
    every process (`processes`: the instances, the gateways and schedulers, and the NATS and
    Redis `members` the caller found)."""
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
    return {
        "datacenters": sites,
        "wan": wan,
        "plans": status.plans,
        "processes": _processes(cfg, status) + (members or []),
        "status_from": status.scheduler,
    }


def _processes(cfg: ClusterConfig, status: ClusterStatus) -> list[dict[str, Any]]:
    """One row per planned service process: role, id, dc, pid and state ("up" while its heartbeat
    or presence lasts, else "missing"); a gateway's URL; a scheduler's plan count and last plan."""
    alive = {i.id: i for i in status.instances}
    rows = [
        {"role": i.role.value, "id": i.id, "dc": i.dc, "pid": alive[i.id].pid if i.id in alive else 0}
        | {"state": "up" if i.id in alive else "missing"}
        for i in cfg.instances
    ]
    present = {(p.kind, p.name): p for p in status.control}
    plane = cfg.control_plane
    for kind, names in (("gateway", plane.gateway_names), ("scheduler", plane.scheduler_names)):
        for name in names:
            p = present.get((kind, name))
            row = {"role": kind, "id": name, "dc": cfg.control_dc, "pid": p.pid if p else 0}
            row["state"] = "up" if p else "missing"
            if kind == "gateway":
                row["url"] = p.url if p else f"http://{cfg.host}:{cfg.gateway_port(name)}"
            elif p:
                row |= {"planned": p.planned, "last_request": p.last_request}
            rows.append(row)
    return rows
