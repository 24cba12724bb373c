"""Replay a workload open-loop against a running cluster and record what a client sees.

Each request is sent at its arrival time (a later turn of a session also waits for the turn
before it, whose actual answer it carries). Streams are read with client-side timestamps per
SSE chunk; the `pdd` object (on the last text chunk, PDD only) and the usage (a last chunk of its
own, with no choices) are kept. One record per request (the schema of `requests.jsonl`, see
benchmarks/summary.py). A request is ok when its stream ends (`[DONE]`, or a finish reason) with
no error, so any OpenAI-compatible server can be replayed (`Target`: its URL, API key, model,
`ignore_eos` and a cap on requests in flight, as `vllm bench serve` takes them).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.workloads import BenchRequest, Workload, fill_answers


@dataclass(frozen=True)
class Target:
    """Where and how to send: a server's base URL and what each request carries."""

    base_url: str
    api_key: str | None = None
    model: str | None = None  # None: the server's default (PDD serves one model)
    ignore_eos: bool = False
    max_concurrency: int | None = None  # None: open loop, no cap
    logprobs: int = 0  # alternatives per token to ask for and record (0: none asked)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def extra(self) -> dict[str, Any]:
        """Body fields every request gets."""
        return {
            **({"model": self.model} if self.model else {}),
            **({"ignore_eos": True} if self.ignore_eos else {}),
            **({"logprobs": self.logprobs} if self.logprobs else {}),  # each endpoint's spelling: _body
        }


def as_target(target: Target | str) -> Target:
    return target if isinstance(target, Target) else Target(target)


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


NO_OUTPUT = "the stream carried no output token"


def _body(req: BenchRequest, answers: dict[str, str], extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    common = {"max_tokens": req.max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    common |= extra
    top = common.pop("logprobs", 0)
    if req.messages is not None:
        # one call per turn, as an agent loop runs its tools
        tools = {"tools": req.tools, "tool_choice": req.tool_choice, "parallel_tool_calls": False} if req.tools else {}
        common |= {"logprobs": True, "top_logprobs": top} if top else {}
        return "/v1/chat/completions", {**common, **tools, "messages": fill_answers(req.messages, answers)}
    return "/v1/completions", {**common, **({"logprobs": top} if top else {}), "prompt": req.prompt_ids}


async def _send(client: httpx.AsyncClient, url: str, body: dict, t0: float, rec: dict[str, Any]) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            return
        async for line in r.aiter_lines():
            if line.strip() == "data: [DONE]":
                rec["ok"] = True
                continue
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                rec["error"] = event["error"].get("message", "error")
                return
            choices = event.get("choices") or []  # the usage chunk, last, has none
            piece = (choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or "") if choices else ""
            calls = _tool_calls(rec, choices[0].get("delta") or {}) if choices else False
            if piece or calls:
                rec["token_times_s"].append(time.perf_counter() - t0)
                rec["text"] += piece
            if choices and choices[0].get("logprobs"):
                rec.setdefault("logprobs", []).extend(token_logprobs(choices[0]["logprobs"]))
            if choices and choices[0].get("finish_reason") == "tool_calls":
                rec["tool_call_done_s"] = time.perf_counter() - t0
            if event.get("usage"):
                rec["usage"] = event["usage"]
            if choices and choices[0].get("finish_reason"):
                rec["ok"] = True
            if "pdd" in event:
                rec["pdd"] = event["pdd"]
                rec["ok"] = True


def token_logprobs(logprobs: dict[str, Any]) -> list[list[list]]:
    """A chunk's logprobs in one shape for both endpoints: per token, [[token, logprob], ...]
    with the chosen token first, then the alternatives best first (chat: `content`; completions:
    `tokens`, `token_logprobs`, `top_logprobs`)."""
    if "content" in logprobs:
        return [
            [[t["token"], t["logprob"]]] + [[a["token"], a["logprob"]] for a in t.get("top_logprobs") or []]
            for t in logprobs["content"] or []
        ]
    tops = logprobs.get("top_logprobs") or [{}] * len(logprobs.get("tokens") or [])
    return [
        [[tok, lp]] + sorted(([a, b] for a, b in (top or {}).items()), key=lambda x: -x[1])
        for tok, lp, top in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], tops, strict=False)
    ]


def _tool_calls(rec: dict[str, Any], delta: dict[str, Any]) -> bool:
    """Put a delta's tool-call fragments together into `rec["tool_calls"]`; whether it had any."""
    for d in delta.get("tool_calls") or []:
        calls = rec.setdefault("tool_calls", [])
        while len(calls) <= d.get("index", 0):
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call, fn = calls[d.get("index", 0)], d.get("function") or {}
        call["id"] = d.get("id") or call["id"]
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return bool(delta.get("tool_calls"))


async def _one(client, target: Target, req: BenchRequest, mode: str, t0: float, state: dict) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
    if req.depends_on:
        await state["done"][req.depends_on].wait()
    async with state["slots"]:
        return await _sent(client, target, req, mode, t0, state)


async def _sent(client, target: Target, req: BenchRequest, mode: str, t0: float, state: dict) -> dict[str, Any]:
    path, body = _body(req, state["answers"], target.extra())
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
        await _send(client, target.base_url + path, body, t0, rec)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    if rec["ok"] and not rec["token_times_s"]:  # a server whose streams end empty is broken, not fast
        rec["error"] = NO_OUTPUT
    rec["ok"] = rec["ok"] and not rec["error"]
    usage = rec.pop("usage", {})
    rec["output_tokens"] = usage.get("completion_tokens", len(rec["token_times_s"]))
    rec["prompt_tokens"] = usage.get("prompt_tokens", 0)
    calls = rec.get("tool_calls")
    state["answers"][req.request_id] = (
        {"role": "assistant", "content": rec["text"] or None, "tool_calls": calls} if calls else rec["text"]
    )
    state["done"][req.request_id].set()
    state["progress"].tick(rec["ok"])
    return rec


async def replay(target: Target | str, workload: Workload, mode: str) -> tuple[list[dict[str, Any]], float]:
    """Run every request of the workload; returns the records and the run's duration in seconds.

    With `target.max_concurrency`, a request that arrives while that many are in flight waits
    for one to end; its latencies count from when it is sent (`sent_s`), as vLLM's do."""
    target = as_target(target)
    cap = target.max_concurrency or len(workload.requests) or 1
    state = {
        "answers": {},
        "done": {r.request_id: asyncio.Event() for r in workload.requests},
        "progress": Progress(mode, len(workload.requests)),
        "slots": asyncio.Semaphore(cap),
    }
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=target.headers())
    async with client:
        t0 = time.perf_counter()
        records = await asyncio.gather(*(_one(client, target, r, mode, t0, state) for r in workload.requests))
        duration = time.perf_counter() - t0
    return list(records), duration


async def warm_up(target: Target | str, n: int = 2, ready_s: float = 120.0) -> None:
    """A couple of short requests so the first measured one does not pay one-time costs. A 503
    (a server still starting: `pdd up` answers before its instances register) is asked again
    until `ready_s`; an answer with no text is reported, since every measured request would fail."""
    target = as_target(target)
    deadline = time.monotonic() + ready_s
    async with httpx.AsyncClient(timeout=120.0, headers=target.headers()) as client:
        for i in range(n):
            body = {"prompt": f"Warm-up {i}: hello", "max_tokens": 4, "temperature": 0, **target.extra()}
            r = await client.post(target.base_url + "/v1/completions", json=body)
            while r.status_code == 503 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                r = await client.post(target.base_url + "/v1/completions", json=body)
            if r.status_code != 200 or not _warm_text(r):
                answer = f"HTTP {r.status_code} {r.text[:200]!r}"
                sys.stderr.write(f"pdd bench: warm-up got {answer}: is the server whole?\n")


def _warm_text(r: httpx.Response) -> str:
    try:
        return r.json()["choices"][0]["text"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        return ""


async def served_model(target: Target) -> str | None:
    """The first model a server lists at /v1/models (what `vllm bench serve` asks for by default)."""
    try:
        async with httpx.AsyncClient(timeout=10.0, headers=target.headers()) as client:
            r = await client.get(target.base_url + "/v1/models")
            return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
