"""Replay a workload open-loop against a running cluster and record what a client sees.

Each request is sent at its arrival time (a later turn of a session also waits for the turn
before it, whose actual answer it carries). Streams are read with client-side timestamps per
SSE chunk; the `pdd` object (on the last text chunk) and the usage (a last chunk of its own, with
no choices) are kept. One record per request (the schema of
`requests.jsonl`, see benchmarks/summary.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx

from benchmarks.workloads import BenchRequest, Workload, fill_answers


class Progress:
    """A one-line progress bar on stderr: requests done per mode."""

    def __init__(self, mode: str, total: int) -> None:
        self.mode, self.total, self.done, self.failed = mode, total, 0, 0
        self.t0 = time.perf_counter()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r  {self.mode:<12} [{bar}] {self.done}/{self.total} ({self.failed} failed, {elapsed:.0f}s)")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _body(req: BenchRequest, answers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    common = {"max_tokens": req.max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if req.messages is not None:
        return "/v1/chat/completions", {**common, "messages": fill_answers(req.messages, answers)}
    return "/v1/completions", {**common, "prompt": req.prompt_ids}


async def _send(client: httpx.AsyncClient, url: str, body: dict, t0: float, rec: dict[str, Any]) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                rec["error"] = event["error"].get("message", "error")
                return
            choices = event.get("choices") or []  # the usage chunk, last, has none
            piece = (choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or "") if choices else ""
            if piece:
                rec["token_times_s"].append(time.perf_counter() - t0)
                rec["text"] += piece
            if event.get("usage"):
                rec["usage"] = event["usage"]
            if "pdd" in event:
                rec["pdd"] = event["pdd"]
                rec["ok"] = True


async def _one(client, base_url: str, req: BenchRequest, mode: str, t0: float, state: dict) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
    if req.depends_on:
        await state["done"][req.depends_on].wait()
    path, body = _body(req, state["answers"])
    rec: dict[str, Any] = {
        "request_id": req.request_id,
        "mode": mode,
        "kind": req.kind,
        "session": req.session,
        "turn": req.turn,
        "arrival_s": req.arrival_s,
        "sent_s": time.perf_counter() - t0,
        "token_times_s": [],
        "text": "",
        "ok": False,
        "error": "",
        "pdd": {},
    }
    try:
        await _send(client, base_url + path, body, t0, rec)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    usage = rec.pop("usage", {})
    rec["output_tokens"] = usage.get("completion_tokens", len(rec["token_times_s"]))
    rec["prompt_tokens"] = usage.get("prompt_tokens", 0)
    state["answers"][req.request_id] = rec["text"]
    state["done"][req.request_id].set()
    state["progress"].tick(rec["ok"])
    return rec


async def replay(base_url: str, workload: Workload, mode: str) -> tuple[list[dict[str, Any]], float]:
    """Run every request of the workload; returns the records and the run's duration in seconds."""
    state = {
        "answers": {},
        "done": {r.request_id: asyncio.Event() for r in workload.requests},
        "progress": Progress(mode, len(workload.requests)),
    }
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        records = await asyncio.gather(*(_one(client, base_url, r, mode, t0, state) for r in workload.requests))
        duration = time.perf_counter() - t0
    return list(records), duration


async def warm_up(base_url: str, n: int = 2) -> None:
    """A couple of short requests so the first measured one does not pay one-time costs."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        for i in range(n):
            body = {"prompt": f"Warm-up {i}: hello", "max_tokens": 4, "temperature": 0}
            await client.post(base_url + "/v1/completions", json=body)
