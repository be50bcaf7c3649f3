"""A service whose start fails (its topics are missing, its cluster unreachable) closes every
Kafka client it made.

aiokafka warns of an unclosed client when it is collected; under the suite's warning filters
that warning fails whichever test happens to be running then, far from the leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import uuid
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaConnectionError
from netutil import refused_address

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from consumers.publisher import CheckpointPublisher, PublisherSettings
from consumers.rollouts.launcher import Launcher, LauncherSettings
from stream.admin import KafkaAdmin
from stream.consumer import EventConsumer
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CALLS, MissingTopicsError, TopicRegistry, start_consumer

pytestmark = pytest.mark.kafka


def _absent(kafka_settings: KafkaSettings) -> KafkaSettings:
    return kafka_settings.model_copy(update={"topic_prefix": f"absent{os.urandom(4).hex()}."})


async def _leaks(run: Callable[[], Awaitable[None]]) -> list[str]:
    """Run ``run``, collect garbage, and return the unclosed-client warnings raised meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        await run()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_a_publisher_without_its_topic_closes_its_consumer_producer_and_http_client(kafka_settings) -> None:
    settings = PublisherSettings(replicas=["http://127.0.0.1:9"], model="m", group_id=f"pub-{uuid.uuid4().hex[:8]}",
                                 kafka=_absent(kafka_settings))

    async def run() -> None:
        publisher = CheckpointPublisher(settings)
        with pytest.raises(MissingTopicsError, match="checkpoints.v1 does not exist"):
            await publisher.start()
        assert publisher._http.is_closed
        await publisher.stop()  # still idempotent after the failed start

    assert await _leaks(run) == []


async def test_an_assembler_without_its_topics_closes_its_consumer_and_producer(kafka_settings) -> None:
    settings = AssemblerSettings(group_id=f"asm-{uuid.uuid4().hex[:8]}")

    async def run() -> None:
        service = AssemblerService(settings, _absent(kafka_settings))
        with pytest.raises(MissingTopicsError, match="calls.v1, .* do not exist"):
            await service.start()
        await service.stop()

    assert await _leaks(run) == []


async def test_a_producer_never_started_closes_its_client_when_stopped(kafka_settings) -> None:
    async def run() -> None:
        producer = EventProducer(kafka_settings)
        await producer.stop()
        await producer.stop()

    assert await _leaks(run) == []


async def test_nothing_is_left_open_when_the_cluster_cannot_be_reached(kafka_settings, tmp_path) -> None:
    # No stop() after the failed starts: a start that raises has closed what it made.
    with refused_address() as address:
        leaks = await _unreachable_leaks(kafka_settings.model_copy(update={"bootstrap_servers": address}), tmp_path)
    assert leaks == {name: [] for name in leaks}


async def _unreachable_leaks(kafka: KafkaSettings, tmp_path: Path) -> dict[str, list[str]]:
    async def consumer() -> None:
        client = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id="g")
        with pytest.raises(KafkaConnectionError):
            await start_consumer(client, ["t"], kafka)

    async def event_consumer() -> None:
        async def ignore(_: object) -> None:
            return None

        service = EventConsumer([CALLS], ignore, group_id="g", kafka=kafka, registry=TopicRegistry.from_settings(kafka))
        with pytest.raises(KafkaConnectionError):
            await service.start()  # its dead-letter producer fails first; the consumer is closed too

    async def admin() -> None:
        with pytest.raises(KafkaConnectionError):
            async with KafkaAdmin(kafka):
                pass

    async def assembler() -> None:
        service = AssemblerService(AssemblerSettings(group_id="g"), kafka)
        with pytest.raises(KafkaConnectionError):
            await service.start()  # its producer fails before the consumer is started

    async def launcher() -> None:
        settings = LauncherSettings(credential_key="k" * 32, kafka=kafka, state_dir=tmp_path / "state",
                                    workspace_root=tmp_path / "ws", group_id="g")
        service = Launcher(settings)
        with pytest.raises(KafkaConnectionError):
            await service.start()  # its producer fails before the backend and the consumer start

    return {run.__name__: await _leaks(run) for run in (consumer, event_consumer, admin, assembler, launcher)}


async def test_an_admin_that_found_no_cluster_starts_once_the_cluster_is_there_and_again_after_a_stop(
        kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    """aiokafka's clients do not start again once closed; the admin makes new ones for the next start."""
    host, port = kafka_settings.bootstrap_servers.split(",")[0].rsplit(":", 1)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bootstrap through here; the broker's metadata then sends the client to the broker itself."""
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def run() -> None:
        with socket.socket() as sock:  # bound, not listening: refused until the relay listens on it
            sock.bind(("127.0.0.1", 0))
            admin = KafkaAdmin(kafka_settings.model_copy(
                update={"bootstrap_servers": f"127.0.0.1:{sock.getsockname()[1]}"}), topics)
            with pytest.raises(KafkaConnectionError):
                await admin.start()
            server = await asyncio.start_server(relay, sock=sock)
            try:
                await admin.start()
                assert len(await admin.partitions(topics[CALLS].name)) == topics[CALLS].partitions
                await admin.stop()
                await admin.start()
                assert topics[CALLS].name in await admin.list_topics()
            finally:
                await admin.stop()
                server.close()

    assert await _leaks(run) == []
