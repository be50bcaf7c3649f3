"""Where trajectories come from: the Kafka topic (production) or an in-memory list (benchmarks).

The Kafka source assigns every partition of the trajectories topic to itself (no consumer group:
the offsets stored with each checkpoint are the source of truth), seeks to where the checkpoint
left off, and decodes ahead of training in its own task into a bounded buffer, so fetching and
decoding overlap with the optimizer step. Records that are not valid trajectories are
dead-lettered with the reason and still handed on (without an event) so their offset counts as
finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace

from learner.positions import Position, TopicPartitionKey
from schemas import DeadLetterErrorType, DeadLetterV1, DecodeError, TrajectoryV1, decode
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.telemetry import ConsumerLag, track_consumer_lag
from stream.topics import DEAD_LETTERS, TRAJECTORIES, TopicRegistry
from stream.tracing import extract_trace_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Incoming:
    """One record: a trajectory, or None when it was dead-lettered."""

    trajectory: TrajectoryV1 | None
    position: Position
    span_context: trace.SpanContext | None = None
    """The assembler span that produced the record (from its headers), for the step span to link to."""


class TrajectorySource(Protocol):
    """What the trainer reads from."""

    async def start(self) -> None:
        """Connect and position."""

    async def get(self, timeout_s: float) -> Incoming | None:
        """The next record, or None if none arrived within ``timeout_s``."""

    @property
    def exhausted(self) -> bool:
        """True when no record will ever come again (finite sources only)."""

    async def stop(self) -> None:
        """Release connections; idempotent."""


class ListTrajectorySource:
    """Trajectories from memory, positioned on a pseudo topic ``memory``."""

    def __init__(self, trajectories: Sequence[TrajectoryV1]) -> None:
        self._items = list(trajectories)
        self._next = 0

    async def start(self) -> None:
        """Nothing to connect."""

    async def get(self, timeout_s: float) -> Incoming | None:
        """The next trajectory; None when all were handed out."""
        if self._next >= len(self._items):
            return None
        item = Incoming(self._items[self._next], Position("memory", 0, self._next))
        self._next += 1
        return item

    @property
    def exhausted(self) -> bool:
        """All trajectories were handed out."""
        return self._next >= len(self._items)

    async def stop(self) -> None:
        """Nothing to release."""


class KafkaTrajectorySource:
    """The trajectories topic, read from stored offsets, decoded ahead into a bounded buffer."""

    def __init__(self, kafka: KafkaSettings, registry: TopicRegistry, dead_letters: EventProducer, *,
                 start_offsets: Mapping[TopicPartitionKey, int], prefetch: int = 4096) -> None:
        self._kafka = kafka
        self._registry = registry
        self._topic = registry[TRAJECTORIES]
        self._dlq = dead_letters
        self._start_offsets = dict(start_offsets)
        self._queue: asyncio.Queue[Incoming] = asyncio.Queue(maxsize=prefetch)
        self._consumer = AIOKafkaConsumer(
            **kafka.client_kwargs(), client_id=f"{kafka.client_id}-learner",
            group_id=None, enable_auto_commit=False, isolation_level="read_committed",
            max_partition_fetch_bytes=self._topic.spec.max_message_bytes,
            fetch_max_bytes=max(self._topic.spec.max_message_bytes, 52_428_800),
            request_timeout_ms=kafka.request_timeout_ms,
        )
        self._task: asyncio.Task[None] | None = None
        self._handed: dict[TopicPartition, int] = {}
        self._in_hand = 0
        self._lag: ConsumerLag | None = None
        self._started = False
        self._stopped = False
        self.dead_lettered = 0
        """Records sent to the dead-letter topic."""

    async def start(self) -> None:
        """Assign all partitions, seek to the stored offsets (else the beginning), start prefetching.

        Raises:
            CheckpointError: the trajectories topic does not exist.
        """
        if self._started:
            return
        self._started = True
        from learner.checkpoint import topic_partitions

        try:
            tps = await topic_partitions(self._kafka, self._registry, self._topic.name)
            await self._consumer.start()
            self._consumer.assign(tps)
            for tp in tps:
                offset = self._start_offsets.get((tp.topic, tp.partition))
                if offset is None:
                    await self._consumer.seek_to_beginning(tp)
                else:
                    self._consumer.seek(tp, offset)
        except BaseException:
            await self.stop()  # the consumer exists from the constructor on: closed even if never started
            raise
        # No consumer group: the lag is that of records not yet handed to the trainer.
        self._lag = track_consumer_lag("learner", self._consumer, lambda: self._handed)
        self._task = asyncio.create_task(self._pump(), name="learner-prefetch")

    async def _pump(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=500, max_records=500)
            self._in_hand += sum(len(records) for records in batches.values())
            for records in batches.values():
                for record in records:
                    await self._queue.put(await self._decode(record))

    async def _decode(self, record: ConsumerRecord[bytes, bytes]) -> Incoming:
        position = Position(record.topic, record.partition, record.offset)
        headers = tuple(record.headers or ())
        try:
            event = decode(headers, record.value)
        except DecodeError as exc:
            await self._dead_letter(record, exc.kind, exc.reason)
            return Incoming(None, position)
        if not isinstance(event, TrajectoryV1):
            await self._dead_letter(record, DeadLetterErrorType.INVALID_EVENT,
                                    f"{type(event).SCHEMA!r} events do not belong on {record.topic}")
            return Incoming(None, position)
        context = trace.get_current_span(extract_trace_context(headers)).get_span_context()
        return Incoming(event, position, context if context.is_valid else None)

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], kind: DeadLetterErrorType, reason: str) -> None:
        logger.warning("dead-lettering %s[%d]@%d (%s): %s", record.topic, record.partition, record.offset,
                       kind.value, reason)
        await self._dlq.publish(DEAD_LETTERS, DeadLetterV1(
            topic=record.topic, partition=record.partition, offset=record.offset, timestamp_ms=record.timestamp,
            key=record.key, value=record.value, headers=list(record.headers or ()), error_type=kind,
            reason=reason, consumer_group="learner",
        ))
        self.dead_lettered += 1

    async def get(self, timeout_s: float) -> Incoming | None:
        """The next decoded record, or None after ``timeout_s``; re-raises a failure of the prefetcher.

        A record already decoded is handed over at once, without a round trip through the event
        loop: a step needs every member of its groups, and on a busy machine each round trip can
        wait tens of milliseconds for the CPU, which added up to a large part of a step.
        """
        if self._task is not None and self._task.done() and self._queue.empty():
            self._task.result()  # raises what ended it
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout_s)
            except TimeoutError:
                return None
        self._handed[TopicPartition(item.position.topic, item.position.partition)] = item.position.offset + 1
        self._in_hand -= 1
        return item

    @property
    def in_hand(self) -> int:
        """Records fetched but not yet handed to the trainer."""
        return self._in_hand

    async def read_offsets(self) -> dict[TopicPartitionKey, int]:
        """Per partition, the next offset the consumer fetches (records below it are in hand or handed)."""
        return {(tp.topic, tp.partition): await self._consumer.position(tp) for tp in self._consumer.assignment()}

    @property
    def exhausted(self) -> bool:
        """A topic never ends."""
        return False

    async def stop(self) -> None:
        """Stop prefetching and close the consumer."""
        if self._stopped:
            return
        self._stopped = True
        if self._lag is not None:
            self._lag.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._consumer.stop()  # made in the constructor, so closed even if never started
