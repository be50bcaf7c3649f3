"""Prometheus and Jaeger beside the processes, receiving their OTLP metrics and traces directly.

The processes export over OTLP/HTTP (:mod:`stream.otel`). Prometheus takes the metrics on its OTLP
receiver and Jaeger the traces on its own, so no collector runs between them; their settings are
the files in ``observe/`` (the labels the dashboards select by, Jaeger's in-memory store).
The binaries come from ``scripts/prometheus/install.sh`` and ``scripts/jaeger/install.sh``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONFIG_DIR", "BackendError", "Backends", "otlp_env", "running_backends"]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "observe"
"""prometheus.yml and jaeger.yaml."""


class BackendError(RuntimeError):
    """Prometheus or Jaeger is missing, or did not become ready."""


@dataclass(frozen=True)
class Backends:
    """Where the running backends listen."""

    prometheus_url: str
    """Prometheus' HTTP API (and OTLP receiver under /api/v1/otlp)."""
    jaeger_query_url: str
    """Jaeger's query API (/api/traces, /api/services)."""
    jaeger_otlp_url: str
    """Jaeger's OTLP/HTTP receiver."""


def otlp_env(backends: Backends, export_interval_ms: int) -> dict[str, str]:
    """The standard OpenTelemetry variables that send a process's metrics and traces to the backends.

    Per-signal endpoints are full URLs: the SDK appends nothing to them.
    """
    return {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{backends.prometheus_url}/api/v1/otlp/v1/metrics",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{backends.jaeger_otlp_url}/v1/traces",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_METRIC_EXPORT_INTERVAL": str(export_interval_ms)}


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BackendError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        with (contextlib.suppress(OSError, urllib.error.URLError),
              urllib.request.urlopen(url, timeout=2) as response):  # noqa: S310 - our own loopback URL
            if response.status == 200:
                return
        time.sleep(0.3)
    raise BackendError(f"{what} not ready at {url} within {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _executable(path: Path, script: str) -> Path:
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BackendError(f"{path} is missing: build it with {script}")
    return path


@contextlib.contextmanager
def running_backends(prometheus: Path, jaeger: Path, folder: Path, *, host: str = "127.0.0.1",
                     prometheus_port: int, jaeger_query_port: int, jaeger_otlp_port: int,
                     jaeger_grpc_port: int) -> Iterator[Backends]:
    """Start Prometheus (OTLP receiver on) and Jaeger, logging and storing under ``folder``; stop both on exit.

    Raises:
        BackendError: a binary is missing, or a backend exited or did not answer within a minute.
    """
    _executable(prometheus, "scripts/prometheus/install.sh (make prometheus)")
    _executable(jaeger, "scripts/jaeger/install.sh (make jaeger)")
    folder.mkdir(parents=True, exist_ok=True)
    backends = Backends(f"http://{host}:{prometheus_port}", f"http://{host}:{jaeger_query_port}",
                        f"http://{host}:{jaeger_otlp_port}")
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = folder / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        started.append(proc)
        return proc, log

    try:
        prom, prom_log = start("prometheus", [
            str(prometheus), f"--config.file={CONFIG_DIR / 'prometheus.yml'}", "--web.enable-otlp-receiver",
            f"--web.listen-address={host}:{prometheus_port}", f"--storage.tsdb.path={folder / 'prometheus-data'}",
            "--log.level=warn"], {})
        jaeger_proc, jaeger_log = start("jaeger", [str(jaeger), f"--config={CONFIG_DIR / 'jaeger.yaml'}"], {
            "JAEGER_OTLP_HTTP": f"{host}:{jaeger_otlp_port}", "JAEGER_QUERY_HTTP": f"{host}:{jaeger_query_port}",
            "JAEGER_QUERY_GRPC": f"{host}:{jaeger_grpc_port}"})
        _wait_ready(f"{backends.prometheus_url}/-/ready", prom, prom_log, "Prometheus")
        _wait_ready(f"{backends.jaeger_query_url}/api/services", jaeger_proc, jaeger_log, "Jaeger")
        yield backends
    finally:
        for proc in reversed(started):
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
