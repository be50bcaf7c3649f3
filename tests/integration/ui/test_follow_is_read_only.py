"""The flight recorder's consumer writes nothing to Kafka: a record it cannot decode is skipped, not dead-lettered."""

from __future__ import annotations

import asyncio

import pytest
from flight_events import RECOVERED, tool_rollout

from openforge.ui.follow import follower, group_id
from openforge.ui.index import Index
from stream import CALLS, DEAD_LETTERS, EventProducer, KafkaSettings, TopicRegistry
from stream.tooling import read_topic

pytestmark = pytest.mark.kafka


async def test_an_undecodable_record_is_skipped_and_nothing_is_written(kafka_settings: KafkaSettings,
                                                                      topics: TopicRegistry) -> None:
    [call, *_] = tool_rollout("r-1", RECOVERED).calls
    async with EventProducer(kafka_settings) as producer:
        await producer.send_raw(topics[CALLS].name, b"not json", key=b"r-1",
                                headers=[("schema", b"model_call"), ("schema-version", b"1")])
        await producer.send(CALLS, call)
        await producer.flush()
    index = Index(":memory:")
    consumer = follower(index, kafka_settings)
    assert consumer.group_id == group_id(index) == f"openforge-ui-{index.identity()}"
    async with consumer:
        for _ in range(200):
            if index.value("SELECT count(*) FROM calls") == 1 and consumer.skipped == 1:
                break
            await asyncio.sleep(0.1)
    assert index.value("SELECT call_id FROM calls") == call.call_id
    assert (consumer.skipped, consumer.dead_lettered) == (1, 0)
    assert [r async for r in read_topic(kafka_settings, topics[DEAD_LETTERS].name)] == []
