"""`python -m services.wanlink --config FILE [--ready-file PATH]`

Runs the config's emulated line between its two sites until SIGTERM / SIGINT: one listen port
per forward (`wan.ports`, or free ones), each to the one endpoint the topology names. Control
comes over the scheduler's site's NATS server (`pdd.wanlink.<name>.control`, as the `wanlink`
user) when the config gives one. `--ready-file` gets the forward ports (JSON) once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from services.wanlink.link import WanLink, forwards_of
from shared.bus import Bus
from shared.config import ConfigError, load_config
from shared.logs import setup_logging
from shared.security import Secrets

log = logging.getLogger("wanlink")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.wanlink", description="The WAN emulator between two sites.")
    p.add_argument("--config", help="cluster YAML (its `wan` section and topology); default configs/single-host.yaml")
    p.add_argument("--ready-file", type=Path, help="write the forward ports here (JSON) once listening")
    return p.parse_args(argv)


def write_ready_file(path: Path, ports: dict[str, int]) -> None:
    """Atomically, so a launcher polling the file never reads half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(ports))
    tmp.replace(path)


async def run(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    name = f"wanlink-{cfg.wan.name}"
    bus = None
    if cfg.nats_url or cfg.datacenter(cfg.control_dc).nats_url:
        bus = await Bus.connect(cfg.nats_url_for(cfg.control_dc), name, user="wanlink", secrets=Secrets.of(cfg))
    else:
        log.warning("%s: no NATS server in the config: running without runtime control", name)
    link = WanLink(cfg.wan, forwards_of(cfg), bus)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        ports = await link.start(cfg.host)
        if args.ready_file:
            write_ready_file(args.ready_file, ports)
        log.info("%s: forwards %s: %s", name, ports, link.describe())
        await stop.wait()
        log.info("%s: stopping", name)
    finally:
        await link.stop()
        if bus is not None:
            await bus.close()


def main(argv: list[str] | None = None) -> int:
    setup_logging("wanlink")
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except (ConfigError, ValueError) as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
