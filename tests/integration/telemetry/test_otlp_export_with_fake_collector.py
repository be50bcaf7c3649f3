"""OTLP export from a real OpenForge process to a fake collector.

No OpenTelemetry collector binary can be installed here, so a small HTTP server stands in for one:
it accepts OTLP/HTTP protobuf posts and decodes them with the official protobuf classes, which is
what a collector would do first. What is real: the process, its SDK set-up and its exporters.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

EMIT = """
from opentelemetry import metrics, trace
from openforge.otel import configure_telemetry
shutdown = configure_telemetry("openforge-test")
assert configure_telemetry("other") is shutdown
with trace.get_tracer("t").start_as_current_span("unit of work"):
    metrics.get_meter("m").create_counter("openforge.test.things").add(3)
shutdown()
"""


class Collector:
    def __init__(self) -> None:
        self.spans: list[str] = []
        self.metrics: list[str] = []
        self.services: set[str] = set()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    seen = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    seen.services.update(a.value.string_value for a in rs.resource.attributes
                                         if a.key == "service.name")
                    seen.spans += [s.name for ss in rs.scope_spans for s in ss.spans]
            elif self.path == "/v1/metrics":
                request = ExportMetricsServiceRequest.FromString(body)
                seen.metrics += [m.name for rm in request.resource_metrics for sm in rm.scope_metrics
                                 for m in sm.metrics]
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield seen, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_emitter(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", EMIT], env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_process_exports_spans_and_metrics_over_otlp(collector: tuple[Collector, str]) -> None:
    seen, url = collector
    done = run_emitter({"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": url,
                        "OTEL_SERVICE_NAME": "openforge-assembler"})
    assert done.returncode == 0, done.stderr
    assert seen.spans == ["unit of work"]
    assert "openforge.test.things" in seen.metrics
    assert seen.services == {"openforge-assembler"}


@pytest.mark.parametrize("env", [{}, {"OTEL_SDK_DISABLED": "true"}])
def test_nothing_is_exported_without_an_endpoint_or_when_disabled(collector: tuple[Collector, str],
                                                                  env: dict[str, str]) -> None:
    seen, url = collector
    if env:
        env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": url}
    done = run_emitter({"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    assert seen.spans == [] and seen.metrics == []
