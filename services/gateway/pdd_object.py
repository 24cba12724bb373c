"""The `pdd` object: what the last chunk of every response reports about how it was served.

The observability contract (benchmarks and tools rely on it): every field is present, with
zero values where a feature did not act.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shared.messages import Plan, RequestStats
from shared.pipelines import Role


@dataclass
class FlowStats:
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    token_gaps: list[float] = field(default_factory=list)  # per token after the first chunk: its chunk's gap / size
    token_marks: list[tuple[float, Role]] = field(default_factory=list)  # (seconds since arrival, role) per token
    tokens_by_role: dict[Role, int] = field(default_factory=lambda: dict.fromkeys(Role, 0))
    decoder_stats: RequestStats = field(default_factory=RequestStats)  # what the stages measured
    completion_tokens: int = 0
    last_rld_at: float = 0.0
    handoff_gap_s: float = 0.0  # last relay token -> first main-decode token, as the user saw it
    last_progress: float = field(default_factory=time.perf_counter)
    migrations: int = 0  # times the request moved to another decoder after an instance died
    resends: int = 0  # chunks asked again from a decoder after a gap did not fill (lost on the bus)
    refused_chunks: int = 0  # chunks that could not be this stream's (RequestFlow._not_ours): dropped


def build_pdd(request_id: str, plan: Plan | None, stats: FlowStats) -> dict[str, Any]:
    """The observability contract: every field present, zero where a feature did not act."""
    plan = plan or Plan(request_id)
    d = stats.decoder_stats
    now = time.perf_counter()
    ttft = (stats.first_token_at - stats.arrived) * 1000 if stats.first_token_at else 0.0
    gaps = stats.token_gaps
    return {
        "request_id": request_id,
        "scheduler": plan.scheduler,  # which of the schedulers planned it
        "dispatch_id": plan.dispatch_id,  # this dispatch (a request picked up again keeps it)
        "pipeline": plan.pipeline,
        "handoff": plan.handoff,
        "plan_reason": plan.reason,
        "handoff_reason": plan.handoff_reason,
        "kv_wire": plan.kv_wire,  # how its KV crossed the WAN (native, bf16, fp8, int8)
        "kv_wire_reason": plan.kv_wire_reason,
        "plan_estimates": plan.estimates.as_dict(),
        "instances": plan.instances(),
        "tokens_by_role": dict(stats.tokens_by_role),
        "handoff_chunks": d.handoff_chunks,
        "handoff_gap_ms": stats.handoff_gap_s * 1000,
        "max_itl_ms": max(gaps) * 1000 if gaps else 0.0,
        "wan_kv_bytes": d.wan_kv_bytes,
        "local_kv_bytes": d.local_kv_bytes,
        "streamed_kv_tokens": d.streamed_kv_tokens,  # prompt KV pushed while prefill still ran (`stream_kv`)
        "prefix_hit_tokens": {Role.PREFILL: d.prefill_hit_tokens, Role.MD: d.md_hit_tokens},
        "md_cached_tokens": plan.md_cached_tokens,  # what the plan counted on
        "md_computes_suffix": plan.md_computes_suffix,  # prompt tokens main-decode computed, none of their KV crossing
        "md_suffix_reason": plan.md_suffix_reason,
        "recomputed_tokens": d.recomputed_tokens,  # planned prefix evicted meanwhile
        "migrations": stats.migrations,
        "resends": stats.resends,
        "timings_ms": {
            "queue": plan.queue_ms,
            "prefill": d.prefill_ms,
            "kv_local": d.kv_local_ms,
            "kv_wan": d.kv_wan_ms,
            "extend": d.extend_ms,
            "ttft": ttft,
            "e2e": (now - stats.arrived) * 1000,
        },
    }
