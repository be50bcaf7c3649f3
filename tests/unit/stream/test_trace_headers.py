"""Trace context in record headers: written when there is something to carry, and only then."""

from __future__ import annotations

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext

from stream.tracing import extract_trace_context, inject_trace_context

TRACER = TracerProvider().get_tracer("test")


def _injected(context: otel_context.Context | None = None) -> dict[str, bytes]:
    headers: list[tuple[str, bytes]] = []
    inject_trace_context(headers, context)
    return dict(headers)


def test_nothing_is_written_without_a_span_or_baggage() -> None:
    assert _injected() == {}


def test_a_current_span_is_written_and_read_back() -> None:
    with TRACER.start_as_current_span("call") as span:
        headers = _injected()
    expected = span.get_span_context()
    assert headers["traceparent"].decode() == f"00-{expected.trace_id:032x}-{expected.span_id:016x}-{expected.trace_flags:02x}"
    carried = trace.get_current_span(extract_trace_context(list(headers.items()))).get_span_context()
    assert (carried.trace_id, carried.span_id) == (expected.trace_id, expected.span_id)


def test_a_context_that_is_only_partly_valid_is_written_as_the_propagator_writes_it() -> None:
    # The W3C propagator skips only the all-zero context; the shortcut must not skip more.
    partly = SpanContext(trace_id=0xABC, span_id=0, is_remote=True)
    headers = _injected(trace.set_span_in_context(NonRecordingSpan(partly)))
    assert headers["traceparent"].decode() == f"00-{0xABC:032x}-{0:016x}-00"


def test_baggage_alone_is_still_carried() -> None:
    headers = _injected(baggage.set_baggage("tenant", "lab-7"))
    assert headers == {"baggage": b"tenant=lab-7"}


def test_a_given_context_is_written_rather_than_the_current_one() -> None:
    with TRACER.start_as_current_span("elsewhere") as span:
        given = trace.set_span_in_context(span)
    assert _injected() == {}
    assert f"{span.get_span_context().trace_id:032x}" in _injected(given)["traceparent"].decode()
