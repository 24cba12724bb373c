"""The gateway's and the engines' Prometheus metrics, read back with prometheus-client's own
parser: vLLM's names under `pdd:`, `model_name` and `instance` on every series, and each
request counted once, the way it ended."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.auth import OPEN
from services.gateway.flow import RequestFlow
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import ParsedRequest
from shared.messages import Plan, RequestStats, Sampling
from shared.telemetry import Metrics


def samples(text: bytes) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            assert s.labels.get("model_name") == "smol" and s.labels.get("instance"), s
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "instance")))] = (
                s.value
            )
    return out


def value(text: bytes, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def flow(reason: str | None, chunks: list[tuple[float, int, str]], error: str = "") -> RequestFlow:
    """A request that got `chunks` of (seconds after arrival, tokens, role) and ended with `reason`."""
    gw = SimpleNamespace()
    f = RequestFlow(gw, ParsedRequest("completion", "smol", [1, 2, 3], Sampling()), OPEN, "r")
    f.plan = Plan("r", pipeline="p-rld-md", handoff="catchup", reason="slo-miss-relay", queue_ms=5.0)
    t0 = f.stats.arrived
    for at, n, role in chunks:
        f._record_tokens(n, role, now=t0 + at)
    f.stats.decoder_stats = RequestStats(prefill_ms=120.0, wan_kv_bytes=5000, local_kv_bytes=7000, handoff_chunks=2)
    f.finish_reason, f.error, f.finished = reason, error, reason is not None
    return f


def test_a_request_ending_on_a_stop_string_counts_as_finished_with_stop():
    m = GatewayMetrics("smol")
    m.observe(flow("stop", [(0.2, 1, "rld"), (0.3, 1, "rld")]))
    text = m.render()
    assert value(text, "pdd:request_success_total", finished_reason="stop") == 1
    assert value(text, "pdd:requests_total", outcome="finished", status="200") == 1
    assert value(text, "pdd:requests_total", outcome="aborted", status="200") == 0


def test_a_failed_request_is_counted_once_as_an_error():
    m = GatewayMetrics("smol")
    m.observe(flow(None, [(0.2, 1, "rld")], error="prefill failed"))
    text = m.render()
    assert value(text, "pdd:requests_total", outcome="error", status="500") == 1
    assert sum(v for (name, _), v in samples(text).items() if name == "pdd:requests_total") == 1
    assert sum(v for (name, _), v in samples(text).items() if name == "pdd:request_success_total") == 0


def test_tokens_arriving_together_share_their_chunks_gap_never_zero():
    m = GatewayMetrics("smol")
    m.observe(flow("length", [(0.2, 1, "rld"), (0.3, 1, "rld"), (0.7, 4, "md")]))  # 4 tokens at once after 0.4 s
    text = m.render()
    labels = {"pipeline": "p-rld-md"}
    assert value(text, "pdd:inter_token_latency_seconds_count", **labels) == 5
    assert abs(value(text, "pdd:inter_token_latency_seconds_sum", **labels) - (0.1 + 4 * 0.1)) < 1e-9
    assert value(text, "pdd:inter_token_latency_seconds_bucket", le="0.005", **labels) == 0  # no zero gaps
    assert abs(value(text, "pdd:time_to_first_token_seconds_sum", **labels) - 0.2) < 1e-9
    assert value(text, "pdd:generation_tokens_total", role="md") == 4
    assert value(text, "pdd:handoffs_total", mode="catchup") == 1
    assert value(text, "pdd:request_kv_transfer_bytes_sum", path="wan") == 5000


def test_rejections_by_reason():
    m = GatewayMetrics("smol")
    m.reject("concurrency_limit")
    m.reject("concurrency_limit")
    assert value(m.render(), "pdd:rejected_requests_total", reason="concurrency_limit") == 2


def test_an_engines_figures_are_read_at_scrape_time():
    figures = SimpleNamespace(  # an EngineFigures' attributes (the gateway's tests load no torch)
        running=3, waiting=1, free_blocks=50, cached_blocks=30, total_blocks=100, prefix_queried=1000, prefix_hit=900,
        lent_steps=12, yielded_s=1.5,
    )  # fmt: skip
    m = Metrics("smol", "md-0")
    m.engine_figures(lambda: figures)
    text = m.render()
    assert value(text, "pdd:num_requests_running") == 3 and value(text, "pdd:num_requests_waiting") == 1
    assert value(text, "pdd:kv_cache_usage_perc") == 0.2  # 20 of 100 blocks held by requests
    assert value(text, "pdd:prefix_cache_queries_total") == 1000 and value(text, "pdd:prefix_cache_hits_total") == 900
    assert value(text, "pdd:lent_core_steps_total") == 12  # steps on the idle neighbours' cores (shared/cores.py)
    assert value(text, "pdd:yielded_to_prompts_seconds_total") == 1.5  # a decoder's waits for the host's prompts
    figures.running = 0
    assert value(m.render(), "pdd:num_requests_running") == 0
