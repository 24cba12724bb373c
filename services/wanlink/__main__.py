"""`python -m services.wanlink --config FILE [--listen-port N] [--ready-file PATH]`

Runs the config's `wan` link until SIGTERM / SIGINT. NATS (runtime control) and Redis (byte
counts, state) come from the config's nats_url / redis_url or PDD_NATS_URL / PDD_REDIS_URL;
without them the link still forwards, uncontrolled / in-memory only. `--ready-file` gets the
bound port once the link listens, so a launcher can find a link started on port 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from redis.asyncio import Redis

from services.wanlink.link import WanLink
from shared.bus import Bus
from shared.config import ConfigError, load_config
from shared.registry import Registry

log = logging.getLogger("wanlink")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.wanlink",
        description="The WAN emulator: a shaped, faultable TCP proxy for the KV plane A -> B.",
    )
    p.add_argument("--config", help="cluster YAML (its `wan` section); default configs/single-host.yaml")
    p.add_argument("--listen-host", default="", help="default: the config's host")
    p.add_argument("--listen-port", type=int, default=0, help="0 = a free port (see --ready-file)")
    p.add_argument("--ready-file", type=Path, help="write the bound port here once listening")
    return p.parse_args(argv)


def write_ready_file(path: Path, port: int) -> None:
    """Atomically, so a launcher polling the file never reads half a number."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


async def run(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    name = f"wanlink-{cfg.wan.name}"
    bus = await Bus.connect(cfg.nats_url, name) if cfg.nats_url else None
    redis = Redis.from_url(cfg.redis_url) if cfg.redis_url else None
    missing = [what for what, client in (("NATS", bus), ("Redis", redis)) if client is None]
    if missing:
        log.warning("%s: no %s URL, running without it (no runtime control / counts)", name, " or ".join(missing))
    link = WanLink(cfg.wan, bus, redis)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await link.start(args.listen_host or cfg.host, args.listen_port)
        if args.ready_file:
            write_ready_file(args.ready_file, port)
        refresher = None
        if redis is not None:  # the scheduler sends src -> dst KV through this route
            route_host = cfg.advertise_host or args.listen_host or cfg.host
            refresher = asyncio.create_task(_keep_route(Registry(redis, cfg.heartbeat_ttl_s), cfg, route_host, port))
        log.info("%s listening on %s:%d: %s", name, args.listen_host or cfg.host, port, link.describe())
        await stop.wait()
        if refresher is not None:
            refresher.cancel()
        log.info("%s: stopping", name)
    finally:
        await link.stop()
        if bus is not None:
            await bus.close()
        if redis is not None:
            await redis.aclose()


async def _keep_route(registry: Registry, cfg, host: str, port: int) -> None:
    """Register the route, and again every heartbeat: a restarted Redis gets it back."""
    while True:
        try:
            await registry.set_route(cfg.wan.src_dc, cfg.wan.dst_dc, host, port)
        except Exception as e:
            log.warning("could not register the WAN route: %s", e)
        await asyncio.sleep(cfg.heartbeat_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except (ConfigError, ValueError) as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
