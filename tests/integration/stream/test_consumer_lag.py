"""Consumer lag as the ``openforge.consumer.lag`` gauge reports it, measured on the real broker."""

from __future__ import annotations

import asyncio

import pytest
from factories import reward

from stream import telemetry
from stream.consumer import EventConsumer, Received
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import REWARDS, TopicRegistry

pytestmark = pytest.mark.kafka


def _lag_of(group: str) -> dict[str, int]:
    """What the gauge's callback observes for ``group``, by topic."""
    return {str(o.attributes["topic"]): int(o.value) for o in telemetry._observe_lag(None)  # type: ignore[arg-type]
            if o.attributes and o.attributes["group"] == group}


async def test_lag_counts_records_not_yet_handled_per_group_and_topic(
        topics: TopicRegistry, kafka_settings: KafkaSettings) -> None:
    async with EventProducer(kafka_settings) as producer:
        for i in range(6):
            await producer.send(REWARDS, reward(f"r-{i}"), key="same-partition")
        await producer.flush()

    release = asyncio.Event()
    handled: list[str] = []

    async def handle(received: Received) -> None:
        handled.append(received.key.decode() if received.key else "")
        if len(handled) == 3:
            await release.wait()  # hold the third record: two are handled, four (this one too) are not

    group = f"{kafka_settings.topic_prefix}lag"
    name = topics[REWARDS].name
    consumer = EventConsumer([REWARDS], handle, group_id=group, kafka=kafka_settings, registry=topics)
    async with consumer:
        deadline = asyncio.get_running_loop().time() + 30
        while _lag_of(group).get(name) != 4:
            assert asyncio.get_running_loop().time() < deadline, _lag_of(group)
            await asyncio.sleep(0.1)
        release.set()
        while _lag_of(group).get(name) != 0:
            assert asyncio.get_running_loop().time() < deadline, _lag_of(group)
            await asyncio.sleep(0.1)
    assert len(handled) == 6
    assert _lag_of(group) == {}  # a stopped consumer is no longer reported
