"""Each instance's busy fraction over a run: the share of wall time its engine spent in steps.

A run bound by compute shows an instance near 1.0 (prefill, on a CPU, most often); a run bound
by the line shows every engine mostly idle while requests wait on KV. Each engine reports
`busy_s` (cumulative seconds in engine steps) in its heartbeat; the scheduler's registry view
(`ClusterStatus` on `pdd.scheduler.status`, asked as the `operator` user) is read when a mode's
replay starts and when it ends:

    busy_fraction = (busy_s at the end - busy_s at the start) / (updated_at at the end - at the start)

per instance, the wall time being that of the two heartbeats the figures came from (both read
at a step boundary, so the interval and the busy time it holds agree). An instance missing from
either view, or restarted in between, is left out. With no status to read (a server that is not
PDD, or one whose NATS we cannot reach) there is no busy figure at all: None, never zeros.

With the emulated line's name, the probe also reads the line's own counters at both ends
(`WanState` on its control subject): the bytes each forward carried each way during the replay
(`line_bytes`). That is what crossed the WAN, whoever asked for it: KV pushes to decoders in the
other site (TLS framing included, aborted and cache-warming pushes too) and the NATS link.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any
from urllib.parse import urlsplit

from shared import subjects
from shared.bus import Bus
from shared.messages import ClusterStatus, Inspect, WanControl, WanState
from shared.security import Secrets

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


async def cluster_status(nats_url: str, secrets: Secrets | None, timeout: float = 5.0) -> ClusterStatus | None:
    """The scheduler's registry view, or None (with a note on stderr) when it cannot be had."""
    bus = None
    try:
        bus = await asyncio.wait_for(Bus.connect(nats_url, "bench", "operator", secrets), timeout)
        return await bus.request(subjects.STATUS, Inspect(), ClusterStatus, timeout)
    except Exception as e:  # no busy figures is an answer; the run goes on
        print(f"pdd bench: no cluster status from {nats_url} ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    finally:
        if bus is not None:
            await bus.close()


async def line_state(nats_url: str, secrets: Secrets | None, line: str, timeout: float = 5.0) -> WanState | None:
    """The emulated line's counters, or None (with a note on stderr)."""
    bus = None
    try:
        bus = await asyncio.wait_for(Bus.connect(nats_url, "bench", "operator", secrets), timeout)
        state = await bus.request(subjects.wan_control(line), WanControl(), WanState, timeout)
        return None if state.error else state
    except Exception as e:
        print(f"pdd bench: no line counters from {line} ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    finally:
        if bus is not None:
            await bus.close()


def line_bytes(before: WanState | None, after: WanState | None) -> dict[str, dict[str, int]] | None:
    """{direction: {forward: bytes carried between the two readings}}; None without both."""
    if before is None or after is None:
        return None
    out = {}
    for direction, line in after.lines.items():
        start = before.lines[direction].bytes_by_forward if direction in before.lines else {}
        out[direction] = {f: n - start.get(f, 0) for f, n in sorted(line.bytes_by_forward.items())}
    return out


def busy_fractions(before: ClusterStatus | None, after: ClusterStatus | None) -> dict[str, dict[str, Any]] | None:
    """{instance id: {"role", "dc", "busy_s", "wall_s", "busy_fraction"}} between two views; None
    without both. busy_fraction is clamped to [0, 1] (a step that began before the first view can
    end inside the interval)."""
    if before is None or after is None:
        return None
    first = {i.id: i for i in before.instances}
    out: dict[str, dict[str, Any]] = {}
    for inst in sorted(after.instances, key=lambda i: i.id):
        start = first.get(inst.id)
        if start is None or start.started_at != inst.started_at:
            continue
        busy, wall = inst.busy_s - start.busy_s, inst.updated_at - start.updated_at
        if wall <= 0:
            continue
        fraction = min(max(busy / wall, 0.0), 1.0)
        out[inst.id] = {
            "role": inst.role,
            "dc": inst.dc,
            "busy_s": round(busy, 3),
            "wall_s": round(wall, 3),
            "busy_fraction": round(fraction, 4),
        }
    return out


class BusyProbe:
    """Reads the registry view (and the line's counters, given its name) at `start()` and
    `stop()`; `stop()` returns `busy_fractions` and leaves the line's in `line_bytes`."""

    def __init__(self, nats_url: str, secrets: Secrets | None, line: str | None = None) -> None:
        self.nats_url, self.secrets, self.line = nats_url, secrets, line
        self.before: ClusterStatus | None = None
        self.line_before: WanState | None = None
        self.line_bytes: dict[str, dict[str, int]] | None = None

    async def start(self) -> None:
        self.before = await cluster_status(self.nats_url, self.secrets)
        if self.line:
            self.line_before = await line_state(self.nats_url, self.secrets, self.line)

    async def stop(self) -> dict[str, dict[str, Any]] | None:
        if self.line:
            self.line_bytes = line_bytes(self.line_before, await line_state(self.nats_url, self.secrets, self.line))
        if self.before is None:
            return None
        return busy_fractions(self.before, await cluster_status(self.nats_url, self.secrets))


def local_cluster_probe(base_url: str) -> BusyProbe | None:
    """For `--base-url` on this host: the `pdd up` cluster serving that port, if there is one
    (pdd/control.py's state file names its config, hence its NATS and credentials); else None."""
    parts = urlsplit(base_url)
    if parts.hostname not in LOCAL_HOSTS or not parts.port:
        return None
    from pdd.control import find_cluster

    try:
        cfg = find_cluster(parts.port)
        return BusyProbe(cfg.nats_url_for(cfg.control_dc), Secrets.of(cfg))
    except (SystemExit, Exception):  # no cluster of ours there: another server
        return None
