"""An in-memory metric reader on the process's one SDK meter provider, for tests that check metrics.

OpenTelemetry lets a process set its global meter provider once, and a provider's readers are
fixed when it is made: every test that reads metrics shares the reader made here.
"""

from __future__ import annotations

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

_reader: list[InMemoryMetricReader] = []


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


def metric_value(name: str) -> float | None:
    """The sum of the named instrument's data points, collected now (None: not reported)."""
    data = memory_reader().get_metrics_data()
    found: float | None = None
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    found = (found or 0.0) + sum(point.value for point in metric.data.data_points)
    return found


def histogram_counts(name: str) -> dict[tuple[tuple[str, object], ...], int]:
    """How many values the named histogram recorded so far, by attribute set."""
    data = memory_reader().get_metrics_data()
    counts: dict[tuple[tuple[str, object], ...], int] = {}
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        key = tuple(sorted((point.attributes or {}).items()))
                        counts[key] = counts.get(key, 0) + point.count
    return counts


def counter_values(name: str) -> dict[tuple[tuple[str, object], ...], float]:
    """The named counter's totals so far, by attribute set."""
    data = memory_reader().get_metrics_data()
    totals: dict[tuple[tuple[str, object], ...], float] = {}
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        key = tuple(sorted((point.attributes or {}).items()))
                        totals[key] = totals.get(key, 0.0) + point.value
    return totals
