"""A simulated cluster: the real control plane, with kwok playing the kubelets of fake nodes.

etcd, kube-apiserver, kube-scheduler and kube-controller-manager are the real programs (built by
``scripts/kube/install.sh``); only the nodes are simulated. kwok registers nothing itself: the
cluster creates ``nodes`` Node objects with capacity set, kwok keeps their leases and status, and
moves the pods the scheduler binds to them through the stages below, as a kubelet would.

Rollout pods (``app.kubernetes.io/managed-by=openforge``) get randomised lifecycles: their harness
starts after a pull-and-start delay, runs for a random time, then the verifier runs; at each step
kwok picks the next stage by weight, so a share of them fail the way pods fail on real clusters:

* image pull errors (``ErrImagePull``, then ``ImagePullBackOff``; the watcher writes them off after
  its ``image_pull_timeout_s``),
* OOM kills of the harness or the verifier (``OOMKilled``, exit 137),
* evictions under node memory pressure (phase Failed, reason ``Evicted``),
* harness and verifier exits non-zero (the policy's failure and the verifier's).

:meth:`SimCluster.fail_node` makes one node report ``Ready=False`` (kwok's chaos stage) and freezes
the rollout pods on it, as a dead kubelet leaves them: the node lifecycle controller taints it
``NoExecute`` and the taint-eviction controller deletes its pods after their toleration (the API
server's default, set short here), as on a real cluster. Frozen pods cannot finish first, so every
node failure loses rollouts. Other pods
(the chart's Deployments) start and keep running.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from kubeapi import KubeAPI, KubeAPIError, _Proc
from netutil import free_port

from schemas.rollout.pod import LABEL_MANAGED_BY, MANAGED_BY

NODE_LABEL = "openforge.dev/simulated-node"
"""Label of the fake nodes; kwok manages exactly these."""
FAULT_LABEL = "openforge.dev/fault"
"""``not-ready`` on a node makes kwok report it NotReady."""
TOLERATION_S = 5
"""How long pods tolerate a not-ready or unreachable node before eviction (a real cluster: 300 s)."""

_ROLLOUT = {"key": f'.metadata.labels["{LABEL_MANAGED_BY}"]', "operator": "In", "values": [MANAGED_BY]}
_NOT_ROLLOUT = {"key": f'.metadata.labels["{LABEL_MANAGED_BY}"]', "operator": "NotIn", "values": [MANAGED_BY]}
_ALIVE = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
_NOT_FROZEN = {"key": f'.metadata.labels["{FAULT_LABEL}"]', "operator": "DoesNotExist"}
"""Pods on a failed node carry the fault label and move no further (nobody reports their state)."""


def _phase(*values: str) -> dict[str, Any]:
    return {"key": ".status.phase", "operator": "In", "values": list(values)}


# Go templates kwok renders into a status patch. `$now` is RFC 3339 with nanoseconds.
_PLACED = """\
{{ $now := Now }}
conditions:
- {type: Initialized, status: "False", reason: ContainersNotInitialized, lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
initContainerStatuses:
{{ range .spec.initContainers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: false, restartCount: 0, started: false,
   state: {waiting: {reason: WAITING_REASON, message: WAITING_MESSAGE}}}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: false, restartCount: 0, started: false,
   state: {waiting: {reason: PodInitializing}}}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName false .metadata.uid .metadata.name .metadata.namespace | Quote }}
startTime: {{ $now | Quote }}
phase: Pending
"""

_BACKOFF = """\
initContainerStatuses:
{{ range .spec.initContainers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: false, restartCount: 0, started: false,
   state: {waiting: {reason: ImagePullBackOff, message: {{ printf "Back-off pulling image %q" .image | Quote }}}}}
{{ end }}
"""

_HARNESS_RUNNING = """\
{{ $now := Now }}
initContainerStatuses:
{{ range .spec.initContainers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: false, restartCount: 0, started: true,
   state: {running: {startedAt: {{ $now | Quote }}}}}
{{ end }}
"""

# The harness ended with EXIT (REASON); the pod goes on to run the verifier when EXIT is 0 and
# fails otherwise, as the kubelet does with a failed init container under restartPolicy Never.
_HARNESS_ENDED = """\
{{ $now := Now }}
{{ $root := . }}
initContainerStatuses:
{{ range $i, $c := .spec.initContainers }}
{{ $started := (index $root.status.initContainerStatuses $i).state.running.startedAt }}
- {name: {{ $c.name | Quote }}, image: {{ $c.image | Quote }}, imageID: "", ready: false, restartCount: 0, started: false,
   state: {terminated: {exitCode: EXIT, reason: REASON, startedAt: {{ $started | Quote }}, finishedAt: {{ $now | Quote }}}}}
{{ end }}
"""

_VERIFIER_RUNNING = _HARNESS_ENDED + """\
containerStatuses:
{{ range .spec.containers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: true, restartCount: 0, started: true,
   state: {running: {startedAt: {{ $now | Quote }}}}}
{{ end }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
phase: Running
"""

_HARNESS_FAILED = _HARNESS_ENDED + """\
phase: Failed
"""

_VERIFIER_ENDED = """\
{{ $now := Now }}
{{ $root := . }}
containerStatuses:
{{ range $i, $c := .spec.containers }}
{{ $started := (index $root.status.containerStatuses $i).state.running.startedAt }}
- {name: {{ $c.name | Quote }}, image: {{ $c.image | Quote }}, imageID: "", ready: false, restartCount: 0, started: false,
   state: {terminated: {exitCode: EXIT, reason: REASON, startedAt: {{ $started | Quote }}, finishedAt: {{ $now | Quote }}}}}
{{ end }}
conditions:
- {type: Ready, status: "False", reason: PodCompleted, lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: PodCompleted, lastTransitionTime: {{ $now | Quote }}}
phase: PHASE
"""

# Node memory pressure: the kubelet kills the running container and fails the pod as Evicted.
_EVICTED = """\
{{ $now := Now }}
{{ $root := . }}
reason: Evicted
message: "The node was low on resource: memory. Threshold quantity: 100Mi, available: 52Mi."
conditions:
- {type: DisruptionTarget, status: "True", reason: TerminationByKubelet,
   message: "The node was low on resource: memory.", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: PodFailed, lastTransitionTime: {{ $now | Quote }}}
initContainerStatuses:
{{ range $i, $c := .spec.initContainers }}
{{ $started := (index $root.status.initContainerStatuses $i).state.running.startedAt }}
- {name: {{ $c.name | Quote }}, image: {{ $c.image | Quote }}, imageID: "", ready: false, restartCount: 0, started: false,
   state: {terminated: {exitCode: 137, reason: Error, startedAt: {{ $started | Quote }}, finishedAt: {{ $now | Quote }}}}}
{{ end }}
phase: Failed
"""

# Any other pod (the chart's Deployments): up and ready once placed, and running on.
_OTHER_RUNNING = """\
{{ $now := Now }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ if .spec.initContainers }}
initContainerStatuses:
{{ range .spec.initContainers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: true, restartCount: 0, started: false,
   state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}}
{{ end }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, imageID: "", ready: true, restartCount: 0, started: true,
   state: {running: {startedAt: {{ $now | Quote }}}}}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) .metadata.uid .metadata.name .metadata.namespace | Quote }}
startTime: {{ $now | Quote }}
phase: Running
"""

_NODE_CONDITIONS = """\
{{ $now := Now }}
{{ $since := or .metadata.creationTimestamp $now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $since | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type | Quote }}
{{ end }}
"""

_NODE_INITIALIZE = _NODE_CONDITIONS + """\
addresses:
- {type: InternalIP, address: {{ NodeIP | Quote }}}
- {type: Hostname, address: {{ NodeName | Quote }}}
{{ with NodePort }}
daemonEndpoints:
  kubeletEndpoint:
    Port: {{ . }}
{{ end }}
nodeInfo:
  architecture: amd64
  bootID: ""
  containerRuntimeVersion: kwok
  kernelVersion: kwok
  kubeProxyVersion: kwok
  kubeletVersion: kwok
  machineID: ""
  operatingSystem: linux
  osImage: kwok
  systemUUID: ""
phase: Running
"""

_NODE_NOT_READY = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
{{ if eq .type "Ready" }}
- {type: Ready, status: "False", reason: KubeletNotReady, message: "container runtime is down",
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
{{ else }}
- {type: {{ .type | Quote }}, status: {{ .status | Quote }}, reason: {{ .reason | Quote }}, message: {{ .message | Quote }},
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
{{ end }}
{{ end }}
"""


def _stage(name: str, kind: str, match: list[dict[str, Any]], template: str, *, delay_ms: tuple[int, int] = (0, 0),
           weight: int | None = None, delete: bool = False, **subs: str) -> dict[str, Any]:
    """One kwok Stage: when ``match`` holds, after a delay uniform in ``delay_ms``, patch the status."""
    for key, value in subs.items():
        template = template.replace(key, value)
    spec: dict[str, Any] = {"resourceRef": {"apiGroup": "v1", "kind": kind},
                            "selector": {"matchExpressions": match},
                            "next": {"delete": True} if delete else {"statusTemplate": template}}
    if weight is not None:
        spec["weight"] = weight
    if delay_ms[1] > 0:
        spec["delay"] = {"durationMilliseconds": delay_ms[0], "jitterDurationMilliseconds": delay_ms[1]}
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def stages(pace: float = 1.0, faults: bool = True) -> list[dict[str, Any]]:
    """kwok's stages for the simulated cluster; ``pace`` scales every rollout duration.

    At pace 1 a rollout pod lives about 5 to 25 s: 0.3-2 s to pull and start, a harness of 3-18 s,
    a verifier of 1-4 s. Without ``faults`` every rollout succeeds (the chart test).
    """
    def ms(low_s: float, high_s: float) -> tuple[int, int]:
        return int(low_s * 1000 * pace), int(high_s * 1000 * pace)

    w = (lambda n: n) if faults else (lambda n: 0)
    placed = [_ROLLOUT, _ALIVE, _NOT_FROZEN, {"key": ".status.podIP", "operator": "DoesNotExist"}]
    pulling = [_ROLLOUT, _ALIVE, _NOT_FROZEN, _phase("Pending"),
               {"key": ".status.initContainerStatuses.[].state.waiting.reason", "operator": "In",
                "values": ["ErrImagePull"]}]
    initialising = [_ROLLOUT, _ALIVE, _NOT_FROZEN, _phase("Pending"),
                    {"key": ".status.initContainerStatuses.[].state.waiting.reason", "operator": "In",
                     "values": ["PodInitializing"]}]
    harness_running = [_ROLLOUT, _ALIVE, _NOT_FROZEN, _phase("Pending"),
                       {"key": ".status.initContainerStatuses.[].state.running.startedAt", "operator": "Exists"}]
    verifier_running = [_ROLLOUT, _ALIVE, _NOT_FROZEN, _phase("Running"),
                        {"key": ".status.containerStatuses.[].state.running.startedAt", "operator": "Exists"}]
    pull_failure = '{{ printf "failed to pull and unpack image %q: not found" .image | Quote }}'
    return [
        # Nodes: ready once created, leases renewed by kwok itself; NotReady on demand.
        _stage("node-initialize", "Node",
               [{"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "NotIn",
                 "values": ["True"]},
                {"key": f'.metadata.labels["{FAULT_LABEL}"]', "operator": "DoesNotExist"}], _NODE_INITIALIZE),
        _stage("node-heartbeat", "Node",
               [{"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "In",
                 "values": ["True"]},
                {"key": f'.metadata.labels["{FAULT_LABEL}"]', "operator": "DoesNotExist"}],
               _NODE_CONDITIONS, delay_ms=(20_000, 25_000)),
        _stage("node-not-ready", "Node",
               [{"key": f'.metadata.labels["{FAULT_LABEL}"]', "operator": "In", "values": ["not-ready"]},
                {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "In",
                 "values": ["True"]}],
               _NODE_NOT_READY, delay_ms=(500, 1500)),
        # Rollout pods.
        _stage("rollout-placed", "Pod", placed, _PLACED, delay_ms=ms(0.1, 0.6), weight=100,
               WAITING_REASON="PodInitializing", WAITING_MESSAGE='""'),
        _stage("rollout-image-pull-error", "Pod", placed, _PLACED, delay_ms=ms(0.5, 2), weight=w(2),
               WAITING_REASON="ErrImagePull", WAITING_MESSAGE=pull_failure),
        _stage("rollout-image-pull-backoff", "Pod", pulling, _BACKOFF, delay_ms=ms(1, 3)),
        _stage("rollout-harness-started", "Pod", initialising, _HARNESS_RUNNING, delay_ms=ms(0.2, 1.4)),
        _stage("rollout-harness-done", "Pod", harness_running, _VERIFIER_RUNNING, delay_ms=ms(3, 18), weight=100,
               EXIT="0", REASON="Completed"),
        _stage("rollout-harness-exit-1", "Pod", harness_running, _HARNESS_FAILED, delay_ms=ms(3, 18),
               weight=w(4), EXIT="1", REASON="Error"),
        _stage("rollout-harness-oom-killed", "Pod", harness_running, _HARNESS_FAILED, delay_ms=ms(2, 12),
               weight=w(3), EXIT="137", REASON="OOMKilled"),
        _stage("rollout-evicted", "Pod", harness_running, _EVICTED, delay_ms=ms(2, 12), weight=w(3)),
        _stage("rollout-succeeded", "Pod", verifier_running, _VERIFIER_ENDED, delay_ms=ms(1, 4), weight=100,
               EXIT="0", REASON="Completed", PHASE="Succeeded"),
        _stage("rollout-verifier-oom-killed", "Pod", verifier_running, _VERIFIER_ENDED, delay_ms=ms(1, 4),
               weight=w(2), EXIT="137", REASON="OOMKilled", PHASE="Failed"),
        _stage("rollout-verifier-crashed", "Pod", verifier_running, _VERIFIER_ENDED, delay_ms=ms(1, 4),
               weight=w(1), EXIT="2", REASON="Error", PHASE="Failed"),
        # Every other pod runs until deleted.
        _stage("pod-running", "Pod", [_NOT_ROLLOUT, _ALIVE, {"key": ".status.podIP", "operator": "DoesNotExist"}],
               _OTHER_RUNNING, delay_ms=(200, 1000)),
        # Deleted pods go once their finalizers are done (the kubelet's confirmation of a graceful delete).
        _stage("pod-delete", "Pod",
               [{"key": ".metadata.deletionTimestamp", "operator": "Exists"},
                {"key": ".metadata.finalizers", "operator": "DoesNotExist"}], "", delay_ms=(100, 500), delete=True),
    ]


class SimCluster:
    """etcd, API server, scheduler, controller manager and kwok with ``nodes`` fake nodes."""

    def __init__(self, root: Path, bin_dir: Path, *, nodes: int = 20, node_cpu: str = "16",
                 node_memory: str = "64Gi", node_pods: int = 110, gpu_nodes: int = 4, pace: float = 1.0,
                 faults: bool = True) -> None:
        missing = [b for b in ("kube-scheduler", "kube-controller-manager", "kwok") if not (bin_dir / b).is_file()]
        if missing:
            raise KubeAPIError(f"{', '.join(missing)} missing in {bin_dir}: run `make kube` (scripts/kube/install.sh)")
        self.root = root
        self.bin_dir = bin_dir
        self.api = KubeAPI(root, bin_dir, apiserver_args=[
            f"--default-not-ready-toleration-seconds={TOLERATION_S}",
            f"--default-unreachable-toleration-seconds={TOLERATION_S}",
        ])
        self.node_names = [f"sim-node-{i:02d}" for i in range(nodes)]
        self.node_capacity = {"cpu": node_cpu, "memory": node_memory, "pods": str(node_pods)}
        self.gpu_nodes = gpu_nodes
        """The first nodes also have 8 ``nvidia.com/gpu`` (for the chart's vLLM and learner)."""
        self.pace = pace
        self.faults = faults
        self._procs: dict[str, _Proc] = {}
        self._counts: Counter[tuple[str, str, str]] = Counter()
        """apiserver_request_total of API-server lives that ended (a restart resets the counters)."""

    @property
    def kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def start(self) -> None:
        self.api.start()
        try:
            self._write_kubeconfig()
            (self.root / "kwok.yaml").write_text(yaml.safe_dump_all(stages(self.pace, self.faults), sort_keys=False))
            self._start_components()
            self._create_nodes()
            self._wait_nodes_ready()
        except BaseException:
            self.stop()
            raise

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "sim",
            "clusters": [{"name": "sim", "cluster": {"server": self.api.url,
                                                     "certificate-authority": str(self.api.ca_file)}}],
            "users": [{"name": "admin", "user": {"token": self.api.admin_token}}],
            "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "admin"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))

    def _start(self, name: str, args: list[str]) -> None:
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen([str(self.bin_dir / name), *args], stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._procs[name] = _Proc(process, log)

    def _start_components(self) -> None:
        kc = str(self.kubeconfig)
        common = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                  "--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false", "--v=1"]
        self._start("kube-scheduler", [*common, f"--secure-port={free_port()}",
                                       f"--cert-dir={self.root / 'scheduler-certs'}"])
        self._start("kube-controller-manager", [
            *common, f"--secure-port={free_port()}", f"--cert-dir={self.root / 'cm-certs'}",
            f"--service-account-private-key-file={self.api.pki / 'sa.key'}",
            f"--root-ca-file={self.api.ca_file}",
            "--use-service-account-credentials=false",
            # Notice a node's failure in seconds rather than the production default's 50 s.
            "--node-monitor-period=2s", "--node-monitor-grace-period=20s",
            "--concurrent-gc-syncs=5",
        ])
        self._start("kwok", [
            f"--kubeconfig={kc}", f"--config={self.root / 'kwok.yaml'}",
            f"--manage-nodes-with-label-selector={NODE_LABEL}=true",
            f"--server-address=127.0.0.1:{free_port()}",
            "--node-lease-duration-seconds=40", "--cidr=10.0.0.0/16", "--node-ip=10.255.0.1", "--v=WARN",
        ])

    def _create_nodes(self) -> None:
        for i, name in enumerate(self.node_names):
            capacity = {**self.node_capacity, **({"nvidia.com/gpu": "8"} if i < self.gpu_nodes else {})}
            node = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {NODE_LABEL: "true", "kubernetes.io/hostname": name,
                                                          "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
                                 "annotations": {"kwok.x-k8s.io/node": "fake"}},
                    "status": {"capacity": capacity, "allocatable": capacity}}
            self.request("POST", "/api/v1/nodes", node)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                content_type: str = "application/json") -> Any:
        """One call to the API server as the admin (plain HTTP, no client library)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.api.admin_token}", "Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=30, context=self.api.ssl_context()) as response:
            raw = response.read()
        return json.loads(raw) if raw[:1] == b"{" else raw.decode()

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.request("GET", f"/api/v1/nodes?labelSelector={NODE_LABEL}%3Dtrue")["items"])

    @staticmethod
    def ready(node: dict[str, Any]) -> bool:
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (node.get("status") or {}).get("conditions") or [])

    def _wait_nodes_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.process.poll() is not None:
                    raise KubeAPIError(f"{name} exited with {proc.process.returncode}:\n{proc.tail()}")
            if sum(self.ready(n) for n in self.nodes()) == len(self.node_names):
                return
            time.sleep(0.5)
        raise KubeAPIError(f"nodes not ready after {timeout_s:.0f} s:\n{self._procs['kwok'].tail()}")

    def fail_node(self, name: str) -> None:
        """Make ``name`` report NotReady and freeze its pods; the controllers then evict them (see the module docs)."""
        fault = {"metadata": {"labels": {FAULT_LABEL: "not-ready"}}}
        self.request("PATCH", f"/api/v1/nodes/{name}", fault, content_type="application/merge-patch+json")
        for pod in self.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{name}")["items"]:
            meta = pod["metadata"]
            with contextlib.suppress(urllib.error.HTTPError):  # gone meanwhile
                self.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", fault,
                             content_type="application/merge-patch+json")

    def restart_apiserver(self) -> None:
        """Stop and start the API server on the same port and etcd, keeping its request counts."""
        self._counts.update(self._scrape())
        self.api.server.restart()

    def _scrape(self) -> Counter[tuple[str, str, str]]:
        out: Counter[tuple[str, str, str]] = Counter()
        with contextlib.suppress(urllib.error.URLError, OSError):
            text = self.request("GET", "/metrics")
            for line in text.splitlines():
                if not line.startswith("apiserver_request_total{"):
                    continue
                labels, value = line[len("apiserver_request_total{"):].rsplit("} ", 1)
                fields = dict(part.split("=", 1) for part in labels.split('",') if "=" in part)
                get = {k: v.strip('"') for k, v in fields.items()}
                out[(get.get("verb", ""), get.get("resource", ""), get.get("code", ""))] += int(float(value))
        return out

    def request_counts(self) -> Counter[tuple[str, str, str]]:
        """API requests served since the cluster started, by (verb, resource, code), across restarts."""
        return self._counts + self._scrape()

    def stop(self) -> None:
        for name in ("kwok", "kube-controller-manager", "kube-scheduler"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                proc.stop()
        self.api.stop()
