"""The loop's telemetry in a real Prometheus and a real Jaeger: every dashboard panel, one call's trace.

A short real loop (vLLM's CPU build, proxy, assembler, learner, publisher, launcher, each its own
process) runs with the OpenTelemetry variables the chart renders for each Deployment, with the chart
pointed at Prometheus' OTLP receiver (``otel.endpoint``) and, through each component's
``extraEnv``, the traces at Jaeger's: what an operator without the chart's collector would set.
Prometheus and Jaeger are built from the Go module proxy (scripts/prometheus, scripts/jaeger) and
run with the settings in ``observe/``. Then:

- every panel query of every dashboard is evaluated through Prometheus' HTTP API with Grafana's
  variables filled in, and must return finite numbers of the unit the panel claims, except the
  panels in ``NO_DATA_IN_A_SHORT_HEALTHY_LOOP``, which count what such a loop never does;
- one model call is followed through Jaeger's query API: the proxy's call span, the assembler's
  trajectory span that links to it across the Kafka hop, and the learner step that links to that.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from loop import Loop, running_loop, tasks
from observe_bins import jaeger_binary, prometheus_binary, promtool_binary

from openforge.observe import CONFIG_DIR, Backends, running_backends
from schemas import CheckpointAppliedV1, CheckpointV1
from stream import CHECKPOINTS, TASKS, EventConsumer, EventProducer, KafkaAdmin, KafkaSettings, Received, TopicRegistry
from stream.broker import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
from helm_chart import (
    GRAFANA_VARIABLES,
    NAMESPACE,
    Helm,
    dashboard_files,
    env_of,
    install_helm,
    metric_names,
    process,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[3]
COMPONENTS = ("proxy", "assembler", "learner", "publisher", "launcher")
EXPORT_INTERVAL_MS = 1000
"""otel.metricExportIntervalMs: a second, so a short loop leaves many points per series."""
CHECKPOINTS_WANTED = 3
RATE_WINDOW = "30m"
"""$__rate_interval: wider than the whole loop, so a rate sees every point it exported."""

NO_DATA_IN_A_SHORT_HEALTHY_LOOP = {
    # Counters appear at their first event; these count trouble a healthy loop does not have.
    "openforge_learner_stale_tokens_total": "tokens too stale to train: the launcher paces the loop",
    "openforge_learner_dropped_total": "trajectories dropped by the learner (stale, too long)",
    "openforge_learner_skipped_steps_total": "steps with nothing to train",
    "openforge_learner_short_groups_total": "groups that arrived incomplete",
    "openforge_publisher_verify_failures_total": "checkpoints whose digest did not verify",
    "openforge_publisher_timeouts_total": "update steps that hit their limit",
    # The loop publishes from disk: nothing goes over NCCL.
    "openforge_publisher_transferred_bytes_total": "weights sent over NCCL (the loop uses the disk backend)",
    "openforge_assembler_failures_total": "rollouts that failed",
    "openforge_assembler_duplicates_total": "events delivered twice",
    "openforge_assembler_late_events_total": "events after a trajectory was closed",
    "openforge_assembler_replayed_events_total": "events replayed after a restart",
    "openforge_assembler_dead_letters_total": "events that could not be decoded",
    "openforge_assembler_oversized_total": "trajectories over the size limit",
    "openforge_proxy_refused_total": "requests refused (bad credential, over a limit)",
    "openforge_proxy_publish_errors_total": "events Kafka did not take",
    "openforge_proxy_journal_flush_errors_total": "journal writes that failed",
    # The loop's one-call harness neither calls tools nor continues a conversation.
    "openforge_assembler_merge_breaks_total": "a multi-turn conversation whose history drifted",
    "openforge_assembler_merge_calls_total": "multi-turn merges (the one-call harness makes none)",
    "openforge_assembler_tool_errors_total": "tool calls (the one-call harness makes none)",
    "openforge_assembler_tool_results_total": "tool calls (the one-call harness makes none)",
}
"""Metric -> why a short loop of healthy one-call rollouts never records it."""


@dataclass
class Observed:
    backends: Backends
    namespace: str
    loop: Loop


def _chart_otel_env(tmp: Path, backends: Backends) -> dict[str, dict[str, str]]:
    """The OTEL_* variables the chart renders for each component, as the kubelet would expand them."""
    traces = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{backends.jaeger_otlp_url}/v1/traces"}
    values: dict[str, Any] = {
        "otel": {"collector": {"enabled": False}, "endpoint": f"{backends.prometheus_url}/api/v1/otlp",
                 "metricExportIntervalMs": EXPORT_INTERVAL_MS},
        **{name: {"extraEnv": traces} for name in COMPONENTS}}
    objects = Helm(install_helm()).render(values, tmp)
    out = {}
    for name in COMPONENTS:
        deployment = process(objects, name)  # the proxy is a StatefulSet
        pod = f"{deployment['metadata']['name']}-7c9d5-x{name[:3]}"
        out[name] = {k: v.replace("$(POD_NAME)", pod).replace("$(POD_NAMESPACE)", NAMESPACE)
                     for k, v in env_of(deployment).items() if k.startswith("OTEL_")}
    assert out["proxy"]["OTEL_SERVICE_NAME"] == "openforge-proxy", out["proxy"]
    return out


async def _run_until_checkpoints(loop: Loop, kafka: KafkaSettings) -> None:
    """Submit tasks until the learner has published and the engine applied CHECKPOINTS_WANTED versions."""
    published: list[int] = []
    applied: list[int] = []

    async def handle(received: Received) -> None:
        if isinstance(received.event, CheckpointV1):
            published.append(received.event.version)
        elif isinstance(received.event, CheckpointAppliedV1) and received.event.ok:
            applied.append(received.event.version)

    run_id = f"observed-{uuid.uuid4().hex[:6]}"
    async with EventConsumer([CHECKPOINTS], handle, group_id=f"{run_id}-watch", kafka=kafka):
        async with EventProducer(kafka) as producer:
            for task in tasks(200, group_size=2, run_id=run_id):
                await producer.send(TASKS, task)
            await producer.flush()
        deadline = time.monotonic() + 900
        while len(set(applied)) < CHECKPOINTS_WANTED:
            loop.check()
            assert time.monotonic() < deadline, (
                f"published {published}, applied {applied} in 900 s\n{loop.log('learner')[-3000:]}")
            await asyncio.sleep(1.0)


async def _create_topics(kafka: KafkaSettings) -> None:
    async with KafkaAdmin(kafka, TopicRegistry.from_settings(kafka)) as admin:
        await admin.create_topics()


@pytest.fixture(scope="module")
def observed(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    """One loop for the module: every test reads what it left in Prometheus and Jaeger."""
    tmp = tmp_path_factory.mktemp("observed")
    kafka_settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
                                   partitions=2, linger_ms=0)
    asyncio.run(_create_topics(kafka_settings))
    with running_backends(prometheus_binary(), jaeger_binary(), tmp / "backends", prometheus_port=free_port(),
                          jaeger_query_port=free_port(), jaeger_otlp_port=free_port(),
                          jaeger_grpc_port=free_port()) as backends:
        env = _chart_otel_env(tmp / "values", backends)
        # A checkpoint each step, so the publisher and the engine have versions to load in minutes.
        with running_loop(kafka_settings, tmp / "loop", {"OPENFORGE_LEARNER_CHECKPOINT_EVERY": "1"},
                          env_by_process=env) as loop:
            asyncio.run(_run_until_checkpoints(loop, kafka_settings))
            # Three more export intervals, so every series has points after the last event.
            time.sleep(3 * EXPORT_INTERVAL_MS / 1000)
        # The processes flushed their last points and spans when they stopped (SIGTERM drains them).
        yield Observed(backends, NAMESPACE, loop)


# --- Prometheus ---------------------------------------------------------------------------------

def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _query(backends: Backends, expr: str) -> list[dict[str, Any]]:
    answer = _get(f"{backends.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def _panels() -> Iterator[tuple[str, str, str, str]]:
    """(dashboard, panel title, unit, PromQL) of every panel target."""
    for path in dashboard_files():
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
            for target in panel.get("targets", []):
                yield path.stem, panel["title"], unit, target["expr"]


def _fill(expr: str, namespace: str) -> str:
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    expr = expr.replace("$namespace", re.escape(namespace))
    assert "$" not in expr, f"a Grafana variable this test does not fill: {expr}"
    return expr


def test_promtool_accepts_the_prometheus_settings() -> None:
    """The chart ships no recording or alerting rules; the settings observe/ gives Prometheus are checked."""
    proc = subprocess.run([str(promtool_binary()), "check", "config", str(CONFIG_DIR / "prometheus.yml")],
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_namespace_variable_lists_the_namespace_the_chart_sets(observed: Observed) -> None:
    """The dashboards' $namespace is label_values(openforge_proxy_calls_total, k8s_namespace_name)."""
    query = urllib.parse.urlencode({"match[]": "openforge_proxy_calls_total"})
    answer = _get(f"{observed.backends.prometheus_url}/api/v1/label/k8s_namespace_name/values?{query}")
    assert answer["data"] == [observed.namespace], answer


@pytest.mark.parametrize(("dashboard", "title", "unit", "expr"), list(_panels()),
                         ids=[f"{d}:{t}:{i}" for i, (d, t, _, _) in enumerate(_panels())])
def test_every_panel_returns_data_of_its_unit(observed: Observed, dashboard: str, title: str, unit: str,
                                              expr: str) -> None:
    names = metric_names(expr)
    allowed = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in names} | names
    excused = allowed & NO_DATA_IN_A_SHORT_HEALTHY_LOOP.keys()
    result = _query(observed.backends, _fill(expr, observed.namespace))
    values = [float(sample["value"][1]) for sample in result]
    finite = [v for v in values if math.isfinite(v)]
    if not excused:  # an excused query may have no data; what it has must still be of its unit
        assert finite, f"{dashboard} {title!r}: no finite value from {expr} (got {values})"
    # The unit the panel claims matches the series it reads, and the numbers fit it.
    seconds = {n for n in names if re.search(r"_seconds(_bucket|_sum|_count)?$", n)}
    if unit == "s":
        assert seconds == names, f"{title!r} claims seconds but reads {names}"
    else:
        assert not seconds, f"{title!r} reads durations {seconds} but claims {unit!r}"
    if unit == "percentunit":
        assert all(0.0 <= v <= 1.0 for v in finite), (title, finite)
    if unit in ("reqps", "s"):
        assert all(v >= 0.0 for v in finite), (title, finite)
    if unit == "reqps":
        assert "rate(" in expr and all(n.endswith("_total") for n in names), (title, expr)


def test_every_excused_metric_is_read_by_a_panel() -> None:
    """The allow-list names only metrics some panel reads, so it cannot hide a renamed one."""
    read = set().union(*(metric_names(expr) for _, _, _, expr in _panels()))
    read |= {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in read}
    assert NO_DATA_IN_A_SHORT_HEALTHY_LOOP.keys() <= read, NO_DATA_IN_A_SHORT_HEALTHY_LOOP.keys() - read


# --- Jaeger -------------------------------------------------------------------------------------

def _traces(backends: Backends, service: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"service": service, "limit": 2000, "lookback": "2h"})
    data: list[dict[str, Any]] = _get(f"{backends.jaeger_query_url}/api/traces?{query}")["data"]
    return data


def _spans(traces: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for t in traces for s in t["spans"] if s["operationName"] == name]


def _tag(span: dict[str, Any], key: str) -> Any:
    return next((t["value"] for t in span["tags"] if t["key"] == key), None)


def _links(span: dict[str, Any]) -> set[tuple[str, str]]:
    """Span links, which Jaeger shows as FOLLOWS_FROM references."""
    return {(r["traceID"], r["spanID"]) for r in span.get("references", []) if r["refType"] == "FOLLOWS_FROM"}


def test_one_model_call_is_followed_from_the_proxy_to_the_learner_step(observed: Observed) -> None:
    backends = observed.backends
    calls = [s for t in _traces(backends, "openforge-proxy") for s in t["spans"] if _tag(s, "openforge.call_id")]
    assembled = _spans(_traces(backends, "openforge-assembler"), "assemble trajectory")
    steps = _spans(_traces(backends, "openforge-learner"), "learner step")
    assert calls and assembled and steps, (len(calls), len(assembled), len(steps))

    # The first trajectory the learner trained: its assembler span, and the call spans it links to.
    trained = {link for step in steps for link in _links(step)}
    by_id = {(s["traceID"], s["spanID"]): s for s in assembled}
    trajectory = next(by_id[link] for link in sorted(trained) if link in by_id)
    rollout_id = _tag(trajectory, "openforge.rollout_id")
    call = next(c for c in calls if (c["traceID"], c["spanID"]) in _links(trajectory))
    # proxy -> assembler: the call's own rollout, in a trace of its own (linked across Kafka, not merged).
    assert _tag(call, "openforge.rollout_id") == rollout_id
    assert call["traceID"] != trajectory["traceID"]
    own_calls = {(c["traceID"], c["spanID"]) for c in calls if _tag(c, "openforge.rollout_id") == rollout_id}
    assert _links(trajectory) == own_calls
    # assembler -> learner: a step links to that trajectory span.
    step = next(s for s in steps if (trajectory["traceID"], trajectory["spanID"]) in _links(s))
    assert step["traceID"] not in {trajectory["traceID"], call["traceID"]}
