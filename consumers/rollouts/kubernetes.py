"""The Kubernetes rollout backend: one pod per rollout, created through kubernetes-asyncio.

Pod layout (see :func:`build_pod`):

* the harness runs as the pod's only **init container**, the verifier as its only **container**,
  so the verifier starts after the harness exited successfully, in the same pod, on the same
  ``emptyDir`` workspace (mounted at ``/workspace`` in both);
* ``restartPolicy: Never`` (a rollout runs once), ``activeDeadlineSeconds`` = the task's timeout,
  ``automountServiceAccountToken: false`` (agent code gets no Kubernetes credentials),
  ``enableServiceLinks: false`` (no environment noise from the namespace's services);
* the agent token and the verifier token live in a per-rollout **Secret** owned by the pod (so
  Kubernetes deletes it with the pod). The harness container references only the agent-token
  keys; the verifier token is referenced by the verifier container alone. Neither token appears
  in the pod spec, which anyone allowed to read pods (dashboards, ``kubectl describe``) can see,
  and the harness process, whose environment is all it has, never holds the verifier token.

Idempotence: pod names are the launcher's deterministic ``RolloutSpec.name``; "already exists"
means launched, and ``launch`` then still makes sure the Secret exists, which repairs a launcher
that died between the two calls. ``existing()`` lists by label so a restarted launcher
reconciles instead of launching twice.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Literal

import orjson
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.rollouts.backend import ENV_AGENT_KEYS, ENV_VERIFIER_TOKEN, RolloutSpec
from schemas.rollout.pod import (
    ANNOTATION_GROUP_INDEX,
    ANNOTATION_GROUP_SIZE,
    ANNOTATION_HARNESS,
    ANNOTATION_ROLLOUT_ID,
    ANNOTATION_RUN_ID,
    ANNOTATION_TASK_ID,
    FINALIZER,
    HARNESS_CONTAINER,
    LABEL_MANAGED_BY,
    LABEL_ROLLOUT,
    LABEL_RUN,
    LABEL_TASK,
    MANAGED_BY,
    MANAGED_SELECTOR,
    VERIFIER_CONTAINER,
    WORKSPACE_PATH,
    label_value,
)
from schemas.rollout.v1 import Backend
from schemas.task.v1 import ContainerLaunch

__all__ = [
    "KubernetesBackend",
    "KubernetesSettings",
    "PodRejectedError",
    "build_pod",
    "build_secret",
    "connect",
    "secret_name",
]

logger = logging.getLogger(__name__)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SECRET_SUFFIX = "-credentials"  # noqa: S105 (a name suffix, not a secret)
_TERMINAL_POD_PHASES = frozenset({"Succeeded", "Failed"})


class KubernetesSettings(BaseSettings):
    """Where rollout pods go and how to reach the API server (``OPENFORGE_KUBE_*``).

    Connection, in order of precedence: ``server`` + ``token`` (+ ``ca_file``); ``in_cluster``
    (the service account Kubernetes mounts into the launcher's own pod); ``kubeconfig`` /
    ``context``; else the default kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``).
    """

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_KUBE_", frozen=True, extra="ignore")

    namespace: str = Field(default="openforge-rollouts", min_length=1, max_length=63)
    """Namespace of the rollout pods; the launcher's and watcher's Role is bound only there."""

    server: str | None = None
    """API server URL (``https://host:port``); with ``token`` it bypasses kubeconfig."""

    token: SecretStr | None = None
    """Bearer token for ``server``."""

    ca_file: str | None = None
    """CA bundle that signed the API server's certificate (for ``server``)."""

    in_cluster: bool = False
    """Use the pod's own service account (the Helm chart sets this)."""

    kubeconfig: str | None = None
    """Path of a kubeconfig file; the default lookup applies when absent."""

    context: str | None = None
    """kubeconfig context to use; its current context when absent."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of harness and verifier images. ``IfNotPresent`` suits pinned tags."""

    verifier_image: str | None = None
    """Image of the verifier when the task names no ``environment_image``; the harness image
    when both are absent."""

    service_account: str | None = None
    """Service account of rollout pods (its token is never mounted); the namespace default
    when absent."""

    request_timeout_s: float = Field(default=30.0, gt=0)
    """Per-request timeout towards the API server, in seconds."""


class PodRejectedError(ValueError):
    """The API server refused a rollout pod as invalid (HTTP 422); the message says why."""


async def connect(settings: KubernetesSettings) -> k8s.ApiClient:
    """Build an API client from ``settings`` (see :class:`KubernetesSettings` for the order)."""
    configuration = k8s.Configuration()
    if settings.server:
        configuration.host = settings.server.rstrip("/")
        if settings.token is not None:
            configuration.api_key = {"BearerToken": "Bearer " + settings.token.get_secret_value()}
        if settings.ca_file:
            configuration.ssl_ca_cert = settings.ca_file
    elif settings.in_cluster:
        k8s_config.load_incluster_config(client_configuration=configuration)
    else:
        await k8s_config.load_kube_config(
            config_file=settings.kubeconfig, context=settings.context, client_configuration=configuration
        )
    return k8s.ApiClient(configuration)


def secret_name(pod_name: str) -> str:
    """Name of the per-rollout Secret that holds the pod's tokens."""
    return pod_name + _SECRET_SUFFIX


def _secret_keys(spec: RolloutSpec) -> tuple[list[str], list[str]]:
    """Split credential variables: (agent-token names the harness may see, verifier-only names)."""
    agent = [name for name in ENV_AGENT_KEYS if name in spec.harness_env]
    verifier_only = [name for name in (ENV_VERIFIER_TOKEN,) if name in spec.verifier_env]
    return agent, verifier_only


def _env(values: dict[str, str], from_secret: list[str], secret: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for name in sorted(values):
        if name in from_secret:
            entries.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}})
        else:
            entries.append({"name": name, "value": values[name]})
    return entries


def _resources(spec: RolloutSpec) -> dict[str, Any]:
    wanted = spec.task.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if wanted.cpu is not None:
        requests["cpu"] = wanted.cpu
    if wanted.memory is not None:
        # Memory is requested and limited alike: a rollout over its share is OOM-killed (and
        # reported as such) instead of starving its neighbours on the node.
        requests["memory"] = limits["memory"] = wanted.memory
    if wanted.gpu is not None:
        limits["nvidia.com/gpu"] = wanted.gpu
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def build_pod(spec: RolloutSpec, settings: KubernetesSettings) -> dict[str, Any]:
    """The rollout's pod manifest (a plain dict, as the API server takes it).

    Raises:
        ValueError: the task cannot run in a pod (local launch) or the name is not a DNS-1123 label.
    """
    launch = spec.task.harness.launch
    if not isinstance(launch, ContainerLaunch):
        raise ValueError(
            f"task {spec.task.task_id!r} launches its harness as a local command; the Kubernetes backend "
            f"needs harness.launch.kind='container' with an image"
        )
    if not _DNS_LABEL.match(spec.name) or len(secret_name(spec.name)) > 253:
        raise ValueError(f"rollout name {spec.name!r} is not a DNS-1123 label (lowercase, digits, '-', <= 63)")
    task = spec.task
    secret = secret_name(spec.name)
    agent_keys, verifier_keys = _secret_keys(spec)
    labels = {key: label_value(value) for key, value in spec.labels.items()}
    labels.update({
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_TASK: label_value(task.task_id),
        LABEL_ROLLOUT: label_value(spec.rollout_id),
    })
    annotations = {
        ANNOTATION_ROLLOUT_ID: spec.rollout_id,
        ANNOTATION_TASK_ID: task.task_id,
        ANNOTATION_GROUP_INDEX: str(spec.group_index),
        ANNOTATION_GROUP_SIZE: str(task.group_size),
        ANNOTATION_HARNESS: task.harness.name,
    }
    if task.run_id is not None:
        labels[LABEL_RUN] = label_value(task.run_id)
        annotations[ANNOTATION_RUN_ID] = task.run_id
    mounts = [{"name": "workspace", "mountPath": WORKSPACE_PATH}]
    resources = _resources(spec)
    harness: dict[str, Any] = {
        "name": HARNESS_CONTAINER,
        "image": launch.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(launch.command),
        "workingDir": WORKSPACE_PATH,
        "env": _env(spec.harness_env, agent_keys, secret),
        "volumeMounts": mounts,
    }
    verifier: dict[str, Any] = {
        "name": VERIFIER_CONTAINER,
        "image": task.environment_image or settings.verifier_image or launch.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(task.verifier.command),
        "workingDir": WORKSPACE_PATH,
        "env": _env(spec.verifier_env, agent_keys + verifier_keys, secret),
        "volumeMounts": mounts,
    }
    if resources:
        harness["resources"] = verifier["resources"] = resources
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": max(1, math.ceil(spec.deadline_s)),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "volumes": [{"name": "workspace", "emptyDir": {}}],
        "initContainers": [harness],
        "containers": [verifier],
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": spec.name, "namespace": settings.namespace, "labels": labels,
                     "annotations": annotations, "finalizers": [FINALIZER]},
        "spec": pod_spec,
    }


def build_secret(spec: RolloutSpec, settings: KubernetesSettings, pod_uid: str) -> dict[str, Any]:
    """The per-rollout Secret with the tokens, owned by the pod so it goes when the pod goes."""
    agent_keys, verifier_keys = _secret_keys(spec)
    data = {name: spec.harness_env[name] for name in agent_keys}
    data.update({name: spec.verifier_env[name] for name in verifier_keys})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": secret_name(spec.name),
            "namespace": settings.namespace,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_ROLLOUT: label_value(spec.rollout_id)},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": spec.name, "uid": pod_uid}],
        },
        "stringData": data,
    }


def _reason(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or b"").get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


class KubernetesBackend:
    """Rollouts as pods in one namespace (implements ``RolloutBackend``)."""

    kind = Backend.KUBERNETES

    def __init__(self, settings: KubernetesSettings | None = None, *, api_client: k8s.ApiClient | None = None) -> None:
        """Create the backend; ``api_client`` (owned by the caller) replaces :func:`connect`."""
        self.settings = settings or KubernetesSettings()
        self._given_client = api_client
        self._client: k8s.ApiClient | None = api_client
        self._core: Any = None
        self._stopped = False

    async def start(self) -> None:
        """Connect to the API server (no request is sent yet)."""
        if self._core is not None:
            return
        if self._client is None:
            self._client = await connect(self.settings)
        self._core = k8s.CoreV1Api(self._client)

    async def stop(self) -> None:
        """Close the client this backend opened; pods keep running. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._client is not None and self._given_client is None:
            await self._client.close()
        self._core = None

    async def __aenter__(self) -> KubernetesBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def _api(self) -> Any:
        if self._core is None:
            raise RuntimeError("KubernetesBackend.start() was not called (or stop() was)")
        return self._core

    async def launch(self, spec: RolloutSpec) -> bool:
        """Create the rollout's pod and Secret; False if the pod already existed.

        Raises:
            ValueError: the spec cannot become a pod (see :func:`build_pod`).
            PodRejectedError: the API server refused the manifest.
            ApiException: any other API failure (the launcher retries; launching is idempotent).
        """
        pod = build_pod(spec, self.settings)
        namespace = self.settings.namespace
        timeout = self.settings.request_timeout_s
        try:
            created = await self._api.create_namespaced_pod(namespace, pod, _request_timeout=timeout)
            uid = created.metadata.uid
            fresh = True
        except ApiException as exc:
            if exc.status == 409:
                existing = await self._api.read_namespaced_pod(spec.name, namespace, _request_timeout=timeout)
                uid = existing.metadata.uid
                fresh = False
            elif exc.status == 422:
                raise PodRejectedError(f"pod {spec.name!r} rejected by the API server: {_reason(exc)}") from exc
            else:
                raise
        await self._ensure_secret(spec, uid)
        if fresh:
            logger.info("created pod %s/%s for rollout %s", namespace, spec.name, spec.rollout_id)
        else:
            logger.info("pod %s/%s for rollout %s already exists", namespace, spec.name, spec.rollout_id)
        return fresh

    async def _ensure_secret(self, spec: RolloutSpec, pod_uid: str) -> None:
        body = build_secret(spec, self.settings, pod_uid)
        try:
            await self._api.create_namespaced_secret(
                self.settings.namespace, body, _request_timeout=self.settings.request_timeout_s
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    async def _pods(self) -> list[dict[str, Any]]:
        """The rollout pods, as the API server's JSON.

        Read raw: turning each pod into the client library's objects cost about 2 ms of CPU per
        pod (a second for 500, before every task), which held the event loop long enough for the
        launcher's Kafka heartbeats to fail. Only a few fields are read.
        """
        response = await self._api.list_namespaced_pod(
            self.settings.namespace, label_selector=MANAGED_SELECTOR, _preload_content=False,
            _request_timeout=self.settings.request_timeout_s)
        try:
            body = await response.read()
        finally:
            response.release()
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=body[:300].decode(errors="replace"))
        items: list[dict[str, Any]] = orjson.loads(body).get("items") or []
        return items

    async def active(self) -> set[str]:
        """Rollout ids whose pod exists, is not being deleted and has not finished."""
        out: set[str] = set()
        for pod in await self._pods():
            metadata = pod.get("metadata") or {}
            rollout_id = (metadata.get("annotations") or {}).get(ANNOTATION_ROLLOUT_ID)
            if rollout_id is None or metadata.get("deletionTimestamp") is not None:
                continue
            if (pod.get("status") or {}).get("phase") not in _TERMINAL_POD_PHASES:
                out.add(rollout_id)
        return out

    async def existing(self) -> set[str]:
        """Rollout ids whose pod exists in any phase."""
        return {
            rid for pod in await self._pods()
            if (rid := ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_ROLLOUT_ID)) is not None
        }
