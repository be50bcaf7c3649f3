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
added_latency = _meter.create_histogram("openforge.proxy.added_latency", unit="s",
                                        description="Time spent in the proxy outside the engine call.")
publish_errors = _meter.create_counter("openforge.proxy.publish_errors", unit="{event}",
                                       description="Events that Kafka did not take and went to the spool.")


def observe_spool(depth: Callable[[], int]) -> None:
    """Report the spool depth (events waiting for Kafka) as an observable gauge."""

    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(depth())

    _meter.create_observable_gauge("openforge.proxy.spool_depth", callbacks=[callback], unit="{event}",
                                   description="Call events waiting on local disk for Kafka.")
