"""The Grafana dashboard (docs/grafana/pdd.json) queries only metrics PDD exposes.

The metric families come from the real code, without a cluster: the gateway's `GatewayMetrics`,
the scheduler's and each instance's service objects as their constructors build them (prefill,
relay and main-decode, each with its engine figures registered as `InstanceService.start` does),
rendered in Prometheus' text format and parsed back. A series name a query uses (`_bucket`,
`_total`... included) must be one some process serves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics
from services.md.service import MainDecoder
from services.prefill.service import Prefiller
from services.rld.service import RelayDecoder
from services.scheduler.service import Scheduler
from shared.config import DEFAULT_CONFIG, load_config
from shared.runtime.engine import EngineFigures

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "pdd.json"
METRIC = re.compile(r"\bpdd:[a-zA-Z_][a-zA-Z0-9_:]*")
SERIES = {  # the series names a family of each type is scraped as
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "unknown": ("",),
}
# What the dashboard is for: each of these must be queried.
REQUIRED = {
    "pdd:time_to_first_token_seconds_bucket",
    "pdd:inter_token_latency_seconds_bucket",
    "pdd:requests_by_pipeline_total",
    "pdd:kv_transfer_bytes_total",
    "pdd:request_kv_transfer_bytes_bucket",
    "pdd:wan_bandwidth_estimate_mbps",
    "pdd:kv_cache_usage_perc",
    "pdd:handoff_gap_seconds_bucket",
}


def rendered_metrics() -> dict[str, bytes]:
    """Every process's /metrics body, by process, from the objects the services build."""
    cfg = load_config(DEFAULT_CONFIG)
    out = {"gateway": GatewayMetrics("model").render(), "scheduler": Scheduler(cfg).metrics.render()}
    for inst in cfg.instances:
        service = {"prefill": Prefiller, "rld": RelayDecoder, "md": MainDecoder}[inst.role](cfg, inst)
        service.metrics.engine_figures(EngineFigures)  # as InstanceService.start registers the engine's figures
        out[inst.id] = service.metrics.render()
    return out


def exposed_series(bodies: dict[str, bytes]) -> set[str]:
    names: set[str] = set()
    for body in bodies.values():
        for family in text_string_to_metric_families(body.decode()):
            names |= {family.name + suffix for suffix in SERIES.get(family.type, ("",))}
            names |= {sample.name for sample in family.samples}
    return names


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every templating query."""
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out += [(f"panel {inner['title']!r}", t["expr"]) for t in inner.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else var.get("definition", "")
        if var["type"] == "query":
            out.append((f"variable {var['name']!r}", text))
    return out


def missing_metrics(dashboard: dict[str, Any], exposed: set[str]) -> list[str]:
    return [f"{where}: {name}" for where, q in queries(dashboard) for name in METRIC.findall(q) if name not in exposed]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exposed() -> set[str]:
    return exposed_series(rendered_metrics())


def test_every_metric_the_dashboard_queries_is_exposed(dashboard, exposed) -> None:
    assert missing_metrics(dashboard, exposed) == []
    queried = {name for _, q in queries(dashboard) for name in METRIC.findall(q)}
    assert REQUIRED <= queried, REQUIRED - queried


def test_the_check_catches_a_name_nobody_exposes(dashboard, exposed) -> None:
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["targets"][0]["expr"] = "rate(pdd:time_to_first_token_secs_bucket[5m])"
    assert missing_metrics(broken, exposed) == ["panel 'Time to first token': pdd:time_to_first_token_secs_bucket"]
    assert "pdd:kv_cache_usage_perc" in exposed and "pdd:kv_cache_usage_perc_total" not in exposed
    assert {"pdd:plans_total", "pdd:kv_transfer_seconds_bucket", "pdd:prefix_cache_hits_total"} <= exposed


def test_the_dashboard_is_well_formed(dashboard) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"DS_PROMETHEUS", "model_name"}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and refs, panel["title"]
    for where, q in queries(dashboard):
        assert q.count("(") == q.count(")"), where
        if "histogram_quantile" in q:  # over buckets, keeping `le`
            assert "_bucket" in q and re.search(r"by \([^)]*\ble\b", q), (where, q)
        if where.startswith("panel"):
            assert '$model_name"' in q, (where, q)  # every panel follows the model picker
