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
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.environment import ROOT, cpu_model, environment
from benchmarks.stats import percentile

SHIPPED_CONFIG = ROOT / "configs" / "single-host.yaml"
EXACT, FAILED, WRONG, CUT, HUNG = "exact", "failed", "wrong", "cut", "hung"
OUTCOMES = (EXACT, FAILED, WRONG, CUT, HUNG)
BAD = (WRONG, CUT, HUNG)  # any of these fails the run; a clear error does not
STREAMING_EVENTS = 3  # text events a stream has had before it counts as mid-stream
LOSS_POINTS = ("md/decoder.token_chunk", "rld/decoder.token_chunk", "rld.handoff_chunk", "decoder.final_chunk")


# -- the requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request of the load: the same body every time it is sent, so one reference fits all."""

    kind: str  # "completion" | "chat"
    pipeline: str | None  # forced with the admin `pdd` extension; None: the policy decides
    prompt: str
    max_tokens: int


_CONTEXT = (
    "The harbour town kept its lighthouse lit through every storm of the winter. Fishermen counted "
    "on the beam, traders on the tides, and the keeper on the oil delivered each Tuesday. "
)
# Any four in a row cover every pipeline (the schedule rotates per fault), half of them chat.
SPECS = (
    Spec("completion", "p-md", "Once upon a time in a quiet village,", 80),
    Spec("chat", "p-rld-md", _CONTEXT * 6 + "Summarise what the town depended on.", 100),
    Spec("completion", "p-rld", "The three most important ideas in computer networking are", 60),
    Spec("chat", None, "Explain in a few sentences how a steam engine works.", 120),
    Spec("chat", "p-md", _CONTEXT * 4 + "Write the keeper's diary entry for a stormy night.", 90),
    Spec("completion", "p-rld-md", "A recipe for a simple tomato soup: first,", 70),
    Spec("chat", "p-rld", "List some reasons why people keep houseplants.", 100),
    Spec("completion", None, _CONTEXT * 8 + "In the spring, the town", 80),
)


def request_body(spec: Spec) -> tuple[str, dict[str, Any]]:
    """(path, body) of a greedy streamed request for `spec`."""
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if spec.pipeline:
        body["pdd"] = {"pipeline": spec.pipeline}
    if spec.kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": spec.prompt}]}
    return "/v1/completions", {**body, "prompt": spec.prompt}


def schedule(phase: int, n: int, n_specs: int) -> list[int]:
    """Which spec each of a fault's `n` requests sends: round-robin, starting one further on per
    fault, so the streams in flight when a fault strikes differ from fault to fault."""
    return [(phase + i) % n_specs for i in range(n)]


def loss_failpoints(pct: float) -> str:
    """The failpoints file (shared/failpoints.py) that drops `pct`% of the messages it names."""
    return "".join(f"{point}=drop%{pct:g}\n" for point in LOSS_POINTS)


# -- one stream ---------------------------------------------------------------------------


@dataclass
class SSE:
    done: bool = False  # `data: [DONE]`
    text: str = ""
    error: str = ""
    finish_reason: str | None = None
    pdd: dict[str, Any] | None = None


def parse_data_line(line: str) -> SSE | None:
    """An SSE line of a completion or chat stream; None for what is not a `data:` line.
    Raises ValueError when its JSON does not parse."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return SSE(done=True)
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        return SSE(error=str(error.get("message", error) if isinstance(error, dict) else error))
    choices = event.get("choices") or []  # the usage chunk has none
    choice = choices[0] if choices else {}
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return SSE(text=text, finish_reason=choice.get("finish_reason"), pdd=event.get("pdd"))


def http_error_message(status: int, body: bytes) -> str:
    """`HTTP 503: <the error's message>` from an OpenAI-shaped error body (or its raw start)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace").strip()
    return f"HTTP {status}: {message}"


@dataclass
class Record:
    """What the client saw of one request."""

    spec: int
    pipeline: str | None
    sent_s: float = 0.0  # since the fault's load started
    elapsed_s: float = 0.0
    text: str = ""
    text_events: int = 0
    event_times_s: list[float] = field(default_factory=list)  # since it was sent: every data line
    completed: bool = False  # saw [DONE]
    error: str = ""  # a clear error: HTTP status or SSE error event
    cut: str = ""  # why the stream broke without one (transport error, bad JSON)
    timed_out: bool = False
    pdd: dict[str, Any] = field(default_factory=dict)
    outcome: str = ""


def judge(text: str, reference: str | None, error: str, completed: bool, timed_out: bool) -> str:
    """The outcome of one request (see the module's docstring)."""
    if timed_out:
        return HUNG
    if error:
        return FAILED
    if not completed:
        return CUT
    return EXACT if text == reference else WRONG


def max_gap(times: list[float]) -> float:
    """The largest gap between consecutive timestamps (0 for fewer than two)."""
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


# -- a fault's figures --------------------------------------------------------------------


def aggregate(fault: str, records: list[Record], wall_s: float, notes: list[str] | None = None) -> dict[str, Any]:
    """One row of the table from a fault's judged records."""
    counts = Counter(r.outcome for r in records)
    survived = [r for r in records if r.outcome in (EXACT, WRONG)]
    exact_s = sorted(r.elapsed_s for r in records if r.outcome == EXACT)
    messages = Counter(r.error for r in records if r.outcome == FAILED)
    messages.update(r.cut or "stream ended without [DONE]" for r in records if r.outcome == CUT)
    return {
        "fault": fault,
        "sent": len(records),
        **{o: counts.get(o, 0) for o in OUTCOMES},
        "worst_stall_s": max((max_gap(r.event_times_s) for r in survived), default=0.0),
        "p50_exact_s": percentile(exact_s, 50),
        "resends": sum(r.pdd.get("resends", 0) for r in records),
        "migrations": sum(r.pdd.get("migrations", 0) for r in records),
        "wall_s": wall_s,
        "errors": dict(messages.most_common()),
        "notes": list(notes or []),
    }


_COLUMNS = (
    ("fault", "<12"),
    ("sent", ">4"),
    (EXACT, ">5"),
    (FAILED, ">6"),
    (WRONG, ">5"),
    (CUT, ">4"),
    (HUNG, ">4"),
    ("worst stall", ">11"),
    ("p50 exact", ">9"),
    ("resends", ">7"),
    ("migr", ">4"),
    ("wall", ">6"),
)


def format_header() -> str:
    return " ".join(f"{name:{fmt}}" for name, fmt in _COLUMNS)


def format_row(row: dict[str, Any]) -> list[str]:
    """The row's table line, then one indented line per distinct error and per note."""
    cells = (
        row["fault"],
        row["sent"],
        *(row[o] for o in OUTCOMES),
        f"{row['worst_stall_s']:.2f} s",
        f"{row['p50_exact_s']:.1f} s",
        row["resends"],
        row["migrations"],
        f"{row['wall_s']:.0f} s",
    )
    lines = [" ".join(f"{cell:{fmt}}" for cell, (_, fmt) in zip(cells, _COLUMNS))]
    lines += [f"    {n}x {message}" for message, n in row["errors"].items()]
    lines += [f"    note: {note}" for note in row["notes"]]
    return lines


def verdict(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """(exit status, one line): 1 when any request hung, was wrong or was cut."""
    bad = {o: sum(r[o] for r in rows) for o in BAD}
    sent = sum(r["sent"] for r in rows)
    exact = sum(r[EXACT] for r in rows)
    failed = sum(r[FAILED] for r in rows)
    line = f"{sent} requests: {exact} exact, {failed} failed with an error, " + ", ".join(
        f"{n} {o}" for o, n in bad.items()
    )
    if any(bad.values()):
        culprits = [r["fault"] for r in rows if any(r[o] for o in BAD)]
        return 1, f"chaos: NOT OK: {line} (under {', '.join(culprits)})"
    return 0, f"chaos: ok: {line}"


def parse_faults(spec: str) -> list[str]:
    """'drop, loss' -> ['drop', 'loss']; ValueError naming any unknown fault."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULT_ORDER]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULT_ORDER)}")
    if not names:
        raise ValueError("no fault named")
    return names


def raw_request(host: str, port: int, path: str, body: dict[str, Any]) -> bytes:
    """An HTTP/1.1 POST of `body` as JSON, as the slow client writes it on its socket."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def requests_running(metrics_text: str) -> int | None:
    """The gateway's pdd:num_requests_running from its /metrics text (None if absent)."""
    found = re.search(r"^pdd:num_requests_running(?:\{[^}]*\})? (\S+)$", metrics_text, re.M)
    return int(float(found.group(1))) if found else None


# -- the load -----------------------------------------------------------------------------


class Load:
    """`--concurrency` streams at a time until every request of the list has ended, on an event
    loop of its own thread (the main thread injects faults: the launcher starts processes from
    it). Every request is bounded by `hang_s`; a hung one is abandoned and recorded."""

    def __init__(
        self,
        url: str,
        specs: list[int],
        concurrency: int,
        hang_s: float,
        references: dict[int, str] | None = None,
        pause_s: float = 0.5,
    ):
        self.url, self.specs, self.concurrency, self.hang_s, self.pause_s = url, specs, concurrency, hang_s, pause_s
        self.references = references or {}
        self.records: list[Record | None] = [None] * len(specs)
        self.streaming = 0  # requests that are mid-stream or past it
        self.t0 = 0.0
        self.wall_s = 0.0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="chaos-load", daemon=True)

    def start(self) -> Load:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def wait_streaming(self, n: int, timeout: float) -> bool:
        """Until `n` requests are mid-stream (or the load ended); False after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.streaming < n and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> list[Record]:
        """The records, once every request has ended (each is bounded, so this is too)."""
        waves = -(-len(self.specs) // max(self.concurrency, 1))
        self._thread.join(waves * (self.hang_s + self.pause_s + 30) + 30)
        for i, rec in enumerate(self.records):  # only if the loop itself got stuck
            if rec is None or not rec.outcome:
                rec = rec or Record(self.specs[i], SPECS[self.specs[i]].pipeline)
                rec.timed_out, rec.outcome = True, HUNG
                self.records[i] = rec
        return list(self.records)  # type: ignore[arg-type]

    async def _main(self) -> None:
        queue = list(range(len(self.specs)))
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # a fresh connection each
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.hang_s + 30, connect=10), limits=limits) as client:

            async def worker() -> None:
                while queue:
                    rec = await self._one(client, queue.pop(0))
                    if rec.outcome in (FAILED, CUT, HUNG):  # as a client backs off: an outage does not eat the load
                        await asyncio.sleep(self.pause_s)

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        self.wall_s = time.perf_counter() - self.t0

    async def _one(self, client: httpx.AsyncClient, i: int) -> Record:
        spec = self.specs[i]
        rec = self.records[i] = Record(spec, SPECS[spec].pipeline, sent_s=time.perf_counter() - self.t0)
        path, body = request_body(SPECS[spec])
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(client, self.url + path, body, rec, t0), self.hang_s)
        except TimeoutError:
            rec.timed_out = True
        except Exception as e:  # transport errors, bad JSON, anything else: the stream broke without a word
            rec.cut = f"{type(e).__name__}: {e}"
        rec.elapsed_s = time.perf_counter() - t0
        rec.outcome = judge(rec.text, self.references.get(spec), rec.error, rec.completed, rec.timed_out)
        return rec

    async def _stream(self, client: httpx.AsyncClient, url: str, body: dict, rec: Record, t0: float) -> None:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec.error = http_error_message(r.status_code, await r.aread())
                return
            async for line in r.aiter_lines():
                event = parse_data_line(line)
                if event is None:
                    continue
                rec.event_times_s.append(time.perf_counter() - t0)
                if event.done:
                    rec.completed = True
                    return
                if event.error:
                    rec.error = event.error
                    return
                rec.pdd = event.pdd or rec.pdd
                if event.text:
                    rec.text += event.text
                    rec.text_events += 1
                    self.streaming += rec.text_events == STREAMING_EVENTS


# -- the faults ---------------------------------------------------------------------------


class Chaos:
    """The cluster and the operator's hands on it (all from the main thread)."""

    def __init__(self, cluster, loss_pct: float) -> None:
        self.cluster, self.loss_pct = cluster, loss_pct
        self.references: dict[int, str] = {}  # spec index -> its text with no fault
        self.slow: socket.socket | None = None
        self.killed: list[str] = []

    def instance(self, role: str) -> str:
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

    def kill(self, role: str) -> None:
        name = self.instance(role)
        self.cluster.kill(name)
        self.killed.append(name)

    def restart(self, role: str) -> None:
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
        lambda c: c.kill("rld"),
        lambda c: c.restart("rld"),
        KILL_HOLD_S,
    ),
    "kill-md": Fault(
        f"main-decode SIGKILLed, restarted {KILL_HOLD_S:g} s later",
        lambda c: c.kill("md"),
        lambda c: c.restart("md"),
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
    row["records"] = [_record_json(r) for r in records]
    return row


def _record_json(r: Record) -> dict[str, Any]:
    out = asdict(r)
    out["worst_gap_s"] = max_gap(r.event_times_s)
    out.pop("event_times_s")
    pdd = out.pop("pdd")
    keys = ("pipeline", "handoff", "instances", "tokens_by_role", "migrations", "resends")
    out["pdd"] = {k: pdd[k] for k in keys if k in pdd}
    if r.outcome == EXACT:  # the reference is in the JSON's header
        out.pop("text")
    return out


def hang_bound(reference_s: list[float], floor_s: float) -> float:
    """How long a request may take before it counts as hung: `floor_s`, or three times the
    slowest reference where the host is slower than that (a shared 2-core machine can be)."""
    return max(floor_s, 3 * max(reference_s, default=0.0))


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
