"""`openforge watcher`: the pod watcher process.

Configuration comes from the environment only: ``OPENFORGE_WATCHER_*`` (namespace, timeouts,
TTL; see :class:`producers.pod_watcher.PodWatcherSettings`), ``OPENFORGE_KUBE_*`` (how to reach
the API server; see :class:`consumers.rollouts.kubernetes.KubernetesSettings`) and
``OPENFORGE_KAFKA_*``. It lives here, not in ``producers``, because the connection settings are
the launcher's (``consumers``) and only the ``openforge`` package may import both sides.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import click

from stream import EventProducer, KafkaSettings, supervise

if TYPE_CHECKING:
    from consumers.rollouts.kubernetes import KubernetesSettings
    from producers.pod_watcher import PodWatcherSettings


async def run_watcher(watcher_settings: PodWatcherSettings, kube: KubernetesSettings, kafka: KafkaSettings) -> None:
    """Run the watcher until SIGTERM/SIGINT, then stop it, flush Kafka and close the client."""
    from consumers.rollouts.kubernetes import connect
    from producers.pod_watcher import PodWatcher

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
    # Imported here: the Kubernetes client takes a second to import, which every other
    # `openforge` command (the pod-side `openforge reward` among them) should not pay.
    from consumers.rollouts.kubernetes import KubernetesSettings
    from producers.pod_watcher import PodWatcherSettings
    from stream.otel import configure_telemetry

    settings = PodWatcherSettings()
    if namespace:
        settings = settings.model_copy(update={"namespace": namespace})
    shutdown_telemetry = configure_telemetry("openforge-watcher")
    try:
        asyncio.run(run_watcher(settings, KubernetesSettings(), KafkaSettings()))
    finally:
        shutdown_telemetry()
