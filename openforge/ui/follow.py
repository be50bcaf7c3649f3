"""Following the topics into the index, live, through the project's consumer.

The consumer group is named after the index file's identity (:meth:`Index.identity`): a new file
starts from the topics' beginning, a kept one resumes at its committed offsets. Each record is
written (and committed to SQLite) before its offset is committed to Kafka, and writes are
idempotent, so a crash neither loses nor doubles a row. The group is read-only: it dead-letters
nothing, the topics' own consumers do.
"""

from __future__ import annotations

import asyncio
import logging

from openforge.ui.index import Index, Position
from stream.consumer import ConsumerSettings, EventConsumer, Received
from stream.settings import KafkaSettings
from stream.topics import CALLS, CHECKPOINTS, DEAD_LETTERS, REWARDS, ROLLOUTS, STEPS, TRAJECTORIES, TopicSpec

__all__ = ["FOLLOWED", "follower", "group_id"]

logger = logging.getLogger(__name__)

FOLLOWED: tuple[TopicSpec, ...] = (CALLS, ROLLOUTS, REWARDS, TRAJECTORIES, CHECKPOINTS, STEPS, DEAD_LETTERS)
"""Every topic the flight recorder shows."""


def group_id(index: Index) -> str:
    """The consumer group of this index file."""
    return f"openforge-ui-{index.identity()}"


def follower(index: Index, kafka: KafkaSettings, settings: ConsumerSettings | None = None) -> EventConsumer:
    """A consumer (not started) that writes every followed record into ``index``."""

    async def handle(received: Received) -> None:
        index.ingest(received.event, Position(received.topic, received.partition, received.offset), received.headers)
        # The consumer hands over a whole fetched batch without waiting: let the pages in between records.
        await asyncio.sleep(0)

    return EventConsumer(FOLLOWED, handle, group_id=group_id(index), kafka=kafka,
                         settings=settings or ConsumerSettings(), read_only=True)
