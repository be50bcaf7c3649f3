"""The proxy's OpenTelemetry instruments (API only; the process wires an SDK if configured)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

tracer = trace.get_tracer("openforge.proxy")
_meter = metrics.get_meter("openforge.proxy")

calls = _meter.create_counter("openforge.proxy.calls", unit="{call}",
                              description="Model calls handled, by protocol and status.")
tokens = _meter.create_counter("openforge.proxy.tokens", unit="{token}",
                               description="Prompt and completion tokens of captured calls.")
time_to_first_token = _meter.create_histogram("openforge.proxy.time_to_first_token", unit="s",
                                              description="Time from request to the first sampled token.")
refused = _meter.create_counter("openforge.proxy.refused", unit="{request}",
                               description="Requests answered with an error before any engine work (no call event "
                                           "records them), by HTTP status: credentials (401, 403), bodies over the "
                                           "limit (413), compressed bodies (415), a full journal or disk (503), a "
                                           "malformed reward (400).")
added_latency = _meter.create_histogram("openforge.proxy.added_latency", unit="s",
                                        description="Time spent in the proxy outside the engine call.")


class _Publisher:
    """Where the publisher's figures are read from (the process's one publisher, set at start-up)."""

    backlog: Callable[[], int] | None = None
    errors: Callable[[], int] | None = None
    flush_errors: Callable[[], int] | None = None


def _spool_depth(_options: CallbackOptions) -> Iterable[Observation]:
    if _Publisher.backlog is not None:
        yield Observation(_Publisher.backlog())


def _publish_errors(_options: CallbackOptions) -> Iterable[Observation]:
    if _Publisher.errors is not None:
        yield Observation(_Publisher.errors())


def _flush_errors(_options: CallbackOptions) -> Iterable[Observation]:
    if _Publisher.flush_errors is not None:
        yield Observation(_Publisher.flush_errors())


# Registered once, here: an instrument registered again under the same name keeps its first
# callbacks, which would read a publisher that is gone (several apps in one process, as in tests).
_meter.create_observable_gauge("openforge.proxy.spool_depth", callbacks=[_spool_depth], unit="{event}",
                               description="Call events waiting on local disk for Kafka.")
_meter.create_observable_counter(
    "openforge.proxy.publish_errors", callbacks=[_publish_errors], unit="{attempt}",
    description="Hand-offs to Kafka that failed: batches of the journal sent again.")

_meter.create_observable_counter(
    "openforge.proxy.journal_flush_errors", callbacks=[_flush_errors], unit="{flush}",
    description="Flushes of the journal to the disk that failed. Records written since the "
                "last good flush may be only in memory until Kafka has them: a disk to look at.")


def observe_publisher(backlog: Callable[[], int], errors: Callable[[], int], flush_errors: Callable[[], int]) -> None:
    """Report the publisher's backlog (a gauge), its failed hand-offs to Kafka and its failed flushes (counters).

    All are read from the publisher when metrics are collected.
    """
    _Publisher.backlog = backlog
    _Publisher.errors = errors
    _Publisher.flush_errors = flush_errors
