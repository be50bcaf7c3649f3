"""The Kubernetes rollout backend against a real kube-apiserver (with the launcher's RBAC)."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubeapi import make_spec, make_task
from kubernetes_asyncio import client as k8s

from consumers.rollouts.backend import ENV_AGENT_KEYS, ENV_REWARD_URL, ENV_VERIFIER_TOKEN, RolloutBackend
from consumers.rollouts.kubernetes import KubernetesBackend, PodRejectedError, build_pod, secret_name
from schemas.rollout.pod import ANNOTATION_ROLLOUT_ID, LABEL_MANAGED_BY, LABEL_ROLLOUT, LABEL_RUN, LABEL_TASK
from schemas.task.v1 import ContainerLaunch, HarnessSpec, LocalLaunch

pytestmark = pytest.mark.kube


async def test_pod_spec_is_accepted_and_keeps_the_verifier_token_from_the_harness(kube_settings, kube_admin,
                                                                                    kube_namespace) -> None:
    task = make_task()
    spec = make_spec(task, 1)
    async with KubernetesBackend(kube_settings) as backend:
        assert isinstance(backend, RolloutBackend)
        assert await backend.launch(spec) is True

    core = k8s.CoreV1Api(kube_admin)
    pod = await core.read_namespaced_pod(spec.name, kube_namespace)
    raw = json.dumps(kube_admin.sanitize_for_serialization(pod))
    assert "verifier-token-" not in raw and "agent-token-" not in raw, "a token leaked into the pod spec"
    assert pod.metadata.labels[LABEL_MANAGED_BY] == "openforge"
    assert pod.metadata.labels[LABEL_TASK] == task.task_id
    assert pod.metadata.labels[LABEL_ROLLOUT] == spec.rollout_id
    assert pod.metadata.labels[LABEL_RUN] == "run-7"
    assert pod.metadata.annotations[ANNOTATION_ROLLOUT_ID] == spec.rollout_id
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.active_deadline_seconds == 600
    assert pod.spec.automount_service_account_token is False
    assert pod.spec.volumes[0].empty_dir is not None

    (harness,) = pod.spec.init_containers
    (verifier,) = pod.spec.containers
    assert harness.image == "registry.example/agent:1.2" and harness.command == ["agent", "run"]
    assert verifier.image == "registry.example/env:3" and verifier.command == ["python", "-m", "verify"]
    assert harness.volume_mounts[0].mount_path == verifier.volume_mounts[0].mount_path == "/workspace"
    assert harness.resources.requests == {"cpu": "500m", "memory": "1Gi"}
    assert harness.resources.limits == {"memory": "1Gi"}

    h_env = {e.name: e for e in harness.env}
    v_env = {e.name: e for e in verifier.env}
    assert ENV_VERIFIER_TOKEN not in h_env and ENV_REWARD_URL not in h_env
    assert h_env["OPENAI_BASE_URL"].value == f"http://proxy.openforge:8000/rollouts/{spec.rollout_id}/v1"
    assert h_env["AGENT_MODE"].value == "headless"
    for key in ENV_AGENT_KEYS:
        assert h_env[key].value is None
        assert h_env[key].value_from.secret_key_ref.name == secret_name(spec.name)
    assert v_env[ENV_VERIFIER_TOKEN].value_from.secret_key_ref.key == ENV_VERIFIER_TOKEN
    assert v_env[ENV_REWARD_URL].value.endswith(f"/rollouts/{spec.rollout_id}/reward")

    secret = await core.read_namespaced_secret(secret_name(spec.name), kube_namespace)
    assert secret.metadata.owner_references[0].uid == pod.metadata.uid
    assert secret.metadata.owner_references[0].kind == "Pod"
    assert set(secret.data) == {*ENV_AGENT_KEYS, ENV_VERIFIER_TOKEN}


async def test_launch_is_idempotent_and_existing_lists_by_label(kube_settings, kube_admin, kube_namespace) -> None:
    task = make_task(group_size=3)
    specs = [make_spec(task, i) for i in range(3)]
    async with KubernetesBackend(kube_settings) as backend:
        assert await backend.existing() == set()
        assert [await backend.launch(s) for s in specs] == [True, True, True]
        assert [await backend.launch(s) for s in specs] == [False, False, False]
        assert await backend.existing() == {s.rollout_id for s in specs}
        assert await backend.active() == {s.rollout_id for s in specs}

        # A finished pod still exists (for reconciliation) but no longer counts as active.
        core = k8s.CoreV1Api(kube_admin)
        await core.patch_namespaced_pod_status(specs[0].name, kube_namespace, {"status": {"phase": "Succeeded"}},
                                               _content_type="application/merge-patch+json")
        assert await backend.active() == {specs[1].rollout_id, specs[2].rollout_id}
        assert await backend.existing() == {s.rollout_id for s in specs}
    pods = await core.list_namespaced_pod(kube_namespace)
    assert sorted(p.metadata.name for p in pods.items) == sorted(s.name for s in specs)


async def test_launcher_killed_mid_batch_and_restarted_launches_nothing_twice(kube_settings, kube_admin,
                                                                              kube_namespace) -> None:
    task = make_task(group_size=8)
    specs = [make_spec(task, i) for i in range(8)]
    core = k8s.CoreV1Api(kube_admin)

    # First launcher: launches concurrently and is killed (cancelled) part-way through the batch.
    first = KubernetesBackend(kube_settings)
    await first.start()
    launches = [asyncio.create_task(first.launch(s)) for s in specs[:5]]
    done, pending = await asyncio.wait(launches, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    await asyncio.gather(*launches, return_exceptions=True)
    await first.stop()
    # ... and one more that died between creating the pod and its Secret.
    await core.create_namespaced_pod(kube_namespace, build_pod(specs[5], kube_settings))
    before = {p.metadata.name: p.metadata.uid for p in (await core.list_namespaced_pod(kube_namespace)).items}
    assert len(done) >= 1 and specs[5].name in before

    # The restarted launcher reconciles from what exists, then launches the whole batch again.
    async with KubernetesBackend(kube_settings) as second:
        existing = await second.existing()
        assert existing == {s.rollout_id for s in specs if s.name in before}
        results = {s.rollout_id: await second.launch(s) for s in specs}
    assert {rid for rid, created in results.items() if created} == {s.rollout_id for s in specs} - existing

    after = {p.metadata.name: p.metadata.uid for p in (await core.list_namespaced_pod(kube_namespace)).items}
    assert sorted(after) == sorted(s.name for s in specs), "a pod is missing or doubled"
    assert all(after[name] == uid for name, uid in before.items()), "an existing pod was replaced"
    # The launch that died before its Secret was repaired by the relaunch.
    secret = await core.read_namespaced_secret(secret_name(specs[5].name), kube_namespace)
    assert secret.metadata.owner_references[0].uid == before[specs[5].name]


async def test_local_launch_task_is_refused_with_a_clear_error_and_creates_nothing(kube_settings, kube_admin,
                                                                                   kube_namespace) -> None:
    task = make_task().model_copy(update={"harness": HarnessSpec(name="h", launch=LocalLaunch(command=["agent"]))})
    async with KubernetesBackend(kube_settings) as backend:
        with pytest.raises(ValueError, match="harness.launch.kind='container'"):
            await backend.launch(make_spec(task, 0))
        bad_name = make_spec(make_task(), 0)
        with pytest.raises(ValueError, match="not a DNS-1123 label"):
            await backend.launch(type(bad_name)(**{**bad_name.__dict__, "name": "Not_A_Name"}))
    assert (await k8s.CoreV1Api(kube_admin).list_namespaced_pod(kube_namespace)).items == []


async def test_pod_the_server_rejects_raises_pod_rejected_with_its_reason(kube_settings, kube_admin,
                                                                          kube_namespace) -> None:
    harness = HarnessSpec(name="h", launch=ContainerLaunch(image=" registry.example/agent:1", command=["a"]))
    task = make_task().model_copy(update={"harness": harness})
    async with KubernetesBackend(kube_settings) as backend:
        with pytest.raises(PodRejectedError, match="whitespace"):
            await backend.launch(make_spec(task, 0))
    assert (await k8s.CoreV1Api(kube_admin).list_namespaced_pod(kube_namespace)).items == []
