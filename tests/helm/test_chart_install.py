"""`helm install --wait` of the chart on the simulated cluster (real control plane, kwok nodes).

The scheduler places every pod, the controller manager runs the Deployments, the StatefulSets (the
proxy's and vLLM's) and the PodDisruptionBudget, and kwok reports the placed pods running
(nothing runs their images). Two settings stand in for what this cluster lacks: Kafka is an
external cluster's address (nothing answers there; no process runs to connect), and the
checkpoint claim binds to a static PersistentVolume made by the test, as no provisioner exists.
NetworkPolicies are accepted by the API server's validation; no network plugin enforces them here.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import CHART, NAMESPACE, RELEASE, Helm
from simcluster import SimCluster

pytestmark = pytest.mark.cluster

VALUES = {"kafka": {"mode": "external", "bootstrapServers": "kafka-0.example:9092"}}


def _get(cluster: SimCluster, path: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.request("GET", path)
    return result


def _wait(what: str, check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_helm_install_waits_for_running_pods_with_external_kafka_and_a_static_persistent_volume(
        sim_cluster: SimCluster, helm: Helm, tmp_path: Path) -> None:
    volume = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": "checkpoints-static"},
              "spec": {"capacity": {"storage": "200Gi"}, "accessModes": ["ReadWriteMany"],
                       "persistentVolumeReclaimPolicy": "Retain",
                       "nfs": {"server": "nfs.example", "path": "/exports/checkpoints"}}}
    sim_cluster.request("POST", "/api/v1/persistentvolumes", volume)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUES))
    proc = subprocess.run(
        [str(helm.binary), "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
         "--kubeconfig", str(sim_cluster.kubeconfig), "-f", str(values), "--wait", "--timeout", "5m"],
        capture_output=True, text=True, check=False, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]

    ns = f"/namespaces/{NAMESPACE}"
    deployments = _get(sim_cluster, f"/apis/apps/v1{ns}/deployments")["items"]
    assert len(deployments) >= 5
    for d in deployments:
        assert d["status"].get("readyReplicas") == d["spec"]["replicas"], (d["metadata"]["name"], d["status"])
    statefulsets = _get(sim_cluster, f"/apis/apps/v1{ns}/statefulsets")["items"]
    for s in statefulsets:
        assert s["status"].get("readyReplicas") == s["spec"]["replicas"], (s["metadata"]["name"], s["status"])
    pods = _get(sim_cluster, f"/api/v1{ns}/pods")["items"]
    expected = sum(d["spec"]["replicas"] for d in [*deployments, *statefulsets])
    running = [p for p in pods if p["status"].get("phase") == "Running" and p["spec"].get("nodeName")]
    assert len(running) == expected, [(p["metadata"]["name"], p["status"].get("phase")) for p in pods]
    # GPU workloads landed on the nodes that have GPUs.
    gpu_nodes = set(sim_cluster.node_names[:sim_cluster.gpu_nodes])
    for p in running:
        limits = [c.get("resources", {}).get("limits", {}) for c in p["spec"]["containers"]]
        if any("nvidia.com/gpu" in limit for limit in limits):
            assert p["spec"]["nodeName"] in gpu_nodes

    claim = _get(sim_cluster, f"/api/v1{ns}/persistentvolumeclaims")["items"][0]
    assert (claim["status"]["phase"], claim["spec"]["volumeName"]) == ("Bound", "checkpoints-static")

    policies = _get(sim_cluster, f"/apis/networking.k8s.io/v1{ns}/networkpolicies")["items"]
    assert len(policies) == 5

    # The disruption controller took up the proxy's budget.
    pdb = _wait("the PDB's status", lambda: next(
        (b for b in _get(sim_cluster, f"/apis/policy/v1{ns}/poddisruptionbudgets")["items"]
         if b.get("status", {}).get("observedGeneration")), None))
    proxy = next(d for d in statefulsets if d["metadata"]["name"].endswith("-proxy"))
    assert (pdb["status"]["expectedPods"], pdb["status"]["currentHealthy"]) == (proxy["spec"]["replicas"],) * 2
    assert pdb["status"]["disruptionsAllowed"] == 1

    uninstall = subprocess.run(
        [str(helm.binary), "uninstall", RELEASE, "--namespace", NAMESPACE, "--kubeconfig", str(sim_cluster.kubeconfig),
         "--wait", "--timeout", "2m"], capture_output=True, text=True, check=False, timeout=200)
    assert uninstall.returncode == 0, uninstall.stderr[-2000:]
