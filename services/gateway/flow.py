"""One request's life in the gateway, from submit to the last text delta.

1. Subscribe to `pdd.tokens.<id>` first, so no token can be missed, then submit to the
   scheduler (request-reply with a timeout). An error plan becomes an HTTP error.
2. Token chunks arrive from whichever decoder holds the request (relay, then main); they are
   put in index order and de-duplicated, detokenized incrementally, and cut at stop strings.
3. The stream ends when the final chunk and every token before it have arrived; the last
   delta carries finish_reason and the `pdd` object.
4. `close()` always runs: it unsubscribes, deletes the request state in Redis, and — if the
   request did not finish (client gone, error, stop string hit early) — broadcasts an abort so
   every stage frees what it holds. Cleanup is shielded from the caller's cancellation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.gateway.detokenize import IncrementalDetokenizer, StopChecker
from services.gateway.openai_api import APIError, ParsedRequest
from services.gateway.reassembly import TokenReassembler
from shared import subjects
from shared.bus import BusTimeout
from shared.messages import Abort, Plan, Submit, TokenChunk


class StreamError(Exception):
    """The request failed after it was admitted (a stage reported an error, or a timeout)."""


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    pdd: dict[str, Any] | None = None


@dataclass
class FlowStats:
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens_by_role: dict[str, int] = field(default_factory=lambda: {"rld": 0, "md": 0})
    decoder_stats: dict[str, Any] = field(default_factory=dict)
    completion_tokens: int = 0
    last_rld_at: float = 0.0
    handoff_gap_s: float = 0.0  # last relay token -> first main-decode token, as the user saw it


class RequestFlow:
    def __init__(self, gateway, parsed: ParsedRequest) -> None:
        self.gw = gateway
        self.parsed = parsed
        self.request_id = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.plan: Plan | None = None
        self.stats = FlowStats()
        self.finished = False
        self._queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.gw.bus.nc.subscribe(subjects.tokens(self.request_id), cb=self._on_msg)
        submit = Submit(self.request_id, self.parsed.prompt_ids, self.parsed.sampling, self.parsed.pipeline,
                        self.parsed.handoff)  # fmt: skip
        try:
            self.plan = await self.gw.bus.request(subjects.SUBMIT, submit, Plan, self.gw.cfg.timeouts.control_s * 3)
        except BusTimeout as e:
            raise APIError(503, f"scheduler unavailable: {e}", type="service_unavailable") from None
        if self.plan.error:
            raise APIError(self.plan.status, self.plan.error, type="service_unavailable")

    async def _on_msg(self, msg) -> None:
        self._queue.put_nowait(TokenChunk.decode(msg.data))

    async def deltas(self) -> AsyncIterator[Delta]:
        reassembler = TokenReassembler()
        detok = IncrementalDetokenizer(self.gw.tokenizer)
        stops = StopChecker(list(self.parsed.sampling.stop))
        final: TokenChunk | None = None
        while final is None or reassembler.next_index < final.index + len(final.token_ids):
            chunk = await self._next_chunk()
            if chunk.error:
                raise StreamError(chunk.error)
            self._count(chunk)
            if chunk.finish_reason is not None:
                final = chunk
            new = reassembler.add(chunk.index, chunk.token_ids)
            if new:
                self._record_tokens(len(new))
                text, hit = stops.add(detok.add(new))
                if hit:  # the decoders may still be running: close() aborts them
                    yield Delta(text, "stop", self._pdd())
                    return
                if text:
                    yield Delta(text)
        text, hit = stops.add(detok.flush())
        self.finished = True
        yield Delta(text + stops.flush(), "stop" if hit else final.finish_reason, self._pdd())

    async def _next_chunk(self) -> TokenChunk:
        try:
            return await asyncio.wait_for(self._queue.get(), self.gw.cfg.timeouts.request_s)
        except asyncio.TimeoutError:
            raise StreamError(f"no token for {self.gw.cfg.timeouts.request_s:.0f}s") from None

    def _count(self, chunk: TokenChunk) -> None:
        s = self.stats
        if chunk.role in s.tokens_by_role:
            s.tokens_by_role[chunk.role] += len(chunk.token_ids)
        if chunk.token_ids and chunk.role == "rld":
            s.last_rld_at = time.perf_counter()
        elif chunk.token_ids and chunk.role == "md" and s.last_rld_at and not s.handoff_gap_s:
            s.handoff_gap_s = time.perf_counter() - s.last_rld_at
        if chunk.stats:
            _merge(self.stats.decoder_stats, chunk.stats)

    def _record_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if not self.stats.first_token_at:
            self.stats.first_token_at = now
        self.stats.token_times.extend([now] * n)
        self.stats.completion_tokens += n

    def _pdd(self) -> dict[str, Any]:
        return build_pdd(self.request_id, self.plan, self.stats)

    async def close(self) -> None:
        await asyncio.shield(self._cleanup())

    async def _cleanup(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if not self.finished and self.plan is not None:
            await self.gw.bus.publish(subjects.ABORT, Abort(self.request_id))
        await self.gw.forget_request(self.request_id)


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            _merge(into.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and isinstance(into.get(key), (int, float)):
            into[key] += value
        else:
            into[key] = value


def build_pdd(request_id: str, plan: Plan | None, stats: FlowStats) -> dict[str, Any]:
    """The observability contract: every field present, zero where a feature did not act."""
    plan = plan or Plan(request_id)
    d = stats.decoder_stats
    timings = d.get("timings_ms", {})
    now = time.perf_counter()
    ttft = (stats.first_token_at - stats.arrived) * 1000 if stats.first_token_at else 0.0
    times = stats.token_times
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "request_id": request_id,
        "pipeline": plan.pipeline,
        "handoff": plan.handoff,
        "plan_reason": plan.reason,
        "instances": {"prefill": plan.prefill, "rld": plan.rld, "md": plan.md},
        "tokens_by_role": dict(stats.tokens_by_role),
        "handoff_chunks": int(d.get("handoff_chunks", 0)),
        "handoff_gap_ms": stats.handoff_gap_s * 1000,
        "max_itl_ms": max(gaps) * 1000 if gaps else 0.0,
        "wan_kv_bytes": int(d.get("wan_kv_bytes", 0)),
        "local_kv_bytes": int(d.get("local_kv_bytes", 0)),
        "prefix_hit_tokens": {k: int(d.get("prefix_hit_tokens", {}).get(k, 0)) for k in ("prefill", "md")},
        "md_cached_tokens": plan.md_cached_tokens,  # what the plan counted on
        "recomputed_tokens": int(d.get("recomputed_tokens", 0)),  # planned prefix evicted meanwhile
        "timings_ms": {
            "queue": plan.queue_ms,
            "prefill": float(timings.get("prefill", 0.0)),
            "kv_local": float(timings.get("kv_local", 0.0)),
            "kv_wan": float(timings.get("kv_wan", 0.0)),
            "extend": float(timings.get("extend", 0.0)),
            "ttft": ttft,
            "e2e": (now - stats.arrived) * 1000,
        },
    }
