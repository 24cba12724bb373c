"""The chaos bench's load (benchmarks/chaos.py): the requests it sends, each the same body every
time so one reference fits all, and the client that streams them on a thread of its own."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.chaos_judge import CUT, FAILED, HUNG, Record, http_error_message, judge, parse_data_line
from shared.pipelines import Pipeline

STREAMING_EVENTS = 3  # text events a stream has had before it counts as mid-stream


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
    Spec("completion", Pipeline.P_MD, "Once upon a time in a quiet village,", 80),
    Spec("chat", Pipeline.P_RLD_MD, _CONTEXT * 6 + "Summarise what the town depended on.", 100),
    Spec("completion", Pipeline.P_RLD, "The three most important ideas in computer networking are", 60),
    Spec("chat", None, "Explain in a few sentences how a steam engine works.", 120),
    Spec("chat", Pipeline.P_MD, _CONTEXT * 4 + "Write the keeper's diary entry for a stormy night.", 90),
    Spec("completion", Pipeline.P_RLD_MD, "A recipe for a simple tomato soup: first,", 70),
    Spec("chat", Pipeline.P_RLD, "List some reasons why people keep houseplants.", 100),
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
