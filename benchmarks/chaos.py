"""Chaos bench: faults injected into a live cluster under streaming load, every answer checked.

A real cluster from the shipped config serves a steady load while faults strike one after
another, then all together; each answer is judged against the same request's with no fault.

    .venv/bin/python -m benchmarks.chaos [--quick] [--faults drop,loss,...] [--json PATH]

One cluster (configs/single-host.yaml on free ports, failpoints on) serves the whole run. First
each prompt of `SPECS` is sent once with no fault: its text is the reference (greedy,
`ignore_eos`; the instances' batch-invariant kernels make it the same on every route and under
any load). Then, per fault, `--requests` streams (`--concurrency` at once, completions and chat,
pipelines p-md, p-rld-md, p-rld and the policy's choice) run while the fault is injected once
they are mid-stream; it is healed after its hold time (or once the load is done), and the cluster
must be healthy and idle again before the next fault. Caches are flushed between faults, so
repeated prompts send their KV over the line again.

Each request ends as one of: exact (text equal to the reference), failed (an HTTP error or an
SSE error event: a clear error, its message kept), wrong (completed, different text), cut (the
stream ended without [DONE] and without an error) or hung (no end within `--hang-s`, or three
times the slowest reference where the host is slower). The worst stall is the largest gap
between two SSE events of a stream that completed. Exit status 1 when any request hung, was
wrong or was cut; 2 when the references could not be computed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos_judge import (
    aggregate,
    format_header,
    format_row,
    hang_bound,
    max_gap,
    record_json,
    verdict,
)
from benchmarks.chaos_load import SPECS, Load, raw_request, requests_running, schedule
from benchmarks.environment import ROOT, cpu_model, environment
from shared.pipelines import Role

SHIPPED_CONFIG = ROOT / "configs" / "single-host.yaml"
LOSS_POINTS = ("md/decoder.token_chunk", "rld/decoder.token_chunk", "rld.handoff_chunk", "decoder.final_chunk")


def loss_failpoints(pct: float) -> str:
    """The failpoints file (shared/failpoints.py) that drops `pct`% of the messages it names."""
    return "".join(f"{point}=drop%{pct:g}\n" for point in LOSS_POINTS)


def parse_faults(spec: str) -> list[str]:
    """'drop, loss' -> ['drop', 'loss']; ValueError naming any unknown fault."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULT_ORDER]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULT_ORDER)}")
    if not names:
        raise ValueError("no fault named")
    return names


# -- the faults ---------------------------------------------------------------------------


class Chaos:
    """The cluster and the operator's hands on it (all from the main thread)."""

    def __init__(self, cluster, loss_pct: float) -> None:
        self.cluster, self.loss_pct = cluster, loss_pct
        self.references: dict[int, str] = {}  # spec index -> its text with no fault
        self.slow: socket.socket | None = None
        self.killed: list[str] = []

    def instance(self, role: Role) -> str:
        return next(i.id for i in self.cluster.cfg.instances if i.role == role)

    def operator(self, fn: Callable[[Any], Any], timeout: float = 20.0) -> Any:
        """Run `fn(bus)` on a fresh operator connection to the control datacenter's NATS."""
        from shared.bus import Bus

        async def main():
            bus = await Bus.connect(self.cluster.nats_url(), "chaos-bench", "operator", self.cluster.secrets)
            try:
                return await fn(bus)
            finally:
                await bus.close()

        async def bounded():
            return await asyncio.wait_for(main(), timeout)

        return asyncio.run(bounded())

    def wan(self, **settings) -> None:
        from shared import subjects
        from shared.messages import WanControl, WanState

        subject = subjects.wan_control(self.cluster.cfg.wan.name)
        state = self.operator(lambda bus: bus.request(subject, WanControl(**settings), WanState, 5))
        if state.error:
            raise RuntimeError(f"the WAN emulator refused {settings}: {state.error}")

    def failpoints(self, spec: str) -> None:
        self.cluster.failpoints.write_text(spec)

    def kill(self, role: Role) -> None:
        name = self.instance(role)
        self.cluster.kill(name)
        self.killed.append(name)

    def restart(self, role: Role) -> None:
        name = self.instance(role)
        if name in self.killed:
            self.killed.remove(name)
            self.cluster.start_process(name)

    def open_slow_client(self) -> None:
        """A streaming request whose client never reads: a tiny receive buffer, so the gateway's
        writes back up after a few chunks, and an answer long enough to fill what buffers there are."""
        host, port = self.cluster.cfg.host, self.cluster.cfg.port
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.settimeout(10)
        s.connect((host, port))
        body = {"prompt": "Tell me a very long story about the sea.", "max_tokens": 400, "ignore_eos": True}
        s.sendall(raw_request(host, port, "/v1/completions", {**body, "temperature": 0, "stream": True}))
        self.slow = s

    def close_slow_client(self) -> None:
        if self.slow is not None:
            self.slow.close()
            self.slow = None

    def heal_all(self) -> None:
        """Undo whatever is still injected (a failed phase, Ctrl-C)."""
        for action in (lambda: self.failpoints(""), self.close_slow_client):
            try:
                action()
            except Exception:
                pass
        for server in self.cluster.servers.values():
            if server.proc is None or server.proc.poll() is not None:
                server.start()
        for name in list(self.killed):
            self.killed.remove(name)
            self.cluster.start_process(name)


@dataclass(frozen=True)
class Fault:
    what: str
    inject: Callable[[Chaos], None]
    heal: Callable[[Chaos], None] = lambda c: None
    hold_s: float | None = 0.0  # heal this long after injecting; None: once the load is done


def _server(name: str, hold_s: float = 1.0) -> Fault:
    return Fault(
        f"{name} stopped for {hold_s:g} s, then started again",
        lambda c: c.cluster.servers[name].stop(),
        lambda c: c.cluster.servers[name].start(),
        hold_s,
    )


KILL_HOLD_S = 5.0  # past heartbeat_ttl_s (3 s): the death is noticed before the instance is back
FAULTS: dict[str, Fault] = {
    "none": Fault("no fault (the control: every request must be exact)", lambda c: None),
    "drop": Fault("the line cuts every connection through it (leafnode, KV)", lambda c: c.wan(drop=True)),
    "loss": Fault(
        "failpoints drop token, final and handoff chunks",
        lambda c: c.failpoints(loss_failpoints(c.loss_pct)),
        lambda c: c.failpoints(""),
        None,
    ),
    "nats-a": _server("nats-A"),
    "nats-b": _server("nats-B"),
    "redis": _server("redis"),
    "kill-rld": Fault(
        f"the relay SIGKILLed, restarted {KILL_HOLD_S:g} s later",
        lambda c: c.kill(Role.RLD),
        lambda c: c.restart(Role.RLD),
        KILL_HOLD_S,
    ),
    "kill-md": Fault(
        f"main-decode SIGKILLed, restarted {KILL_HOLD_S:g} s later",
        lambda c: c.kill(Role.MD),
        lambda c: c.restart(Role.MD),
        KILL_HOLD_S,
    ),
    "slow-client": Fault(
        "a client opens a stream and never reads it",
        lambda c: c.open_slow_client(),
        lambda c: c.close_slow_client(),
        None,
    ),
    "stall": Fault("the line stalls 2 s", lambda c: c.wan(stall_s=2.0)),
}
# the WAN's faults before the servers': its control goes over NATS A
ALL_TOGETHER = ("loss", "slow-client", "drop", "stall", "kill-rld", "kill-md", "nats-a", "nats-b", "redis")
FAULT_ORDER = (*FAULTS, "all")


def faults_of(name: str) -> list[tuple[str, Fault]]:
    return [(n, FAULTS[n]) for n in (ALL_TOGETHER if name == "all" else (name,))]


# -- the driver ---------------------------------------------------------------------------


def _try(notes: list[str], what: str, action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception as e:
        notes.append(f"{what} failed: {type(e).__name__}: {e}")


def settle(cluster, timeout: float) -> tuple[float, str]:
    """Until the gateway is healthy and holds no request: (seconds taken, "" or what is wrong)."""
    t0, problem = time.monotonic(), ""
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(cluster.url + "/health", timeout=2).status_code != 200:
                problem = "the gateway does not report every role alive"
            elif running := requests_running(httpx.get(cluster.url + "/metrics", timeout=5).text):
                problem = f"{running} request(s) still running at the gateway"
            else:
                return time.monotonic() - t0, ""
        except httpx.HTTPError as e:
            problem = f"the gateway did not answer: {type(e).__name__}"
        time.sleep(0.25)
    return time.monotonic() - t0, problem


def flush_caches(chaos: Chaos, notes: list[str]) -> None:
    """Every instance drops its cached prefixes, so the next fault's repeated prompts move KV again."""
    from shared import subjects
    from shared.messages import Inspect, InstanceState

    async def flush(bus) -> None:
        for inst in chaos.cluster.cfg.instances:
            await bus.request(subjects.flush_cache(inst.id), Inspect(inst.id), InstanceState, 10)

    _try(notes, "flushing the caches", lambda: chaos.operator(flush, 60))


def run_phase(chaos: Chaos, name: str, specs: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """One fault under load: its row of the table."""
    notes: list[str] = []
    load = Load(chaos.cluster.url, specs, args.concurrency, args.hang_s, chaos.references).start()
    wait_s = max(60.0, args.hang_s / 3)  # the slowest reference's time, on a slow host
    if not load.wait_streaming(min(args.concurrency, len(specs)), wait_s):
        notes.append(f"not every stream was mid-way within {wait_s:.0f} s: injected anyway")
    faults = faults_of(name)
    injected, injected_s = time.monotonic(), time.perf_counter() - load.t0
    for fname, fault in faults:
        _try(notes, f"injecting {fname}", lambda f=fault: f.inject(chaos))
    timed = sorted((f.hold_s, n, f) for n, f in faults if f.hold_s is not None)
    for hold_s, fname, fault in timed:
        time.sleep(max(0.0, injected + hold_s - time.monotonic()))
        _try(notes, f"healing {fname}", lambda f=fault: f.heal(chaos))
    while not load.done():  # the faults held for the whole load end with it
        time.sleep(0.1)
    records = load.join()
    for fname, fault in faults:
        if fault.hold_s is None:
            _try(notes, f"healing {fname}", lambda f=fault: f.heal(chaos))
    _try(notes, "healing what was left", chaos.heal_all)
    took, problem = settle(chaos.cluster, args.settle_s)
    if problem:
        notes.append(f"not settled after {took:.0f} s: {problem}")
    elif took > 2:
        notes.append(f"healthy and idle {took:.0f} s after the load")
    for pname, proc in chaos.cluster.procs.items():  # something died that no fault killed
        if proc.poll() is not None:
            notes.append(f"{pname} had exited ({proc.returncode}); restarted")
            _try(notes, f"restarting {pname}", lambda p=pname: chaos.cluster.start_process(p))
    flush_caches(chaos, notes)
    row = aggregate(name, records, load.wall_s, notes)
    row["injected_s"] = injected_s  # since the load started, as each record's sent_s
    row["records"] = [record_json(r) for r in records]
    return row


def compute_references(url: str, args: argparse.Namespace) -> tuple[dict[int, str], list[str], list[float]]:
    """Each spec's text with no fault: (references, problems, each one's seconds)."""
    load = Load(url, list(range(len(SPECS))), args.concurrency, 3 * args.hang_s).start()
    refs, problems, records = {}, [], load.join()
    for r in records:
        if r.completed and not r.error:
            refs[r.spec] = r.text
        else:
            problems.append(f"spec {r.spec}: {r.error or r.cut or ('hung' if r.timed_out else 'no [DONE]')}")
    worst = max((max_gap(r.event_times_s) for r in records), default=0.0)
    print(
        f"chaos: references of {len(refs)} prompts in {load.wall_s:.0f} s (slowest "
        f"{max(r.elapsed_s for r in records):.1f} s, worst stall {worst:.2f} s)",
        flush=True,
    )
    return refs, problems, [r.elapsed_s for r in records]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(SHIPPED_CONFIG))
    p.add_argument("--faults", default=",".join(FAULT_ORDER), help=f"comma-separated: {','.join(FAULT_ORDER)}")
    p.add_argument("--quick", action="store_true", help="fewer requests per fault")
    p.add_argument("--requests", type=int, default=None, help="per fault (default 12; --quick 4)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--hang-s", type=float, default=120.0, help="hung: not ended after this long (or 3x the slowest reference)"
    )
    p.add_argument("--settle-s", type=float, default=90.0, help="wait this long for health after a fault")
    p.add_argument("--loss-pct", type=float, default=3.0, help="message loss of the loss fault, percent")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    a = p.parse_args(argv)
    try:
        names = parse_faults(a.faults)
    except ValueError as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 2
    a.requests = a.requests or (4 if a.quick else 12)
    from pdd.launcher import Cluster

    host = f"{cpu_model()}, {len(os.sched_getaffinity(0))} usable CPUs"
    print(f"chaos: host {host}; faults {', '.join(names)}; {a.requests} requests each, {a.concurrency} at once")
    cluster = Cluster(a.config, log=lambda m: None, failpoints=True, port=0)
    print(f"chaos: starting the cluster from {a.config} (logs in {cluster.run_dir})", flush=True)
    rows: list[dict[str, Any]] = []
    chaos = Chaos(cluster, a.loss_pct)
    t0 = time.monotonic()
    try:
        cluster.start(300)
        refs, problems, seconds = compute_references(cluster.url, a)
        if problems:
            print("chaos: no reference for " + "; ".join(problems), file=sys.stderr)
            return 2
        chaos.references, a.hang_s = refs, hang_bound(seconds, a.hang_s)
        print(f"chaos: a request not ended within {a.hang_s:.0f} s hung", flush=True)
        print(format_header(), flush=True)
        for i, name in enumerate(names):
            row = run_phase(chaos, name, schedule(i, a.requests, len(SPECS)), a)
            rows.append(row)
            print("\n".join(format_row(row)), flush=True)
    finally:
        try:
            chaos.heal_all()
        finally:
            cluster.stop()
    status, line = verdict(rows)
    print(f"\nchaos: {len(rows)} faults in {time.monotonic() - t0:.0f} s on {host}")
    print(format_header())
    for row in rows:
        print(format_row(row)[0])
    print(line)
    if a.json:
        out = {
            "environment": environment({i.id: i.threads for i in cluster.cfg.instances}),
            "settings": {k: v for k, v in vars(a).items() if k != "json"},
            "specs": [asdict(s) | {"reference": chaos.references.get(i, "")} for i, s in enumerate(SPECS)],
            "faults": {n: FAULTS[n].what if n in FAULTS else "all of them at once" for n in names},
            "rows": rows,
            "exit_status": status,
        }
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"chaos: figures in {a.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
