"""The Kafka source hands over a record it has already decoded without a trip through the event loop."""

from __future__ import annotations

from typing import cast

import pytest
from trajectories import trajectory

from learner.positions import Position
from learner.sources import Incoming, KafkaTrajectorySource
from stream import EventProducer, KafkaSettings, TopicRegistry


async def test_a_decoded_record_is_handed_over_at_once() -> None:
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic_prefix="unit.")
    source = KafkaTrajectorySource(kafka, TopicRegistry.from_settings(kafka), cast(EventProducer, None),
                                   start_offsets={})
    try:
        queued = Incoming(trajectory("t", 0), Position("unit.trajectories", 0, 7))
        source._queue.put_nowait(queued)
        # A step needs many records; each round trip through a busy event loop costs the learner time.
        pending = source.get(timeout_s=5.0)
        try:
            with pytest.raises(StopIteration) as done:  # returned without suspending once
                pending.send(None)
        finally:
            pending.close()
        assert done.value.value is queued
    finally:
        await source.stop()
