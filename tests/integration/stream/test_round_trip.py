"""Every registered event type survives a trip through the real broker unchanged."""

from __future__ import annotations

import asyncio

import pytest
from unit.schemas.schema_examples import all_examples

from schemas import all_events
from stream.consumer import ConsumerSettings, EventConsumer, Received
from stream.producer import EventProducer
from stream.topics import TopicRegistry

pytestmark = pytest.mark.kafka


async def test_every_event_type_round_trips_through_kafka(kafka_settings, topics: TopicRegistry) -> None:
    examples = all_examples()
    assert {type(e) for e in examples} == set(all_events()), "an event type has no example"
    home = {schema: topic for topic in topics for schema in topic.spec.schemas}
    received: list[Received] = []

    async def handle(r: Received) -> None:
        received.append(r)

    async with EventProducer(kafka_settings) as producer:
        for event in examples:
            await producer.publish(home[type(event).SCHEMA], event)
    async with EventConsumer(list(topics), handle, group_id="g-round-trip", kafka=kafka_settings,
                             settings=ConsumerSettings(commit_interval_s=0.2)):
        deadline = asyncio.get_running_loop().time() + 30
        while len(received) < len(examples) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
    by_id = {r.event.event_id: r for r in received}
    assert len(received) == len(examples)
    for event in examples:
        got = by_id[event.event_id]
        assert got.event == event
        assert type(got.event) is type(event)
        assert got.topic == home[type(event).SCHEMA].name
        assert got.key == event.kafka_key()
