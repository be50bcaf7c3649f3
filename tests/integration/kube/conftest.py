"""Fixtures for the Kubernetes backend and pod watcher against the real API server and broker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubeapi import EventLog, KubeAPI, Kubelet, apply_rbac
from kubernetes_asyncio import client as k8s

from consumers.rollouts.kubernetes import KubernetesSettings
from producers.pod_watcher import PodWatcher, PodWatcherSettings
from stream import EventProducer, TopicRegistry
from stream.settings import KafkaSettings


@pytest.fixture
async def kube_admin(kube_api: KubeAPI) -> AsyncIterator[k8s.ApiClient]:
    async with kube_api.client() as client:
        yield client


@pytest.fixture
async def kube_namespace(kube_admin: k8s.ApiClient) -> str:
    """A fresh namespace with a default service account and the shipped RBAC applied."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = k8s.CoreV1Api(kube_admin)
    await core.create_namespace({"metadata": {"name": name}})
    # The controller manager would create it; the ServiceAccount admission plugin needs it.
    await core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    await apply_rbac(kube_admin, name)
    return name


@pytest.fixture
async def launcher_client(kube_api: KubeAPI) -> AsyncIterator[k8s.ApiClient]:
    async with kube_api.client(kube_api.launcher_token) as client:
        yield client


@pytest.fixture
async def watcher_client(kube_api: KubeAPI) -> AsyncIterator[k8s.ApiClient]:
    async with kube_api.client(kube_api.watcher_token) as client:
        yield client


@pytest.fixture
def kubelet(kube_admin: k8s.ApiClient, kube_namespace: str) -> Kubelet:
    return Kubelet(kube_admin, kube_namespace)


@pytest.fixture
def kube_settings(kube_api: KubeAPI, kube_namespace: str) -> KubernetesSettings:
    """Backend settings as the launcher would get them from OPENFORGE_KUBE_* (launcher's token)."""
    return KubernetesSettings(namespace=kube_namespace, server=kube_api.url, token=kube_api.launcher_token,
                              ca_file=str(kube_api.ca_file))


@pytest.fixture
async def event_log(kafka_settings: KafkaSettings, topics: TopicRegistry) -> AsyncIterator[EventLog]:
    log = EventLog(kafka_settings, topics)
    await log.start()
    try:
        yield log
    finally:
        await log.stop()


@pytest.fixture
async def producer(kafka_settings: KafkaSettings, topics: TopicRegistry) -> AsyncIterator[EventProducer]:
    async with EventProducer(kafka_settings) as p:
        yield p


@pytest.fixture
def watcher_settings(kube_namespace: str) -> PodWatcherSettings:
    return PodWatcherSettings(namespace=kube_namespace, sweep_interval_s=0.3, retry_backoff_s=0.2,
                              retry_backoff_max_s=1.0, watch_timeout_s=30)


@pytest.fixture
async def start_watcher(watcher_client: k8s.ApiClient, producer: EventProducer,
                        watcher_settings: PodWatcherSettings) -> AsyncIterator[Callable[..., Any]]:
    """Start a watcher (with the watcher user's credentials); stopped at the end of the test."""
    started: list[PodWatcher] = []

    async def start(settings: PodWatcherSettings | None = None, client: k8s.ApiClient | None = None) -> PodWatcher:
        watcher = PodWatcher(client or watcher_client, producer, settings or watcher_settings)
        await watcher.start()
        started.append(watcher)
        await asyncio.wait_for(watcher.listed.wait(), 30)
        return watcher

    yield start
    for watcher in started:
        await watcher.stop()
