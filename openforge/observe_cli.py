"""`openforge observe`: the demo with Prometheus and Jaeger beside it, to look at while it learns."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from openforge.demo import DemoOptions, run_demo
from openforge.observe import BackendError, otlp_env, running_backends

EXPORT_INTERVAL_MS = 5000
"""Metric export interval of the demo's processes: shorter than the chart's 15 s, as the demo is short."""
DEMO_NAMESPACE = "openforge-demo"
"""k8s.namespace.name of the demo's processes: the value of the dashboards' $namespace."""


@click.command("observe")
@click.option("--prometheus", "prometheus_bin", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The prometheus binary (scripts/prometheus/install.sh prints its folder).")
@click.option("--jaeger", "jaeger_bin", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The jaeger binary (scripts/jaeger/install.sh prints its folder).")
@click.option("--minutes", type=float, default=10.0, show_default=True, help="Budget of the demo's learning phase.")
@click.option("--prometheus-port", type=int, default=9090, show_default=True)
@click.option("--jaeger-port", type=int, default=16686, show_default=True, help="Jaeger's query API and UI page.")
@click.option("--otlp-port", type=int, default=4318, show_default=True, help="Jaeger's OTLP/HTTP receiver.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".openforge-demo"),
              show_default=True, help="Where the demo's and the backends' logs and data go.")
def observe(prometheus_bin: Path, jaeger_bin: Path, minutes: float, prometheus_port: int, jaeger_port: int,
            otlp_port: int, workdir: Path) -> None:
    """Run the demo exporting its metrics to Prometheus and traces to Jaeger; keep both up until Ctrl-C."""
    folder = workdir.resolve() / f"observe-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        with running_backends(prometheus_bin, jaeger_bin, folder, prometheus_port=prometheus_port,
                              jaeger_query_port=jaeger_port, jaeger_otlp_port=otlp_port,
                              jaeger_grpc_port=jaeger_port - 1) as backends:
            click.echo(f"==> Prometheus at {backends.prometheus_url} (API; e.g. /api/v1/query?query="
                       f"openforge_proxy_calls_total), Jaeger at {backends.jaeger_query_url}/api/traces"
                       f"?service=openforge-proxy")
            # The demo's processes inherit this environment, as the chart's Deployments get theirs.
            os.environ.update(otlp_env(backends, EXPORT_INTERVAL_MS))
            os.environ["OTEL_RESOURCE_ATTRIBUTES"] = f"k8s.namespace.name={DEMO_NAMESPACE},service.namespace=openforge"
            run_demo(DemoOptions(minutes=minutes, workdir=workdir))
            click.echo("==> the demo is over; Prometheus and Jaeger keep its data until Ctrl-C")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    except BackendError as exc:
        raise click.ClickException(str(exc)) from exc
