"""OpenTelemetry SDK set-up shared by every OpenForge process.

Library code (``stream``, ``proxy``, ``consumers``, ``learner``) uses only the OpenTelemetry API,
whose calls are no-ops until a process installs an SDK. Each process's command calls
:func:`configure_telemetry` once at start: with an OTLP endpoint in the standard environment
(``OTEL_EXPORTER_OTLP_ENDPOINT``, or the per-signal ``..._TRACES_ENDPOINT`` /
``..._METRICS_ENDPOINT``) it installs tracer and meter providers that export over OTLP/HTTP;
without one it installs nothing, so a laptop run pays nothing for telemetry it does not collect.
``OTEL_SDK_DISABLED=true`` turns it off whatever else is set, as the specification says.
The exporters speak OTLP/HTTP (protobuf) only: a process told to speak gRPC
(``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``) refuses to start rather than post HTTP to a gRPC port and
lose every span and point in silence.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

__all__ = ["configure_telemetry"]

_log = logging.getLogger(__name__)
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                  "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
_PROTOCOL = "http/protobuf"
_configured: Callable[[], None] | None = None


def configure_telemetry(service_name: str) -> Callable[[], None]:
    """Install OTLP trace and metric export for this process when an endpoint is configured.

    Args:
        service_name: ``service.name`` of the resource, unless ``OTEL_SERVICE_NAME`` overrides it
            (the chart sets it per Deployment).

    Returns:
        A function that flushes and shuts the providers down; call it when the process drains.
        It does nothing when nothing was installed. Calling :func:`configure_telemetry` again
        returns the first call's function: providers can be set only once per process.

    Raises:
        ValueError: an OTLP protocol variable names a protocol other than ``http/protobuf``.
    """
    global _configured
    if _configured is not None:
        return _configured
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not any(
            os.environ.get(v) for v in _ENDPOINT_VARS):
        _configured = _nothing
        return _configured
    for var in _PROTOCOL_VARS:
        if os.environ.get(var, _PROTOCOL) != _PROTOCOL:
            raise ValueError(f"{var}={os.environ[var]}: OpenForge exports OTLP over HTTP only; set it to "
                             f"{_PROTOCOL} and point the endpoint at the collector's OTLP/HTTP port (4318)")

    from opentelemetry import metrics, trace
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name),
                                "service.namespace": "openforge"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    meter_provider = MeterProvider(resource=resource,
                                   metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    _log.info("exporting traces and metrics over OTLP as service %s", resource.attributes["service.name"])

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    _configured = shutdown
    return shutdown


def _nothing() -> None:
    """Nothing was installed, so nothing to flush."""
