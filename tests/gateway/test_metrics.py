from __future__ import annotations

import math
import re

import pytest

from services.gateway.prometheus import Counter, Gauge, Histogram, Registry, quantile_from_samples

# One sample line of the text format: name, optional {labels}, value.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{_LABEL}(?:,{_LABEL})*\}})? (\S+)$")
_VALUE = re.compile(r"^(?:[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?|\+Inf|-Inf|NaN)$")


def parse(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """A strict reader of what Prometheus scrapes: {family: [(sample name, labels, value)]}."""
    assert text.endswith("\n")
    families: dict[str, list] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
            families[name] = []
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        assert _VALUE.match(value), value
        family = next(f for f in families if name == f or name in (f"{f}_bucket", f"{f}_sum", f"{f}_count"))
        pairs = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))
        families[family].append((name, pairs, float(value)))
    return families


def test_counter_renders_help_type_and_value():
    reg = Registry()
    c = Counter("pdd:requests_total", "Requests served.", registry=reg)
    assert parse(reg.render())["pdd:requests_total"] == [("pdd:requests_total", {}, 0.0)]
    c.inc()
    c.inc(2.5)
    text = reg.render()
    assert text.startswith("# HELP pdd:requests_total Requests served.\n# TYPE pdd:requests_total counter\n")
    assert parse(text)["pdd:requests_total"] == [("pdd:requests_total", {}, 3.5)]


def test_labelled_counter_and_escaping():
    reg = Registry()
    c = Counter("pdd:errors_total", 'Errors, by "kind".\nSecond line \\ end', ("kind", "status"), registry=reg)
    assert parse(reg.render())["pdd:errors_total"] == []  # no label set seen yet
    c.labels(kind='bad "json"\nx\\y', status=400).inc()
    c.labels(kind="timeout", status="504").inc(3)
    text = reg.render()
    assert '# HELP pdd:errors_total Errors, by "kind".\\nSecond line \\\\ end\n' in text
    assert 'pdd:errors_total{kind="bad \\"json\\"\\nx\\\\y",status="400"} 1.0' in text
    samples = parse(text)["pdd:errors_total"]
    assert ("pdd:errors_total", {"kind": "timeout", "status": "504"}, 3.0) in samples


def test_gauge_set_inc_dec():
    reg = Registry()
    g = Gauge("pdd:inflight_requests", "In flight.", registry=reg)
    g.set(5)
    g.inc()
    g.dec(2)
    per = Gauge("pdd:free_blocks", "Free KV blocks.", ("instance",), registry=reg)
    per.labels(instance="md-0").set(10)
    per.labels(instance="md-1").set(3)
    per.remove(instance="md-1")
    got = parse(reg.render())
    assert got["pdd:inflight_requests"] == [("pdd:inflight_requests", {}, 4.0)]
    assert got["pdd:free_blocks"] == [("pdd:free_blocks", {"instance": "md-0"}, 10.0)]


def test_histogram_buckets_are_cumulative():
    reg = Registry()
    h = Histogram("pdd:time_to_first_token_seconds", "TTFT.", [0.1, 0.5, 1], ("pipeline",), registry=reg)
    for v in (0.05, 0.1, 0.3, 0.7, 5.0):  # 0.1 lands in le=0.1: buckets are inclusive
        h.labels(pipeline="p-md").observe(v)
    samples = parse(reg.render())["pdd:time_to_first_token_seconds"]
    buckets = [(s[1]["le"], s[2]) for s in samples if s[0].endswith("_bucket")]
    assert buckets == [("0.1", 2), ("0.5", 3), ("1.0", 4), ("+Inf", 5)]
    assert all(s[1]["pipeline"] == "p-md" for s in samples)
    sums = {s[0]: s[2] for s in samples if not s[0].endswith("_bucket")}
    assert sums["pdd:time_to_first_token_seconds_count"] == 5
    assert sums["pdd:time_to_first_token_seconds_sum"] == pytest.approx(6.15)


def test_unlabelled_histogram_and_label_order():
    reg = Registry()
    h = Histogram("pdd:tpot_seconds", "TPOT.", [1.0, math.inf], registry=reg)
    h.observe(2.0)
    h.observe(float("nan"))  # ignored rather than poisoning the sum
    text = reg.render()
    assert 'pdd:tpot_seconds_bucket{le="1.0"} 0\npdd:tpot_seconds_bucket{le="+Inf"} 1\n' in text
    assert "pdd:tpot_seconds_sum 2.0\npdd:tpot_seconds_count 1\n" in text
    h2 = Histogram("x", "x", [1], ("a",), registry=reg)
    h2.labels(a="z").observe(0)
    assert 'x_bucket{a="z",le="1.0"} 1' in reg.render()


def test_registry_renders_in_registration_order():
    reg = Registry()
    Gauge("b", "b", registry=reg)
    Counter("a", "a", registry=reg)
    text = reg.render()
    assert text.index("# TYPE b gauge") < text.index("# TYPE a counter")
    assert reg.get("a").kind == "counter"


@pytest.mark.parametrize(
    "make",
    [
        lambda: Counter("bad-name", "x"),
        lambda: Counter("0abc", "x"),
        lambda: Counter("ok", "x", ("bad-label",)),
        lambda: Counter("ok", "x", ("__reserved",)),
        lambda: Counter("ok", "x", ("a", "a")),
        lambda: Histogram("ok", "x", [1], ("le",)),
        lambda: Histogram("ok", "x", [1, 1]),
        lambda: Histogram("ok", "x", [2, 1]),
        lambda: Histogram("ok", "x", []),
    ],
)
def test_invalid_definitions_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_misuse_is_refused():
    reg = Registry()
    c = Counter("c", "c", ("kind",), registry=reg)
    with pytest.raises(ValueError):
        c.inc()  # labelled: needs .labels()
    with pytest.raises(ValueError):
        c.labels(other="x")
    with pytest.raises(ValueError):
        c.labels(kind="x").inc(-1)
    with pytest.raises(ValueError):
        Counter("c", "again", registry=reg)


def test_quantile_from_samples():
    values = [4, 1, 3, 2]
    assert quantile_from_samples(values, 0) == 1
    assert quantile_from_samples(values, 1) == 4
    assert quantile_from_samples(values, 0.5) == 2.5
    assert quantile_from_samples(values, 0.9) == pytest.approx(3.7)  # numpy.quantile's answer
    assert quantile_from_samples([7.0], 0.99) == 7.0
    assert math.isnan(quantile_from_samples([], 0.5))
    with pytest.raises(ValueError):
        quantile_from_samples(values, 1.5)
