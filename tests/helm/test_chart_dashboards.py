"""Dashboards query only metrics the code defines, and every instrument the code defines is on a dashboard.

Instruments are read from the code (the AST of every package), not from a hand list; their Prometheus names
follow OpenTelemetry's translation. Two explicit lists remain, both checked so they can only shrink or stay
true: INTERNAL (instruments deliberately left off dashboards) and PENDING (instruments the dashboards use that
processes still being written will define; each entry fails the test once the code defines it, so the list
is emptied as those processes land).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helm_chart import (
    SCRIPTS,
    Instrument,
    code_instruments,
    dashboard_files,
    dashboard_queries,
    find,
    metric_names,
    prometheus_series,
)

INTERNAL: dict[str, str] = {
    # "openforge.x.y": "why it is not on a dashboard",
}

# name -> (kind, unit, which process will define it); every dashboard metric is defined now.
PENDING: dict[str, tuple[str, str, str]] = {}


@pytest.fixture(scope="module")
def instruments() -> list[Instrument]:
    found = code_instruments()
    assert found, "no instruments found in the code: the scanner is broken"
    return found


@pytest.fixture(scope="module")
def queried() -> dict[str, set[str]]:
    """Metric name -> where it is queried, over every dashboard."""
    out: dict[str, set[str]] = {}
    for path in dashboard_files():
        for where, expr in dashboard_queries(json.loads(path.read_text())):
            for name in metric_names(expr):
                out.setdefault(name, set()).add(f"{path.name}: {where}")
    return out


def test_scanner_reads_the_proxy_instruments(instruments: list[Instrument]) -> None:
    by_name = {i.name: i for i in instruments}
    assert by_name["openforge.proxy.calls"].kind == "counter"
    assert prometheus_series(by_name["openforge.proxy.calls"]) == {"openforge_proxy_calls_total"}
    assert prometheus_series(by_name["openforge.proxy.time_to_first_token"]) == {
        "openforge_proxy_time_to_first_token_seconds_bucket", "openforge_proxy_time_to_first_token_seconds_sum",
        "openforge_proxy_time_to_first_token_seconds_count"}
    assert prometheus_series(by_name["openforge.proxy.spool_depth"]) == {"openforge_proxy_spool_depth"}


@pytest.mark.parametrize(("name", "kind", "unit", "series"), [
    ("a.b", "counter", "{call}", {"a_b_total"}),
    ("a.bytes_in", "updowncounter", "By", {"a_bytes_in_bytes"}),
    ("a.size", "gauge", "By", {"a_size_bytes"}),
    ("a.share", "gauge", "1", {"a_share_ratio"}),
    ("a.share", "histogram", "1", {"a_share_bucket", "a_share_sum", "a_share_count"}),
    ("a.rate", "gauge", "By/s", {"a_rate_bytes_per_second"}),
    ("a.requests_total", "counter", "", {"a_requests_total"}),
    ("a.latency_seconds", "histogram", "s", {"a_latency_seconds_bucket", "a_latency_seconds_sum", "a_latency_seconds_count"}),
])
def test_prometheus_translation(name: str, kind: str, unit: str, series: set[str]) -> None:
    assert prometheus_series(Instrument(name, kind, unit, "test")) == series


def test_promql_parser_extracts_selected_metrics() -> None:
    expr = ('histogram_quantile(0.9, sum by (le) (rate(x_seconds_bucket{k8s_namespace_name=~"$namespace"}'
            '[$__rate_interval]))) / on() group_left sum(y_total) + {__name__="z"} - count(w offset 5m)')
    assert metric_names(expr) == {"x_seconds_bucket", "y_total", "z", "w"}
    with pytest.raises(ValueError, match=r".+"):
        metric_names("sum(rate(x[5m])")


def test_dashboard_metrics_are_defined_instruments(instruments: list[Instrument], queried: dict[str, set[str]]) -> None:
    defined = {series for i in instruments for series in prometheus_series(i)}
    pending = {series for name, (kind, unit, _) in PENDING.items()
               for series in prometheus_series(Instrument(name, kind, unit, "PENDING"))}
    unknown = {name: sorted(where) for name, where in queried.items() if name not in defined | pending}
    assert not unknown, f"dashboards query metrics no instrument defines: {json.dumps(unknown, indent=1)}"


def test_pending_instruments_are_not_defined_yet(instruments: list[Instrument]) -> None:
    landed = {i.name: i.where for i in instruments if i.name in PENDING}
    for name, where in landed.items():
        kind, unit, _ = PENDING[name]
        instrument = next(i for i in instruments if i.name == name)
        assert (instrument.kind, instrument.unit) == (kind, unit), (
            f"{name} at {where} is a {instrument.kind} in {instrument.unit!r}, the dashboards expect a {kind} "
            f"in {unit!r}: align one of them")
    assert not landed, f"defined in code now, remove from PENDING: {landed}"


def test_every_instrument_is_on_a_dashboard_or_internal(instruments: list[Instrument],
                                                        queried: dict[str, set[str]]) -> None:
    missing = [f"{i.name} ({i.where})" for i in instruments
               if i.name not in INTERNAL and not prometheus_series(i) & set(queried)]
    assert not missing, f"instruments on no dashboard (add a panel or list them in INTERNAL): {missing}"
    stale = set(INTERNAL) - {i.name for i in instruments}
    assert not stale, f"INTERNAL lists instruments the code no longer defines: {stale}"


def test_every_pending_instrument_is_queried(queried: dict[str, set[str]]) -> None:
    for name, (kind, unit, _) in PENDING.items():
        assert prometheus_series(Instrument(name, kind, unit, "PENDING")) & set(queried), name


def test_dashboards_cover_the_issue_panels() -> None:
    titles = {panel["title"] for path in dashboard_files() for panel in json.loads(path.read_text())["panels"]}
    for title in ("Calls/s", "Tokens/s", "Time to first token", "Proxy added latency", "Spool depth",
                  "Consumer lag per group", "Trajectories/s", "Staleness distribution", "Reward by task", "Loss",
                  "Entropy", "Importance weights", "Effective sample size", "Checkpoint publish latency",
                  "Rollout outcomes by reason"):
        assert title in titles


def test_committed_dashboards_are_generated() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "make_dashboards.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_dashboards_ship_as_sidecar_config_maps(default_objects: list[dict[str, Any]]) -> None:
    maps = [m for m in find(default_objects, "ConfigMap") if "-dashboard-" in m["metadata"]["name"]]
    assert len(maps) == len(dashboard_files()) == 3
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        (filename, text), = config_map["data"].items()
        dashboard = json.loads(text)
        assert dashboard["uid"] == filename.removesuffix(".json")


def test_scanner_resolves_module_constants_and_refuses_computed_names(tmp_path: Path) -> None:
    package = tmp_path / "stream"
    package.mkdir()
    (package / "named.py").write_text(
        'LAG = "a.lag"\nUNIT = "s"\nmeter.create_histogram(LAG, unit=UNIT)\nmeter.create_counter("a.b", "{x}")\n')
    found = {i.name: (i.kind, i.unit) for i in code_instruments(tmp_path)}
    assert found == {"a.lag": ("histogram", "s"), "a.b": ("counter", "{x}")}
    (package / "computed.py").write_text('for name in ("a", "b"):\n    meter.create_gauge(name)\n')
    with pytest.raises(AssertionError, match="string literal or a module-level string constant"):
        code_instruments(tmp_path)
    (package / "computed.py").write_text('X = "a"\nX = "b"\nmeter.create_gauge(X)\n')  # rebound: ambiguous
    with pytest.raises(AssertionError, match="module-level string constant"):
        code_instruments(tmp_path)
