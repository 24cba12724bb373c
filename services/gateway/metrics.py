"""The gateway's Prometheus metrics (names as vLLM/SGLang spell theirs, with a `pdd:` prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.prometheus import LATENCY_BUCKETS, Counter, Gauge, Histogram, Registry

if TYPE_CHECKING:
    from services.gateway.flow import RequestFlow

BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = Counter("pdd:requests_total", "Requests by outcome", ("outcome", "status"), registry=r)
        self.inflight = Gauge("pdd:requests_in_flight", "Requests admitted and not finished", registry=r)
        self.ttft = Histogram("pdd:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS,
                              ("pipeline",), registry=r)  # fmt: skip
        self.itl = Histogram("pdd:inter_token_latency_seconds", "Gap between streamed tokens", LATENCY_BUCKETS,
                             ("pipeline",), registry=r)  # fmt: skip
        self.e2e = Histogram("pdd:e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS,
                             ("pipeline",), registry=r)  # fmt: skip
        self.tokens = Counter("pdd:generation_tokens_total", "Generated tokens by decoder role", ("role",),
                              registry=r)  # fmt: skip
        self.wan_bytes = Counter("pdd:wan_kv_bytes_total", "KV bytes sent over the WAN", registry=r)
        self.local_bytes = Counter("pdd:local_kv_bytes_total", "KV bytes sent within a datacenter", registry=r)
        self.pipelines = Counter("pdd:pipeline_requests_total", "Requests by pipeline and plan reason",
                                 ("pipeline", "reason"), registry=r)  # fmt: skip
        self.prefix_hit = Counter("pdd:prefix_hit_tokens_total", "Prompt tokens found in a prefix cache", ("role",),
                                  registry=r)  # fmt: skip
        self.prompt_tokens = Counter("pdd:prompt_tokens_total", "Prompt tokens received", registry=r)
        self.hit_rate = Gauge("pdd:prefix_hit_rate", "Share of prompt tokens found in a prefix cache, since start",
                              ("role",), registry=r)  # fmt: skip
        self.hit_gap = Gauge("pdd:prefix_hit_rate_gap", "Prefill's prefix hit rate minus main-decode's (alignment)",
                             registry=r)  # fmt: skip
        self._hits = {"prefill": 0, "md": 0}
        self._prompt_total = 0

    def count_request(self, outcome: str, status: int) -> None:
        self.requests.labels(outcome=outcome, status=str(status)).inc()

    def observe(self, flow: RequestFlow) -> None:
        """Record a request that was admitted, when it ends (finished, failed or aborted)."""
        plan = flow.plan
        outcome = "finished" if flow.finished else "aborted"
        self.count_request(outcome, 200)
        if plan is None or not plan.pipeline:
            return
        p = plan.pipeline
        self.pipelines.labels(pipeline=p, reason=plan.reason or "default").inc()
        s = flow.stats
        if s.first_token_at:
            self.ttft.labels(pipeline=p).observe(s.first_token_at - s.arrived)
            self.e2e.labels(pipeline=p).observe(s.token_times[-1] - s.arrived)
        for a, b in zip(s.token_times, s.token_times[1:]):
            self.itl.labels(pipeline=p).observe(b - a)
        for role, n in s.tokens_by_role.items():
            self.tokens.labels(role=role).inc(n)
        d = s.decoder_stats
        self.wan_bytes.inc(d.wan_kv_bytes)
        self.local_bytes.inc(d.local_kv_bytes)
        self._count_hits({"prefill": d.prefill_hit_tokens, "md": d.md_hit_tokens}, len(flow.parsed.prompt_ids))

    def _count_hits(self, hits: dict[str, int], prompt_len: int) -> None:
        self.prompt_tokens.inc(prompt_len)
        self._prompt_total += prompt_len
        for role in self._hits:
            n = int(hits.get(role, 0))
            self.prefix_hit.labels(role=role).inc(n)
            self._hits[role] += n
            self.hit_rate.labels(role=role).set(self._hits[role] / self._prompt_total)
        self.hit_gap.set((self._hits["prefill"] - self._hits["md"]) / self._prompt_total)

    def render(self) -> str:
        return self.registry.render()
