"""The gateway's Prometheus metrics: vLLM's names under `pdd:`, plus PDD's own.

Observed once per request, when it ends (`observe`), whatever the way it ended; requests turned
away before admission are counted by `reject`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.telemetry import BYTES_BUCKETS, Metrics

if TYPE_CHECKING:
    from services.gateway.flow import RequestFlow


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        m = self.metrics = Metrics(model_name, "gateway")
        self.running = m.gauge("pdd:num_requests_running", "Requests admitted at the gateway and not finished")
        self.success = m.counter(
            "pdd:request_success", "Requests that finished, by finish reason", ("finished_reason",)
        )
        self.outcomes = m.counter("pdd:requests", "Requests by outcome and HTTP status", ("outcome", "status"))
        self.rejected = m.counter("pdd:rejected_requests", "Requests answered 429, by reason", ("reason",))
        self.prompt_tokens = m.counter("pdd:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = m.counter("pdd:generation_tokens", "Generated tokens, by decoder role", ("role",))
        self.ttft = m.histogram("pdd:time_to_first_token_seconds", "Time to first token", labels=("pipeline",))
        self.itl = m.histogram("pdd:inter_token_latency_seconds", "Gap between streamed tokens", labels=("pipeline",))
        self.e2e = m.histogram("pdd:e2e_request_latency_seconds", "Arrival to last token", labels=("pipeline",))
        self.queue = m.histogram("pdd:request_queue_time_seconds", "Arrival to the plan (scheduler's queue)")
        self.prefill = m.histogram("pdd:request_prefill_time_seconds", "Prefill accepted the task -> first token")
        self.plans = m.counter(
            "pdd:requests_by_pipeline", "Requests by pipeline and plan reason", ("pipeline", "reason")
        )
        self.kv_bytes = m.histogram(
            "pdd:request_kv_transfer_bytes", "KV bytes moved for a request, by path", BYTES_BUCKETS, labels=("path",)
        )
        self.handoffs = m.counter("pdd:handoffs", "Relay -> main-decode handoffs, by mode", ("mode",))
        self.handoff_gap = m.histogram(
            "pdd:handoff_gap_seconds", "Last relay token -> first main-decode token", labels=("mode",)
        )
        self.migrations = m.counter("pdd:migrations", "Requests moved after an instance they used failed")

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def count_request(self, outcome: str, status: int) -> None:
        self.outcomes.labels(outcome=outcome, status=str(status)).inc()

    def observe(self, flow: RequestFlow) -> None:
        """Record an admitted request when it ends (finished, failed or abandoned)."""
        s, plan = flow.stats, flow.plan
        self.count_request(flow.outcome, 200 if flow.outcome != "error" else 500)
        if flow.finish_reason is not None:
            self.success.labels(finished_reason=flow.finish_reason).inc()
        self.prompt_tokens.inc(len(flow.parsed.prompt_ids))
        for role, n in s.tokens_by_role.items():
            self.generation_tokens.labels(role=role).inc(n)
        self.migrations.inc(s.migrations)
        if plan is None or not plan.pipeline:
            return
        p = plan.pipeline
        self.plans.labels(pipeline=p, reason=plan.reason or "default").inc()
        self.queue.observe(plan.queue_ms / 1000)
        d = s.decoder_stats
        if d.prefill_ms:
            self.prefill.observe(d.prefill_ms / 1000)
        for path, nbytes in (("wan", d.wan_kv_bytes), ("in_dc", d.local_kv_bytes)):
            if nbytes:
                self.kv_bytes.labels(path=path).observe(nbytes)
        if s.first_token_at:
            self.ttft.labels(pipeline=p).observe(s.first_token_at - s.arrived)
            self.e2e.labels(pipeline=p).observe(s.last_token_at - s.arrived)
        for gap in s.token_gaps:
            self.itl.labels(pipeline=p).observe(gap)
        if d.handoff_chunks:
            self.handoffs.labels(mode=plan.handoff).inc()
            self.handoff_gap.labels(mode=plan.handoff).observe(s.handoff_gap_s)

    def render(self) -> bytes:
        return self.metrics.render()
