"""W3C trace context in Kafka headers.

The proxy's span for a model call, the assembler span that joins it and the
learner step that trains on it form one trace because the context rides along in
each record's headers (``traceparent``/``tracestate``), exactly as HTTP carries it.
Only the OpenTelemetry API is used here; without an SDK configured these calls
are cheap no-ops.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.propagators.textmap import Getter, Setter

Headers = list[tuple[str, bytes]]


class _HeaderSetter(Setter[Headers]):
    def set(self, carrier: Headers, key: str, value: str) -> None:
        carrier.append((key, value.encode()))


class _HeaderGetter(Getter[Sequence[tuple[str, bytes]]]):
    def get(self, carrier: Sequence[tuple[str, bytes]], key: str) -> list[str] | None:
        values = [v.decode("latin-1") for k, v in carrier if k == key and v is not None]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, bytes]]) -> list[str]:
        return [k for k, _ in carrier]


_SETTER = _HeaderSetter()
_GETTER = _HeaderGetter()


def inject_trace_context(headers: Headers, context: otel_context.Context | None = None) -> None:
    """Append the current (or given) trace context to ``headers``.

    Without a span context or any baggage there is nothing to carry: the propagators
    OpenTelemetry ships (W3C trace context and baggage, B3, Jaeger) write nothing then, so the
    global propagator is not asked. The proxy calls this for every call it records, and most
    deployments run without a trace backend. (A propagator of one's own that writes a header
    even then would be skipped.)
    """
    if (trace.get_current_span(context).get_span_context() == trace.INVALID_SPAN_CONTEXT
            and not baggage.get_all(context)):
        return
    propagate.inject(headers, context=context, setter=_SETTER)


def extract_trace_context(headers: Sequence[tuple[str, bytes]]) -> otel_context.Context:
    """The trace context a record carried, to parent the consumer's span on."""
    return propagate.extract(headers, getter=_GETTER)
