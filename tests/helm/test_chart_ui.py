"""The chart's flight recorder: off by default; when on, one pod behind its own credential Secret."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from helm_chart import KUBE_VERSION, Helm, env_of, find, one
from test_chart_env_names import env_names

from openforge.ui.settings import UISettings
from stream.consumer import ConsumerSettings
from stream.settings import KafkaSettings


def test_the_ui_is_off_by_default(default_objects: list[dict[str, Any]]) -> None:
    names = [o["metadata"]["name"] for o in default_objects]
    assert not [n for n in names if n.endswith("-ui")]


@pytest.fixture(scope="module")
def with_ui(helm: Helm, helm_tmp: Path) -> list[dict[str, Any]]:
    return helm.render({"ui": {"enabled": True, "traceUrl": "https://grafana.example/explore?trace={trace_id}"}},
                       helm_tmp)


def test_the_ui_runs_behind_its_own_generated_credential(with_ui: list[dict[str, Any]], tmp_path: Path) -> None:
    secret = one(with_ui, "Secret", "-ui")
    credential = base64.b64decode(secret["data"]["credential"]).decode()
    assert len(credential) == 32
    deployment = one(with_ui, "Deployment", "-ui")
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["args"] == ["ui"] and deployment["spec"]["replicas"] == 1
    env = env_of(deployment)
    # Every address of the pod, so a credential is required: it comes from the Secret's file, never the env.
    assert env["OPENFORGE_UI_HOST"] == "0.0.0.0"
    assert credential not in str(container["env"])
    volume = next(v for v in spec["volumes"] if v["name"] == "ui-credential")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "ui-credential")
    path = Path(env["OPENFORGE_UI_CREDENTIAL_FILE"])
    assert path.parent == Path(mount["mountPath"]) and path.name in secret["data"]
    # What the pod's settings make of it: the Secret's value, accepted.
    mounted = tmp_path / path.name
    mounted.write_bytes(base64.b64decode(secret["data"][path.name]))
    assert UISettings(credential_file=mounted).credential_value() == credential
    assert env["OPENFORGE_UI_TRACE_URL"] == "https://grafana.example/explore?trace={trace_id}"
    # The index lives on the pod's own bounded volume.
    index = next(v for v in spec["volumes"] if v["name"] == "ui-index")
    assert index["emptyDir"]["sizeLimit"] == "4Gi"
    assert Path(env["OPENFORGE_UI_INDEX_PATH"]).parent == Path(
        next(m for m in container["volumeMounts"] if m["name"] == "ui-index")["mountPath"])
    service = one(with_ui, "Service", "-ui")
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == 8200
    assert "checksum/ui-credential" in deployment["spec"]["template"]["metadata"]["annotations"]


def test_every_ui_variable_is_read_by_its_settings(with_ui: list[dict[str, Any]]) -> None:
    names = {n for n in env_of(one(with_ui, "Deployment", "-ui")) if n.startswith("OPENFORGE_")}
    valid = env_names(UISettings) | env_names(KafkaSettings) | env_names(ConsumerSettings)
    assert names - valid == set()


def test_the_ui_objects_validate_strict(with_ui: list[dict[str, Any]]) -> None:
    for obj in find(with_ui, "Deployment", "-ui") + find(with_ui, "Service", "-ui") + find(with_ui, "Secret", "-ui"):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_a_given_or_existing_credential(helm: Helm, helm_tmp: Path) -> None:
    given = helm.render({"ui": {"enabled": True, "credential": "0123456789abcdef-given"}}, helm_tmp)
    assert base64.b64decode(one(given, "Secret", "-ui")["data"]["credential"]) == b"0123456789abcdef-given"
    existing = helm.render({"ui": {"enabled": True, "existingSecret": "my-ui"}}, helm_tmp)
    assert find(existing, "Secret", "-ui") == []
    spec = one(existing, "Deployment", "-ui")["spec"]["template"]["spec"]
    assert next(v for v in spec["volumes"] if v["name"] == "ui-credential")["secret"]["secretName"] == "my-ui"
    with pytest.raises(RuntimeError, match="at least 16 characters"):
        helm.render({"ui": {"enabled": True, "credential": "short"}}, helm_tmp)
