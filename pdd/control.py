"""Operator commands against a running cluster: `pdd wan` and `pdd status`.

`pdd up` leaves a state file per cluster (`$PDD_STATE_DIR`, default ~/.cache/pdd/run/,
`cluster-<port>.json`: the gateway's URL and the resolved config); these commands find the
cluster there (by `--port`, else PDD_PORT, else the only one running) and talk to its control
site's NATS server as the `operator` user, the way an operator's tool would.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig, load_config
from shared.messages import ClusterStatus, Inspect, WanControl, WanState
from shared.security import Secrets
from shared.status import status_view


def state_dir() -> Path:
    return Path(os.environ.get("PDD_STATE_DIR") or Path.home() / ".cache" / "pdd" / "run")


def write_state(url: str, port: int, config_path: str, servers: dict[str, int] | None = None) -> Path:
    """The cluster's state file; `servers`: the pids of the NATS and Redis servers it started."""
    path = state_dir() / f"cluster-{port}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"url": url, "config": config_path, "pid": os.getpid(), "servers": servers or {}}
    path.write_text(json.dumps(state))
    return path


def read_state(port: int) -> dict[str, Any]:
    path = state_dir() / f"cluster-{port}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def find_cluster(port: int | None) -> ClusterConfig:
    """The running cluster's config; SystemExit naming what is missing when there is none."""
    port = port or (int(os.environ["PDD_PORT"]) if os.environ.get("PDD_PORT") else None)
    files = [state_dir() / f"cluster-{port}.json"] if port else sorted(state_dir().glob("cluster-*.json"))
    running = [f for f in files if f.exists() and _alive(json.loads(f.read_text()).get("pid", 0))]
    if len(running) != 1:
        what = f"on port {port}" if port else f"in {state_dir()}"
        raise SystemExit(
            f"pdd: {'no' if not running else 'more than one'} running cluster {what}"
            + ("; start one with `pdd up`" if not running else "; name one with --port")
        )
    return load_config(json.loads(running[0].read_text())["config"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pid > 0
    except OSError:
        return False


async def ask(cfg: ClusterConfig, subject: str, msg: Any, reply_type: type, timeout: float = 5.0) -> Any:
    bus = await Bus.connect(cfg.nats_url_for(cfg.control_dc), "pdd-operator", "operator", Secrets.of(cfg))
    try:
        return await bus.request(subject, msg, reply_type, timeout)
    finally:
        await bus.close()


async def gather_status(cfg: ClusterConfig) -> dict[str, Any]:
    """The registry's view (from the scheduler) and the line's figures, sampled 0.5 s apart."""
    bus = await Bus.connect(cfg.nats_url_for(cfg.control_dc), "pdd-status", "operator", Secrets.of(cfg))
    try:
        status = await bus.request(subjects.STATUS, Inspect(), ClusterStatus, 5.0)
        lines = None
        if cfg.wan.enabled:
            first = await bus.request(subjects.wan_control(cfg.wan.name), WanControl(), WanState, 5.0)
            await asyncio.sleep(0.5)
            second = await bus.request(subjects.wan_control(cfg.wan.name), WanControl(), WanState, 5.0)
            lines = {
                d: {**dataclasses.asdict(ls), "bytes_per_s": (ls.bytes - first.lines[d].bytes) / 0.5}
                for d, ls in second.lines.items()
            }
    finally:
        await bus.close()
    return status_view(cfg, status, lines, await members(cfg, read_state(cfg.port).get("servers", {})))


async def members(cfg: ClusterConfig, pids: dict[str, int]) -> list[dict[str, Any]]:
    """The NATS servers of each site (up while their port answers; pids as `pdd up` started
    them) and the Redis servers and Sentinels (each asked for its pid and role: which one is
    the primary now)."""
    rows: list[dict[str, Any]] = []
    for dc in cfg.datacenters:
        for server in cfg.nats_servers(dc.name):
            up = await _answers("127.0.0.1", server.port)
            rows.append({"role": "nats", "id": server.name, "dc": dc.name, "pid": pids.get(server.name, 0)})
            rows[-1]["state"] = "up" if up else "down"
    secrets = Secrets.of(cfg)
    password = secrets.redis_password if secrets else None
    plane = cfg.control_plane
    servers = [("redis", cfg.redis_url)]
    servers += [(n, f"redis://127.0.0.1:{plane.ports[n]}") for n in (*plane.replica_names, *plane.sentinel_names)]
    for name, url in servers:
        row = {"role": "redis", "id": name, "dc": cfg.control_dc, "pid": pids.get(name, 0), "state": "down"}
        if name.startswith("sentinel"):
            row["sentinel"] = True
        client = aioredis.Redis.from_url(url, password=password, socket_timeout=1.0)
        try:
            info = await client.info("server")
            row |= {"pid": int(info["process_id"]), "state": "up"}
            if not row.get("sentinel"):
                row["primary"] = (await client.info("replication"))["role"] == "master"
        except Exception:
            pass
        finally:
            await client.aclose()
        rows.append(row)
    return rows


async def _answers(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def status_command(args: argparse.Namespace) -> int:
    view = asyncio.run(gather_status(find_cluster(args.port)))
    print(json.dumps(view, indent=2) if args.json else format_status(view))
    return 0


def format_status(view: dict[str, Any]) -> str:
    out = []
    for dc, rows in view["datacenters"].items():
        out.append(f"datacenter {dc}")
        for r in rows:
            if r["state"] != "up":
                out.append(f"  {r['id']:<10} {r['role']:<8} MISSING (no heartbeat)")
                continue
            kv = r["kv_blocks"]
            out.append(
                f"  {r['id']:<10} {r['role']:<8} up  running {r['running']:>3}  waiting {r['waiting']:>3}  "
                f"pending {r['pending']:>3}  held {r['held']}/{r['capacity']}  "
                f"KV blocks used {kv['used']} cached {kv['cached']} free {kv['free']}"
            )
    wan = view["wan"]
    out.append(
        f"line: configured {wan['configured']['bandwidth_mbps']:g} Mbps, {wan['configured']['delay_ms']:g} ms "
        f"one way; scheduler's estimate {wan['estimate_mbps']:g} Mbps"
    )
    for d, ls in (wan["lines"] or {}).items():
        state = "DOWN" if ls["down"] else "stalled" if ls["stalled"] else "up"
        out.append(
            f"  {d} {state}: {ls['bandwidth_mbps']:g} Mbps now, carrying {ls['bytes_per_s'] * 8 / 1e6:.2f} Mbit/s, "
            f"{ls['bytes'] / 1e6:.1f} MB since start"
        )
    out.append("plans: " + ", ".join(f"{p} {n}" for p, n in sorted(view["plans"].items())))
    return "\n".join(out)


def add_status_arguments(sub) -> None:
    p = sub.add_parser("status", help="instances by datacenter and the line, of a running `pdd up` cluster")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="the cluster's gateway port (default PDD_PORT, or the only running cluster)",
    )
    p.set_defaults(func=status_command)


def wan_command(args: argparse.Namespace) -> int:
    cfg = find_cluster(args.port)
    settings = {"bandwidth_mbps": args.bandwidth_mbps, "delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms}
    msg = WanControl(
        direction=args.direction,
        forward=args.forward,
        down={"down": True, "up": False}.get(args.action),
        **(settings if args.action == "set" else {}),
    )
    state: WanState = asyncio.run(ask(cfg, subjects.wan_control(cfg.wan.name), msg, WanState))
    print(format_wan(state))
    if state.error:
        print(f"pdd wan: {state.error}", file=sys.stderr)
        return 2
    return 0


def format_wan(state: WanState) -> str:
    lines = [f"line {state.name}:"]
    for direction, ls in state.lines.items():
        status = "DOWN" if ls.down else "stalled" if ls.stalled else "up"
        lines.append(
            f"  {direction}  {status:<7} {ls.bandwidth_mbps:>9.1f} Mbps  delay {ls.delay_ms:g} ms "
            f"+- {ls.jitter_ms:g} ms  carried {ls.bytes / 1e6:.1f} MB"
        )
    for name, port in state.forwards.items():
        lines.append(
            f"  forward {name:<10} port {port:<6} open {state.connections.get(name, 0)}  "
            f"accepted {state.accepted.get(name, 0)}"
        )
    return "\n".join(lines)


def add_wan_arguments(sub) -> None:
    p = sub.add_parser("wan", help="show or change the emulated line of a running `pdd up` cluster")
    p.add_argument(
        "action",
        choices=["show", "set", "down", "up"],
        help="show it; set bandwidth, delay or jitter; take it down (nothing crosses) or bring it back up",
    )
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="with `set`: the rate, in Mbit/s")
    p.add_argument("--delay-ms", type=float, default=None, help="with `set`: one-way delay, in ms")
    p.add_argument("--jitter-ms", type=float, default=None, help="with `set`: +- jitter on the delay, in ms")
    p.add_argument("--direction", choices=["both", "a-b", "b-a"], default="both", help="which way (default both)")
    p.add_argument("--forward", default="", help="down/up one forward only (a decoder's KV port, nats-B)")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="the cluster's gateway port (default PDD_PORT, or the only running cluster)",
    )
    p.set_defaults(func=wan_command)
