"""The shipped Roles, applied to the real API server: allowed in the rollout namespace, nowhere else."""

from __future__ import annotations

import uuid

import pytest
from kubeapi import make_spec, make_task, rbac_documents
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from consumers.rollouts.kubernetes import build_pod

pytestmark = pytest.mark.kube


def test_shipped_rbac_is_namespaced_only() -> None:
    docs = rbac_documents("x")
    assert {d["kind"] for d in docs} == {"Role", "RoleBinding"}
    for doc in docs:
        if doc["kind"] == "Role":
            for rule in doc["rules"]:
                assert rule["apiGroups"] == [""] and "*" not in rule["verbs"] and "*" not in rule["resources"]


async def _forbidden(call) -> None:
    with pytest.raises(ApiException) as info:
        await call
    assert info.value.status == 403, info.value


async def test_launcher_credentials_work_in_their_namespace_and_are_refused_elsewhere(
        kube_settings, kube_admin, launcher_client, kube_namespace) -> None:
    admin = k8s.CoreV1Api(kube_admin)
    other = f"t-other-{uuid.uuid4().hex[:6]}"
    await admin.create_namespace({"metadata": {"name": other}})
    await admin.create_namespaced_service_account(other, {"metadata": {"name": "default"}})
    launcher = k8s.CoreV1Api(launcher_client)
    spec = make_spec(make_task(), 0)

    # Allowed: what the backend uses, in the rollout namespace.
    await launcher.create_namespaced_pod(kube_namespace, build_pod(spec, kube_settings))
    await launcher.read_namespaced_pod(spec.name, kube_namespace)
    await launcher.list_namespaced_pod(kube_namespace)
    await launcher.create_namespaced_secret(kube_namespace, {"metadata": {"name": "s1"}, "stringData": {"k": "v"}})

    # Refused: the same verbs in another namespace, anything cluster-wide, reading secrets, deleting pods.
    other_settings = kube_settings.model_copy(update={"namespace": other})
    await _forbidden(launcher.create_namespaced_pod(other, build_pod(spec, other_settings)))
    await _forbidden(launcher.list_namespaced_pod(other))
    await _forbidden(launcher.list_pod_for_all_namespaces())
    await _forbidden(launcher.list_namespace())
    await _forbidden(launcher.list_node())
    await _forbidden(launcher.read_namespaced_secret("s1", kube_namespace))
    await _forbidden(launcher.delete_namespaced_pod(spec.name, kube_namespace))
    await _forbidden(k8s.RbacAuthorizationV1Api(launcher_client).list_namespaced_role(kube_namespace))


async def test_watcher_credentials_watch_patch_delete_pods_only_in_their_namespace(
        kube_settings, kube_admin, watcher_client, kube_namespace) -> None:
    admin = k8s.CoreV1Api(kube_admin)
    spec = make_spec(make_task(), 0)
    await admin.create_namespaced_pod(kube_namespace, build_pod(spec, kube_settings))
    await admin.create_namespaced_secret(kube_namespace, {"metadata": {"name": "s1"}, "stringData": {"k": "v"}})
    watcher = k8s.CoreV1Api(watcher_client)

    await watcher.list_namespaced_pod(kube_namespace, watch=False)
    await watcher.patch_namespaced_pod(spec.name, kube_namespace, {"metadata": {"annotations": {"a": "b"}}})
    await _forbidden(watcher.read_namespaced_secret("s1", kube_namespace))
    await _forbidden(watcher.create_namespaced_pod(kube_namespace, build_pod(make_spec(make_task(), 1),
                                                                             kube_settings)))
    await _forbidden(watcher.list_pod_for_all_namespaces())
    await _forbidden(watcher.list_namespaced_pod("default"))
    await watcher.delete_namespaced_pod(spec.name, kube_namespace)
