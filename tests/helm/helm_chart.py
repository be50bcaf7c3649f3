"""Helpers of the chart tests: build helm, render the chart, read instruments and dashboards.

Kept out of conftest so the dry-run test (which runs against a real kube-apiserver) can reuse them.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "openforge"
SCRIPTS = REPO / "scripts" / "helm"
KUBE_VERSION = "1.37.0"
NAMESPACE = "openforge"
RELEASE = "of"

# The main switches of the chart; every combination is rendered, linted and validated.
SWITCHES: dict[str, tuple[tuple[str, Any], ...]] = {
    "kafka": (("strimzi", {"kafka": {"mode": "strimzi"}}),
              ("external", {"kafka": {"mode": "external", "bootstrapServers": "kafka-0.example:9092,kafka-1.example:9092"}})),
    "otel": (("collector", {"otel": {"collector": {"enabled": True}}}),
             ("existing", {"otel": {"collector": {"enabled": False}, "endpoint": "http://otel.monitoring:4318"}})),
    "learner": (("gpu", {"learner": {"gpu": {"enabled": True}}}),
                ("cpu", {"learner": {"gpu": {"enabled": False}}})),
}


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


@dataclass(frozen=True)
class Combo:
    """One combination of the main switches."""

    name: str
    values: dict[str, Any]
    kafka: str
    otel: str
    learner: str


def combos() -> list[Combo]:
    """Every combination of SWITCHES (2 x 2 x 2)."""
    out = []
    for picks in itertools.product(*SWITCHES.values()):
        values: dict[str, Any] = {}
        for _, overrides in picks:
            _merge(values, json.loads(json.dumps(overrides)))
        names = [label for label, _ in picks]
        out.append(Combo("-".join(names), values, *names))
    return out


def install_helm() -> Path:
    """Build (once, cached) and return the helm binary; raise with the script's output if that fails."""
    proc = subprocess.run(["bash", str(SCRIPTS / "install.sh")], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/helm/install.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def strimzi_crds() -> Path:
    """Generate (once, cached) Strimzi's CRDs from Maven Central; return their folder."""
    proc = subprocess.run(["bash", str(SCRIPTS / "strimzi_crds.sh")], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/helm/strimzi_crds.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Helm:
    """The helm binary with the chart's usual arguments."""

    binary: Path

    def run(self, *args: str, values: dict[str, Any] | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), *args]
        if values:
            assert tmp is not None
            tmp.mkdir(parents=True, exist_ok=True)
            path = tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
            path.write_text(yaml.safe_dump(values))
            argv += ["-f", str(path)]
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)

    def lint(self, values: dict[str, Any] | None, tmp: Path) -> subprocess.CompletedProcess[str]:
        return self.run("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, values=values, tmp=tmp)

    def template(self, values: dict[str, Any] | None, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                        *extra, values=values, tmp=tmp)

    def render(self, values: dict[str, Any] | None, tmp: Path, *extra: str) -> list[dict[str, Any]]:
        """Rendered objects (tests included); raise with helm's message if rendering fails."""
        proc = self.template(values, tmp, *extra)
        if proc.returncode != 0:
            raise RuntimeError(f"helm template failed:\n{proc.stderr}")
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    """Objects of a kind whose name ends with name_suffix."""
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str) -> dict[str, Any]:
    matches = find(objects, kind, name_suffix)
    assert len(matches) == 1, f"expected one {kind} named *{name_suffix}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def env_of(workload: dict[str, Any], container: int = 0) -> dict[str, str]:
    """Plain (value) environment variables of a workload's container."""
    spec = workload["spec"]["template"]["spec"]["containers"][container]
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}


# --- instruments defined in code ---------------------------------------------------------------

INSTRUMENT_FACTORIES = {
    "create_counter": "counter",
    "create_up_down_counter": "updowncounter",
    "create_histogram": "histogram",
    "create_gauge": "gauge",
    "create_observable_counter": "counter",
    "create_observable_up_down_counter": "updowncounter",
    "create_observable_gauge": "gauge",
}
CODE_PACKAGES = ("schemas", "stream", "openforge", "producers", "proxy", "consumers", "learner")


@dataclass(frozen=True)
class Instrument:
    """One OpenTelemetry instrument as the code creates it."""

    name: str
    kind: str
    unit: str
    where: str


def module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` (or ``NAME: str = "text"``) assignments of a module, bound once."""
    found: dict[str, str] = {}
    rebound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            if target.id in found or not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                rebound.add(target.id)
            else:
                found[target.id] = value.value
    return {name: value for name, value in found.items() if name not in rebound}


def _literal(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    """A string literal, or a module constant naming one; None for anything computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def code_instruments(root: Path = REPO) -> list[Instrument]:
    """Every instrument created anywhere in the project's packages (read from the AST).

    The name at the ``create_*`` call must be a string literal or a module-level string constant of
    the same module (modules that keep their metric names in one place, like ``learner/metrics.py``).
    """
    found = []
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []:
            tree = ast.parse(path.read_text(), str(path))
            constants = module_constants(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                kind = INSTRUMENT_FACTORIES.get(node.func.attr)
                if kind is None:
                    continue
                name_node = node.args[0] if node.args else next(
                    (k.value for k in node.keywords if k.arg == "name"), None)
                name = _literal(name_node, constants)
                if name is None:
                    raise AssertionError(f"{path}:{node.lineno}: instrument name must be a string literal or a "
                                         "module-level string constant, so dashboards can be checked against it")
                unit_node = next((k.value for k in node.keywords if k.arg == "unit"), None)
                if unit_node is None and len(node.args) > 1:
                    unit_node = node.args[1]
                unit = _literal(unit_node, constants) or ""
                found.append(Instrument(name, kind, unit, f"{path.relative_to(root)}:{node.lineno}"))
    return found


# OpenTelemetry -> Prometheus name translation (the collector's Prometheus exporter with metric suffixes on,
# per OpenTelemetry's Prometheus compatibility specification).
_UNIT_WORDS = {
    "s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds", "min": "minutes",
    "h": "hours", "d": "days", "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "bit": "bits", "%": "percent",
    "Hz": "hertz", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "Cel": "celsius", "m": "meters",
}
_PER_WORDS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}


def _unit_suffix(unit: str, kind: str) -> str:
    unit = re.sub(r"\{[^}]*\}", "", unit).strip()
    if not unit:
        return ""
    if unit == "1":
        return "ratio" if kind == "gauge" else ""
    main, _, per = unit.partition("/")
    words = _UNIT_WORDS.get(main, main) if main else ""
    if per:
        words = f"{words}_per_{_PER_WORDS.get(per, per)}" if words else f"per_{_PER_WORDS.get(per, per)}"
    return re.sub(r"[^a-zA-Z0-9_]", "_", words)


def prometheus_series(instrument: Instrument) -> set[str]:
    """The Prometheus series names an instrument appears as."""
    base = re.sub(r"[^a-zA-Z0-9_:]", "_", instrument.name)
    base = re.sub(r"__+", "_", base)
    suffix = _unit_suffix(instrument.unit, instrument.kind)
    if suffix and not base.endswith(f"_{suffix}"):
        base = f"{base}_{suffix}"
    if instrument.kind == "counter":
        return {base if base.endswith("_total") else f"{base}_total"}
    if instrument.kind == "histogram":
        return {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return {base}


# --- dashboards ---------------------------------------------------------------------------------

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def dashboard_files() -> list[Path]:
    return sorted((CHART / "dashboards").glob("*.json"))


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of a dashboard."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))
    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*", query)
            yield f"variable {variable['name']!r}", match.group(1) if match else query


def substitute_grafana_variables(expr: str) -> str:
    """Grafana's variables are not PromQL; replace them with values of the right shape before parsing."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return re.sub(r"\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects, from the real PromQL parser's syntax tree."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)
            return
        if isinstance(node, promql_parser.MatrixSelector):
            visit(node.vector_selector)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                visit(arg)
        elif isinstance(node, promql_parser.AggregateExpr):
            visit(node.expr)
            if node.param is not None:
                visit(node.param)
        elif isinstance(node, promql_parser.BinaryExpr):
            visit(node.lhs)
            visit(node.rhs)
        elif isinstance(node, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr):
            visit(node.expr)

    visit(promql_parser.parse(substitute_grafana_variables(expr)))
    return names


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Deployments and StatefulSets."""
    return find(objects, "Deployment") + find(objects, "StatefulSet")


def process(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The workload that runs one OpenForge process (the proxy is a StatefulSet, the rest Deployments)."""
    return one(objects, "StatefulSet" if name == "proxy" else "Deployment", f"-{name}")
