"""A real etcd + kube-apiserver for the tests, and a stand-in for the kubelet's status writes.

The binaries come from ``scripts/kube/install.sh`` (``make kube``), cached under
``<cache>/kube/<version>/bin``. :class:`KubeAPI` starts etcd and one API server on free ports with
certificates made by the ``openssl`` CLI, static token authentication (an admin in
``system:masters``, plus the launcher and watcher users that only RBAC can empower) and
``--authorization-mode=RBAC``. The API server can be stopped and started again on the same port
and etcd (the restart test), and further API servers can share the etcd (the 410 test runs one
without a watch cache).

There is no kubelet and no controller manager: pods never run and owned objects are not garbage
collected. :class:`Kubelet` writes pod status through the API the way a kubelet would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from aiokafka import AIOKafkaConsumer
from kubernetes_asyncio import client as k8s
from netutil import free_port

from consumers.rollouts.backend import (
    ENV_AGENT_KEYS,
    ENV_ANTHROPIC_BASE_URL,
    ENV_OPENAI_BASE_URL,
    ENV_REWARD_URL,
    ENV_ROLLOUT_ID,
    ENV_TASK_ID,
    ENV_VERIFIER_TOKEN,
    RolloutSpec,
)
from schemas import RolloutEventV1, decode
from schemas.task.v1 import ContainerLaunch, HarnessSpec, Resources, TaskV1, VerifierSpec
from stream import ROLLOUTS, TopicRegistry
from stream.broker import cache_root
from stream.settings import KafkaSettings

KUBE_VERSION = os.environ.get("OPENFORGE_KUBE_VERSION", "v1.37.2")

ADMIN_USER = "openforge-admin"
LAUNCHER_USER = "openforge-launcher"
WATCHER_USER = "openforge-pod-watcher"


class KubeAPIError(RuntimeError):
    """The API server or etcd could not be started."""


def kube_bin_dir() -> Path:
    """Where ``make kube`` put the binaries; fails (never skips) when they are missing."""
    given = os.environ.get("OPENFORGE_KUBE_BIN")
    path = Path(given) if given else cache_root() / "kube" / KUBE_VERSION / "bin"
    missing = [b for b in ("etcd", "kube-apiserver") if not (path / b).is_file()]
    if missing:
        raise KubeAPIError(f"{', '.join(missing)} missing in {path}: run `make kube` (scripts/kube/install.sh)")
    return path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _make_pki(folder: Path) -> None:
    """CA, a serving certificate for 127.0.0.1/localhost, and the service-account signing key."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
             "-days", "2", "-subj", "/CN=openforge-test-ca")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", "/CN=kube-apiserver")
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n"
                   "extendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    _openssl("genrsa", "-out", str(folder / "sa.key"), "2048")
    _openssl("rsa", "-in", str(folder / "sa.key"), "-pubout", "-out", str(folder / "sa.pub"))


@dataclass
class _Proc:
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ApiServer:
    """One kube-apiserver process on a fixed port (so a restart keeps its URL)."""

    def __init__(self, owner: KubeAPI, name: str, *, watch_cache: bool = True) -> None:
        self.owner = owner
        self.extra_args = list(owner.apiserver_args)
        self.name = name
        self.port = free_port()
        self.watch_cache = watch_cache
        self._proc: _Proc | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> None:
        o = self.owner
        log = o.root / f"{self.name}.log"
        args = [
            str(o.bin_dir / "kube-apiserver"),
            f"--etcd-servers={o.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--cert-dir={o.root / 'certs'}",
            f"--tls-cert-file={o.pki / 'server.crt'}", f"--tls-private-key-file={o.pki / 'server.key'}",
            f"--token-auth-file={o.root / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={o.pki / 'sa.pub'}",
            f"--service-account-signing-key-file={o.pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            f"--watch-cache={'true' if self.watch_cache else 'false'}",
            "--v=1",
            *self.extra_args,
        ]
        with log.open("ab") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._proc = _Proc(process, log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise KubeAPIError(f"kube-apiserver exited with {process.returncode}:\n{self._proc.tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        self.stop()
        raise KubeAPIError(f"kube-apiserver not ready after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")

    def ready(self) -> bool:
        request = urllib.request.Request(self.url + "/readyz",
                                         headers={"Authorization": f"Bearer {self.owner.admin_token}"})
        try:
            with urllib.request.urlopen(request, timeout=2, context=self.owner.ssl_context()) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class KubeAPI:
    """etcd plus the main API server, in a folder of their own."""

    def __init__(self, root: Path, bin_dir: Path | None = None, apiserver_args: list[str] | None = None) -> None:
        self.root = root
        self.bin_dir = bin_dir or kube_bin_dir()
        self.apiserver_args = apiserver_args or []
        """Further kube-apiserver flags (the simulated cluster's toleration defaults)."""
        self.pki = root / "pki"
        self.admin_token = base64.b32encode(os.urandom(20)).decode().lower()
        self.launcher_token = base64.b32encode(os.urandom(20)).decode().lower()
        self.watcher_token = base64.b32encode(os.urandom(20)).decode().lower()
        self.etcd_port = free_port()
        self._etcd: _Proc | None = None
        self.server = ApiServer(self, "kube-apiserver")
        self.extra: list[ApiServer] = []

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _make_pki(self.pki)
        (self.root / "tokens.csv").write_text(
            f'{self.admin_token},{ADMIN_USER},1,"system:masters"\n'
            f"{self.launcher_token},{LAUNCHER_USER},2\n"
            f"{self.watcher_token},{WATCHER_USER},3\n"
        )
        self._start_etcd()
        try:
            self.server.start()
        except BaseException:
            self.stop()
            raise

    def _start_etcd(self) -> None:
        peer = free_port()
        log = self.root / "etcd.log"
        args = [
            str(self.bin_dir / "etcd"), "--name=default", f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=1073741824",
        ]
        with log.open("ab") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._etcd = _Proc(process, log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise KubeAPIError(f"etcd exited with {process.returncode}:\n{self._etcd.tail()}")
            try:
                with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as response:
                    if json.loads(response.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.3)
        raise KubeAPIError(f"etcd not healthy after 60 s:\n{self._etcd.tail()}")

    def _etcd_post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.etcd_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def etcd_revision(self) -> int:
        """etcd's current revision (the API server's resource versions are etcd revisions)."""
        header = self._etcd_post("/v3/kv/range", {"key": base64.b64encode(b"/").decode(), "limit": 1})["header"]
        return int(header["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision; older resource versions are gone."""
        revision = self.etcd_revision()
        self._etcd_post("/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    def spawn_server(self, *, watch_cache: bool) -> ApiServer:
        """Another API server on the same etcd (same cluster), stopped with the rest."""
        server = ApiServer(self, f"kube-apiserver-{len(self.extra) + 1}", watch_cache=watch_cache)
        server.start()
        self.extra.append(server)
        return server

    def stop(self) -> None:
        for server in [*self.extra, self.server]:
            server.stop()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None

    def client(self, token: str | None = None, *, server: ApiServer | None = None) -> k8s.ApiClient:
        """A kubernetes-asyncio client for ``token`` (the admin's by default); close it after use."""
        configuration = k8s.Configuration()
        configuration.host = (server or self.server).url
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"BearerToken": f"Bearer {token or self.admin_token}"}
        return k8s.ApiClient(configuration)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kubelet:
    """Moves pods through their phases through the API, as a kubelet would (there is none)."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, node: str = "node-1") -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.namespace = namespace
        self.node = node

    async def _status(self, name: str, change: dict[str, Any]) -> None:
        await self.core.patch_namespaced_pod_status(
            name, self.namespace, {"status": change}, _content_type="application/merge-patch+json")

    @staticmethod
    def _container(name: str, image: str, state: dict[str, Any], *, ready: bool = False) -> dict[str, Any]:
        return {"name": name, "image": image, "imageID": "", "ready": ready, "restartCount": 0,
                "started": "running" in state, "state": state}

    async def _images(self, name: str) -> tuple[str, str]:
        pod = await self.core.read_namespaced_pod(name, self.namespace)
        return pod.spec.init_containers[0].image, pod.spec.containers[0].image

    async def bind(self, name: str) -> None:
        """The scheduler's part: bind the pod to a node."""
        # Raw response: the server answers with a Status, which the client cannot read as a Binding.
        response = await self.core.create_namespaced_pod_binding(
            name, self.namespace,
            {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
             "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}},
            _preload_content=False)
        body = await response.read()
        response.release()
        assert response.status == 201, body

    async def unschedulable(self, name: str, message: str = "0/3 nodes are available: 3 Insufficient memory.") -> None:
        await self._status(name, {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
             "lastTransitionTime": _now()}]})

    async def harness_running(self, name: str) -> None:
        harness, verifier = await self._images(name)
        await self._status(name, {
            "phase": "Pending", "startTime": _now(),
            "initContainerStatuses": [self._container("harness", harness, {"running": {"startedAt": _now()}})],
            "containerStatuses": [self._container("verifier", verifier,
                                                  {"waiting": {"reason": "PodInitializing"}})],
        })

    async def image_pull_failing(self, name: str, reason: str = "ImagePullBackOff") -> None:
        harness, verifier = await self._images(name)
        await self._status(name, {
            "phase": "Pending",
            "initContainerStatuses": [self._container("harness", harness, {"waiting": {
                "reason": reason, "message": f'Back-off pulling image "{harness}"'}})],
            "containerStatuses": [self._container("verifier", verifier, {"waiting": {"reason": "PodInitializing"}})],
        })

    async def verifier_running(self, name: str, harness_exit: int = 0) -> None:
        harness, verifier = await self._images(name)
        await self._status(name, {
            "phase": "Running",
            "initContainerStatuses": [self._container("harness", harness, {"terminated": {
                "exitCode": harness_exit, "reason": "Completed", "startedAt": _now(), "finishedAt": _now()}})],
            "containerStatuses": [self._container("verifier", verifier, {"running": {"startedAt": _now()}},
                                                  ready=True)],
        })

    async def lose_node(self, name: str) -> None:
        """The node controller's part when a node becomes unreachable: mark the pod, then delete it."""
        await self._status(name, {"conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
             "message": "Taint manager: deleting due to NoExecute taint", "lastTransitionTime": _now()}]})
        await self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)

    async def finish(self, name: str, *, phase: str, harness_exit: int | None = 0, verifier_exit: int | None = 0,
                     harness_reason: str = "Completed", verifier_reason: str = "Completed",
                     pod_reason: str | None = None, message: str | None = None) -> None:
        """End the pod: ``phase`` Succeeded or Failed, with container exit codes (None: never ran)."""
        harness, verifier = await self._images(name)

        def term(code: int | None, reason: str) -> dict[str, Any]:
            if code is None:
                return {"waiting": {"reason": "PodInitializing"}}
            return {"terminated": {"exitCode": code, "reason": reason, "startedAt": _now(), "finishedAt": _now()}}

        change: dict[str, Any] = {
            "phase": phase,
            "initContainerStatuses": [self._container("harness", harness, term(harness_exit, harness_reason))],
            "containerStatuses": [self._container("verifier", verifier, term(verifier_exit, verifier_reason))],
        }
        if pod_reason:
            change["reason"] = pod_reason
        if message:
            change["message"] = message
        await self._status(name, change)


# --- shared by the Kubernetes integration tests -------------------------------------------------------

RBAC_DIR = Path(__file__).resolve().parents[1] / "deploy" / "rbac"


def rbac_documents(namespace: str) -> list[dict[str, Any]]:
    """The shipped Roles and RoleBindings, moved into ``namespace``."""
    docs: list[dict[str, Any]] = []
    for path in sorted(RBAC_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["metadata"]["namespace"] = namespace
                docs.append(doc)
    return docs


async def apply_rbac(admin: k8s.ApiClient, namespace: str) -> None:
    """Apply the shipped RBAC, and bind its Roles to the test's static-token users as well."""
    rbac = k8s.RbacAuthorizationV1Api(admin)
    users = {"openforge-launcher": LAUNCHER_USER, "openforge-pod-watcher": WATCHER_USER}
    for doc in rbac_documents(namespace):
        if doc["kind"] == "Role":
            await rbac.create_namespaced_role(namespace, doc)
        elif doc["kind"] == "RoleBinding":
            await rbac.create_namespaced_role_binding(namespace, doc)
            user_binding = {**doc, "metadata": {**doc["metadata"], "name": doc["metadata"]["name"] + "-user"},
                            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                          "name": users[doc["roleRef"]["name"]]}]}
            await rbac.create_namespaced_role_binding(namespace, user_binding)


def make_task(task_id: str | None = None, *, group_size: int = 2, run_id: str | None = "run-7",
              timeout_s: float = 600.0) -> TaskV1:
    return TaskV1(
        task_id=task_id or f"task-{uuid.uuid4().hex[:8]}",
        run_id=run_id,
        instruction="Make the failing test pass.",
        harness=HarnessSpec(name="coding-agent",
                            launch=ContainerLaunch(image="registry.example/agent:1.2", command=["agent", "run"]),
                            env={"AGENT_MODE": "headless"}),
        environment_image="registry.example/env:3",
        verifier=VerifierSpec(command=["python", "-m", "verify"]),
        group_size=group_size,
        timeout_s=timeout_s,
        resources=Resources(cpu="500m", memory="1Gi"),
    )


def make_spec(task: TaskV1, index: int, proxy: str = "http://proxy.openforge:8000") -> RolloutSpec:
    """What the launcher hands the backend: deterministic id and name, env with both tokens."""
    rollout_id = f"{task.task_id}-{index}"
    base = f"{proxy}/rollouts/{rollout_id}"
    harness_env = {**task.harness.env, ENV_OPENAI_BASE_URL: base + "/v1", ENV_ANTHROPIC_BASE_URL: base,
                   ENV_ROLLOUT_ID: rollout_id, ENV_TASK_ID: task.task_id}
    harness_env.update(dict.fromkeys(ENV_AGENT_KEYS, f"agent-token-{rollout_id}"))
    verifier_env = {**harness_env, ENV_REWARD_URL: base + "/reward",
                    ENV_VERIFIER_TOKEN: f"verifier-token-{rollout_id}"}
    return RolloutSpec(
        rollout_id=rollout_id, name=f"rollout-{rollout_id}".lower(), task=task, group_index=index,
        harness_env=harness_env, verifier_env=verifier_env, deadline_s=task.timeout_s,
        labels={"openforge.dev/run": task.run_id or "", "openforge.dev/task": task.task_id,
                "openforge.dev/rollout": rollout_id},
    )


class EventLog:
    """Every rollout event on the test's topic, read continuously from the beginning."""

    def __init__(self, settings: KafkaSettings, registry: TopicRegistry) -> None:
        self._consumer = AIOKafkaConsumer(registry[ROLLOUTS].name, bootstrap_servers=settings.bootstrap_servers,
                                          auto_offset_reset="earliest", enable_auto_commit=False)
        self.events: list[RolloutEventV1] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            for batch in (await self._consumer.getmany(timeout_ms=200)).values():
                for record in batch:
                    event = decode(record.headers, record.value)
                    assert isinstance(event, RolloutEventV1)
                    self.events.append(event)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    def of(self, rollout_id: str) -> list[RolloutEventV1]:
        return [e for e in self.events if e.rollout_id == rollout_id]

    def phases(self, rollout_id: str) -> list[str]:
        return [e.phase.value for e in self.of(rollout_id)]

    async def wait_for(self, check: Callable[[], bool], timeout_s: float = 30.0, what: str = "events") -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not check():
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; have {[(e.rollout_id, e.phase.value) for e in self.events]}")
            await asyncio.sleep(0.1)

    async def settle(self, quiet_s: float = 1.5) -> None:
        """Give duplicates, if any were published, time to arrive."""
        await asyncio.sleep(quiet_s)


