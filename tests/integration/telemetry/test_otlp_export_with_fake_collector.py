"""OTLP export from a real OpenForge process to a fake collector.

No OpenTelemetry collector binary can be installed here, so a small HTTP server stands in for one:
it accepts OTLP/HTTP protobuf posts and decodes them with the official protobuf classes, which is
what a collector would do first. What is real: the process, its SDK set-up and its exporters.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from factories import reward
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from schemas import CheckpointV1
from stream import KafkaSettings, TopicRegistry
from stream.broker import free_port
from stream.producer import EventProducer
from stream.topics import CHECKPOINTS, REWARDS

EMIT = """
from opentelemetry import metrics, trace
from stream.otel import configure_telemetry
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
        self.metric_services: set[str] = set()


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
                seen.metric_services.update(a.value.string_value for rm in request.resource_metrics
                                            for a in rm.resource.attributes if a.key == "service.name")
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


def test_a_process_told_to_speak_grpc_refuses_to_start(collector: tuple[Collector, str]) -> None:
    """The exporters speak OTLP/HTTP only: posting HTTP to a gRPC port would lose everything in silence."""
    seen, url = collector
    done = run_emitter({"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": url,
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert done.returncode != 0
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=grpc" in done.stderr and "http/protobuf" in done.stderr, done.stderr
    assert seen.spans == [] and seen.metrics == []


# --- the real commands -------------------------------------------------------------------------

def _record_for(name: str) -> tuple[object, object]:
    """(topic, event) that the command's consumer handles, so its lag gauge has a position to report."""
    if name == "assembler":
        return REWARDS, reward("r-otlp")
    return CHECKPOINTS, CheckpointV1(model="another-model", version=1, uri="/nowhere", step=1)


async def _publish(kafka_settings: KafkaSettings, topic: object, event: object) -> None:
    async with EventProducer(kafka_settings) as producer:
        await producer.publish(topic, event)  # type: ignore[arg-type]


@pytest.mark.kafka
@pytest.mark.parametrize("name", ["assembler", "publisher"])
def test_a_command_exports_its_metrics_as_its_service(name: str, collector: tuple[Collector, str],
                                                      kafka_settings: KafkaSettings, topics: TopicRegistry,
                                                      tmp_path: Path) -> None:
    """The command installs telemetry itself and flushes it on SIGTERM: its consumer's lag arrives."""
    seen, url = collector
    asyncio.run(_publish(kafka_settings, *_record_for(name)))
    args = {"assembler": ["assembler"],
            "publisher": ["publisher", "--replica", f"http://127.0.0.1:{free_port()}", "--model", "tiny"]}[name]
    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix, "OTEL_EXPORTER_OTLP_ENDPOINT": url,
           "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
    env.pop("OTEL_SERVICE_NAME", None)
    env.pop("OTEL_SDK_DISABLED", None)
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "openforge", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "openforge.consumer.lag" not in seen.metrics and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "openforge.consumer.lag" in seen.metrics, (seen.metrics, log.read_text()[-3000:])
    assert seen.metric_services == {f"openforge-{name}"}
