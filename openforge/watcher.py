"""`openforge watcher`: the pod watcher process.

Configuration comes from the environment only: ``OPENFORGE_WATCHER_*`` (namespace, timeouts,
TTL; see :class:`producers.pod_watcher.PodWatcherSettings`), ``OPENFORGE_KUBE_*`` (how to reach
the API server; see :class:`consumers.rollouts.kubernetes.KubernetesSettings`) and
``OPENFORGE_KAFKA_*``. It lives here, not in ``producers``, because the connection settings are
the launcher's (``consumers``) and only the ``openforge`` package may import both sides.
"""

from __future__ import annotations

import asyncio

import click

from consumers.rollouts.kubernetes import KubernetesSettings, connect
from producers.pod_watcher import PodWatcher, PodWatcherSettings
from stream import EventProducer, KafkaSettings, supervise


async def run_watcher(watcher_settings: PodWatcherSettings, kube: KubernetesSettings, kafka: KafkaSettings) -> None:
    """Run the watcher until SIGTERM/SIGINT, then stop it, flush Kafka and close the client."""
    client = await connect(kube)
    try:
        async with EventProducer(kafka, client_id="openforge-pod-watcher") as producer:
            await supervise([PodWatcher(client, producer, watcher_settings)])
    finally:
        await client.close()


@click.command("watcher")
@click.option("--namespace", default=None, help="Rollout namespace (default: OPENFORGE_WATCHER_NAMESPACE).")
def watcher_command(namespace: str | None) -> None:
    """Publish rollout lifecycle events from the rollout pods of one namespace."""
    settings = PodWatcherSettings()
    if namespace:
        settings = settings.model_copy(update={"namespace": namespace})
    asyncio.run(run_watcher(settings, KubernetesSettings(), KafkaSettings()))
