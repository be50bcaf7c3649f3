"""Every OPENFORGE_* variable the chart sets is a setting some process reads.

The valid names are derived from the processes' pydantic settings classes (prefix + field name, and
any validation aliases), so a renamed field fails here instead of being silently ignored by a pod.
"""

from __future__ import annotations

from typing import Any

import pytest
from helm_chart import Combo
from pydantic import AliasChoices, AliasPath
from pydantic_settings import BaseSettings

from consumers.assembler.settings import AssemblerSettings
from consumers.publisher import PublisherSettings
from consumers.rollouts.kubernetes import KubernetesSettings
from consumers.rollouts.launcher import LauncherSettings
from learner.settings import LearnerSettings
from producers.pod_watcher import PodWatcherSettings
from proxy.settings import ProxySettings
from stream.consumer import ConsumerSettings
from stream.settings import KafkaSettings

# Which settings classes each chart component's process reads (its own, plus shared ones).
PROCESS_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "proxy": (ProxySettings, KafkaSettings),
    "assembler": (AssemblerSettings, KafkaSettings),
    "learner": (LearnerSettings, KafkaSettings),
    "publisher": (PublisherSettings, KafkaSettings, ConsumerSettings),
    "launcher": (LauncherSettings, KubernetesSettings, KafkaSettings),
    "watcher": (PodWatcherSettings, KubernetesSettings, KafkaSettings),
}


def env_names(settings: type[BaseSettings]) -> set[str]:
    """Environment variable names a settings class reads (nested settings fields excluded)."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    names = set()
    for field_name, field in settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseSettings):
            continue  # a nested settings object reads its own prefix
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {choice for choice in alias.choices if isinstance(choice, str)}
        elif isinstance(alias, str):
            names.add(alias)
        elif not isinstance(alias, AliasPath):
            names.add(f"{prefix}{field_name}")
    return {name.upper() for name in names}


def _component(workload: dict[str, Any]) -> str | None:
    return workload["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def chart_env(objects: list[dict[str, Any]]) -> dict[str, set[str]]:
    """OPENFORGE_* names set per component, over every container of every Deployment and StatefulSet."""
    out: dict[str, set[str]] = {}
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            names = {e["name"] for e in container.get("env", []) if e["name"].startswith("OPENFORGE_")}
            if names:
                out.setdefault(_component(obj) or obj["metadata"]["name"], set()).update(names)
    return out


def test_env_names_come_from_the_settings_classes() -> None:
    assert "OPENFORGE_PUBLISHER_REPLICAS" in env_names(PublisherSettings)
    assert "OPENFORGE_PROXY_CREDENTIAL_KEY_FILE" in env_names(LauncherSettings)  # an alias
    assert "OPENFORGE_PROXY_KAFKA" not in env_names(ProxySettings)  # nested settings read OPENFORGE_KAFKA_*


def test_every_chart_variable_is_read_by_its_process(rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    by_component = chart_env(rendered[combo.name])
    assert set(by_component) == set(PROCESS_SETTINGS), f"components with OPENFORGE_* env: {sorted(by_component)}"
    unread = {}
    for component, names in by_component.items():
        valid = set().union(*(env_names(s) for s in PROCESS_SETTINGS[component]))
        if names - valid:
            unread[component] = sorted(names - valid)
    assert not unread, f"the chart sets variables no settings class of that process reads: {unread}"


@pytest.mark.parametrize("bogus", ["OPENFORGE_ASSEMBLER_GROUPID"])
def test_a_misspelt_variable_is_caught(default_objects: list[dict[str, Any]], bogus: str) -> None:
    """Guards the check itself: a name no settings class reads is reported."""
    objects = [dict(o) for o in default_objects]
    assembler = next(o for o in objects if o["kind"] == "Deployment" and _component(o) == "assembler")
    container = {**assembler["spec"]["template"]["spec"]["containers"][0]}
    container["env"] = [*container["env"], {"name": bogus, "value": "x"}]
    names = chart_env([{**assembler, "spec": {"template": {"spec": {"containers": [container]}}}}])["assembler"]
    assert bogus in names and bogus not in set().union(*(env_names(s) for s in PROCESS_SETTINGS["assembler"]))
