"""The rollout pod manifest, built without a server (the real server accepts it in integration tests)."""

from __future__ import annotations

import json

import pytest
from kubeapi import make_spec, make_task

from consumers.rollouts.kubernetes import KubernetesSettings, build_pod, build_secret
from schemas.rollout.pod import FINALIZER, LABEL_TASK, label_value

SETTINGS = KubernetesSettings(namespace="ns", server="https://127.0.0.1:1")


def test_tokens_are_only_in_the_secret_and_the_verifier_token_only_reaches_the_verifier() -> None:
    spec = make_spec(make_task(), 0)
    pod = build_pod(spec, SETTINGS)
    assert "token-" not in json.dumps(pod)
    harness_refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in pod["spec"]["initContainers"][0]["env"]
                    if "valueFrom" in e}
    verifier_refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in pod["spec"]["containers"][0]["env"]
                     if "valueFrom" in e}
    assert "OPENFORGE_VERIFIER_TOKEN" not in harness_refs
    assert verifier_refs == harness_refs | {"OPENFORGE_VERIFIER_TOKEN"}
    secret = build_secret(spec, SETTINGS, "uid-1")
    assert secret["stringData"]["OPENFORGE_VERIFIER_TOKEN"] == f"verifier-token-{spec.rollout_id}"


def test_ids_that_are_not_label_values_get_stable_valid_stand_ins() -> None:
    long_id = "task/" + "x" * 100
    value = label_value(long_id)
    assert len(value) <= 63 and value == label_value(long_id) and value != label_value(long_id + "y")
    spec = make_spec(make_task("ok-task"), 0)
    assert build_pod(spec, SETTINGS)["metadata"]["labels"][LABEL_TASK] == "ok-task"


def test_deadline_is_rounded_up_to_whole_seconds() -> None:
    spec = make_spec(make_task(timeout_s=12.2), 0)
    assert build_pod(spec, SETTINGS)["spec"]["activeDeadlineSeconds"] == 13


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_KUBE_NAMESPACE", "rollouts-a")
    monkeypatch.setenv("OPENFORGE_KUBE_IMAGE_PULL_POLICY", "Always")
    settings = KubernetesSettings()
    assert (settings.namespace, settings.image_pull_policy) == ("rollouts-a", "Always")


def test_every_pod_carries_the_watchers_finalizer() -> None:
    # Without it a pod deleted while no watcher watches would vanish without a terminal event.
    assert build_pod(make_spec(make_task(), 0), SETTINGS)["metadata"]["finalizers"] == [FINALIZER]
