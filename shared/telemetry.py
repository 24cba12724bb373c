"""Prometheus metrics from every process, with `prometheus-client`.

Names follow vLLM's under the `pdd:` prefix, so existing dashboards and alerts carry over, and
every series has `model_name` and `instance` labels. Each process owns one `Metrics` (its own
registry) and serves it on its configured `metrics_port` (the gateway on its API port, at
`/metrics`). Figures that live in the engine (requests running and waiting, KV usage, prefix
cache counts) are read when Prometheus scrapes, from the engine's last step-boundary snapshot,
so a scrape never waits for a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    1e-6,
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)  # 1 us: an observation of (almost) 0 shows up alone
BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB


class Metrics:
    """One process's registry; every metric it makes carries `model_name` and `instance`."""

    def __init__(self, model_name: str, instance: str) -> None:
        self.registry = CollectorRegistry()
        self.constant = {"model_name": model_name, "instance": instance}

    def _labels(self, labels: tuple[str, ...]) -> list[str]:
        return ["model_name", "instance", *labels]

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return _Bound(Counter(name, doc, self._labels(labels), registry=self.registry), self.constant)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return _Bound(Gauge(name, doc, self._labels(labels), registry=self.registry), self.constant)

    def histogram(self, name: str, doc: str, buckets=LATENCY_BUCKETS, labels: tuple[str, ...] = ()) -> Any:
        return _Bound(
            Histogram(name, doc, self._labels(labels), buckets=buckets, registry=self.registry), self.constant
        )

    def engine_figures(self, figures: Callable[[], Any]) -> None:
        """Serve an engine's figures (EngineWorker.figures) as vLLM's gauges and counters."""
        self.registry.register(_EngineCollector(figures, self.constant))

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on a thread (prometheus-client's own server)."""
        if port:
            start_http_server(port, addr=host, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Bound:
    """A metric with the process's constant labels already applied: `.labels(pipeline=...)` or
    `.inc()` / `.set()` / `.observe()` directly."""

    def __init__(self, metric: Any, constant: dict[str, str]) -> None:
        self._metric, self._constant = metric, constant
        self._plain = None if metric._labelnames[2:] else metric.labels(**constant)

    def labels(self, **labels: str) -> Any:
        return self._metric.labels(**self._constant, **labels)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plain, name)


class _EngineCollector(Collector):
    def __init__(self, figures: Callable[[], Any], constant: dict[str, str]) -> None:
        self.figures, self.constant = figures, constant

    def collect(self) -> Iterator[Any]:
        f = self.figures()
        keys, values = list(self.constant), list(self.constant.values())
        total = f.total_blocks or 1
        used = total - f.free_blocks - f.cached_blocks
        for name, doc, value in (
            ("pdd:num_requests_running", "Requests in the engine's running batch", f.running),
            ("pdd:num_requests_waiting", "Requests queued in the engine", f.waiting),
            ("pdd:kv_cache_usage_perc", "KV blocks held by requests (1 = full; cached blocks are free)", used / total),
            ("pdd:kv_cache_blocks_cached", "KV blocks held only by the prefix cache", f.cached_blocks),
            ("pdd:kv_cache_blocks_free", "KV blocks free", f.free_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=keys)
            g.add_metric(values, float(value))
            yield g
        for name, doc, key in (
            ("pdd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_queried"),
            ("pdd:prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_hit"),
            ("pdd:lent_core_steps", "Engine steps run on the idle cores of the host's other instances", "lent_steps"),
            ("pdd:yielded_to_prompts_seconds", "Time a decoder waited for prompts computed on its host", "yielded_s"),
        ):
            c = CounterMetricFamily(name, doc, labels=keys)
            c.add_metric(values, float(getattr(f, key)))
            yield c
