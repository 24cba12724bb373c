"""A small Prometheus registry: counters, gauges, histograms, rendered in text format 0.0.4.

No dependencies. Each process's event loop owns its registry (not thread-safe). Names may hold
colons, as recording-rule style names do: `pdd:time_to_first_token_seconds`.

    registry = Registry()
    ttft = Histogram("pdd:time_to_first_token_seconds", "...", LATENCY_BUCKETS, ("pipeline",), registry=registry)
    ttft.labels(pipeline="a").observe(0.21)
    registry.render()  # serve with CONTENT_TYPE
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class CounterChild:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up; inc({amount})")
        self.value += amount


class GaugeChild:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class HistogramChild:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds, ascending, ending with +Inf
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return  # a NaN would poison the sum; it is a caller's bug, not worth failing a request
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # first bucket with value <= le
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


C = TypeVar("C", CounterChild, GaugeChild, HistogramChild)


class _Metric(Generic[C]):
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (), registry: Registry | None = None) -> None:  # noqa: A002
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labelnames:
            if not _LABEL_NAME.fullmatch(label) or label.startswith("__") or label in self._reserved():
                raise ValueError(f"metric {name}: invalid label name {label!r}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"metric {name}: repeated label names {list(labelnames)}")
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()  # an unlabeled metric shows 0 from the start
        if registry is not None:
            registry.register(self)

    def labels(self, **labels: object) -> C:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name}: labels {sorted(labels)} != {list(self.labelnames)}")
        key = tuple(str(labels[n]) for n in self.labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def remove(self, **labels: object) -> None:
        """Forget one label set (e.g. an instance that left)."""
        self._children.pop(tuple(str(labels[n]) for n in self.labelnames), None)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        for key in sorted(self._children):
            lines.extend(self._samples(dict(zip(self.labelnames, key, strict=True)), self._children[key]))
        return "\n".join(lines) + "\n"

    def _unlabeled(self) -> C:
        if self.labelnames:
            raise ValueError(f"metric {self.name} has labels {list(self.labelnames)}; use .labels(...)")
        return self._children[()]

    def _reserved(self) -> tuple[str, ...]:
        return ()

    def _new_child(self) -> C:
        raise NotImplementedError

    def _samples(self, labels: dict[str, str], child: C) -> Iterable[str]:
        raise NotImplementedError


class Counter(_Metric[CounterChild]):
    kind = "counter"

    def inc(self, amount: float = 1.0) -> None:
        self._unlabeled().inc(amount)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _samples(self, labels: dict[str, str], child: CounterChild) -> Iterable[str]:
        yield _sample(self.name, labels, child.value)


class Gauge(_Metric[GaugeChild]):
    kind = "gauge"

    def set(self, value: float) -> None:
        self._unlabeled().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabeled().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabeled().dec(amount)

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def _samples(self, labels: dict[str, str], child: GaugeChild) -> Iterable[str]:
        yield _sample(self.name, labels, child.value)


class Histogram(_Metric[HistogramChild]):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,  # noqa: A002
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        labelnames: Sequence[str] = (),
        registry: Registry | None = None,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if (
            not bounds
            or any(b >= c for b, c in zip(bounds, bounds[1:], strict=False))
            or any(math.isnan(b) for b in bounds)
        ):
            raise ValueError(f"histogram {name}: buckets must be strictly increasing, got {list(buckets)}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        super().__init__(name, help, labelnames, registry)

    def observe(self, value: float) -> None:
        self._unlabeled().observe(value)

    def _reserved(self) -> tuple[str, ...]:
        return ("le",)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def _samples(self, labels: dict[str, str], child: HistogramChild) -> Iterable[str]:
        for bound, count in zip(self.bounds, child.cumulative(), strict=True):
            yield _sample(f"{self.name}_bucket", {**labels, "le": _format_value(bound)}, count)
        yield _sample(f"{self.name}_sum", labels, child.sum)
        yield _sample(f"{self.name}_count", labels, child.count)


class Registry:
    """The metrics one process exposes on /metrics, in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric

    def get(self, name: str) -> _Metric:
        return self._metrics[name]

    def render(self) -> str:
        return "".join(m.render() for m in self._metrics.values())


def quantile_from_samples(values: Iterable[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by linear interpolation between order statistics, as
    numpy's default; NaN for no values."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    if not labels:
        return f"{name} {_format_value(value)}"
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {_format_value(value)}"


def _format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
