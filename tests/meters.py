"""An in-memory metric reader on the process's one SDK meter provider, for tests that check metrics.

OpenTelemetry lets a process set its global meter provider once, and a provider's readers are
fixed when it is made: every test that reads metrics shares the reader made here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

_reader: list[InMemoryMetricReader] = []

Attributes = tuple[tuple[str, object], ...]


def memory_reader() -> InMemoryMetricReader:
    """The process's reader; the first call installs the SDK provider it belongs to."""
    if not _reader:
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        metrics.set_meter_provider(provider)
        if metrics.get_meter_provider() is not provider:
            raise RuntimeError("another meter provider was installed first; metrics cannot be read here")
        _reader.append(reader)
    return _reader[0]


def _points(name: str) -> Iterator[tuple[Attributes, Any]]:
    """The named instrument's data points, collected now, with their attributes sorted."""
    data = memory_reader().get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        yield tuple(sorted((point.attributes or {}).items())), point


def metric_value(name: str) -> float | None:
    """The sum of the named instrument's data points (None: not reported)."""
    values = [point.value for _, point in _points(name)]
    return sum(values) if values else None


def counter_values(name: str) -> dict[Attributes, float]:
    """The named counter's totals so far, by attribute set."""
    totals: dict[Attributes, float] = {}
    for attributes, point in _points(name):
        totals[attributes] = totals.get(attributes, 0.0) + point.value
    return totals


def histogram_counts(name: str) -> dict[Attributes, int]:
    """How many values the named histogram recorded so far, by attribute set."""
    counts: dict[Attributes, int] = {}
    for attributes, point in _points(name):
        counts[attributes] = counts.get(attributes, 0) + point.count
    return counts
