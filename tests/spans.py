"""An in-memory span exporter on the process's one SDK tracer provider, for tests that check traces.

OpenTelemetry lets a process set its global tracer provider once; a second ``set_tracer_provider``
is refused (with a log line, not an error), so two test modules that each installed their own would
see the first one's spans only. Every test module that reads spans gets its exporter from here:
the first call installs an SDK provider, later ones add their exporter to it.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def memory_exporter() -> InMemorySpanExporter:
    """A new exporter that receives every span finished from now on, in this process."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
