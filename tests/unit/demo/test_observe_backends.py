"""What `openforge observe` hands the processes, and its error when a backend was never built."""

from __future__ import annotations

from pathlib import Path

import pytest

from openforge.observe import BackendError, Backends, otlp_env, running_backends


def test_each_signal_goes_to_its_backend_over_otlp_http() -> None:
    env = otlp_env(Backends("http://127.0.0.1:9090", "http://127.0.0.1:16686", "http://127.0.0.1:4318"), 5000)
    assert env == {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:9090/api/v1/otlp/v1/metrics",
                   "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_METRIC_EXPORT_INTERVAL": "5000"}


def test_a_missing_binary_names_the_script_that_builds_it(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"scripts/prometheus/install.sh"), running_backends(
            tmp_path / "prometheus", tmp_path / "jaeger", tmp_path, prometheus_port=1, jaeger_query_port=2,
            jaeger_otlp_port=3, jaeger_grpc_port=4):
        pass
