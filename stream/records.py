"""Reading single records back by where they are: topic, partition and offset.

An index that keeps only summaries and each record's position (the web UI's) reads the whole event
from Kafka when someone looks at it. One consumer, outside any group, stays open for that: each
read assigns the partitions it needs, seeks to each offset and takes the record found there, so a
rollout's few calls cost a few seeks rather than a scan of everything written between them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from schemas import DecodeError, EventBase, decode
from stream.lifecycle import Managed
from stream.settings import KafkaSettings
from stream.topics import TopicRegistry

__all__ = ["RecordReader"]

_MAX_RECORD_BYTES = 64 * 1024 * 1024


class RecordReader(Managed):
    """Decoded events at given positions; ``start()``, ``read()``, idempotent ``stop()``."""

    def __init__(self, kafka: KafkaSettings, registry: TopicRegistry | None = None, *, timeout_s: float = 10.0) -> None:
        self.kafka = kafka
        self.registry = registry or TopicRegistry.from_settings(kafka)
        self.timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()  # one read at a time: seeks of two reads would interleave
        self._assigned: set[TopicPartition] = set()
        self._stopped = False

    async def start(self) -> None:
        """Connect (no group, nothing committed)."""
        if self._consumer is not None:
            return
        consumer = AIOKafkaConsumer(
            **self.kafka.client_kwargs(), client_id=f"{self.kafka.client_id}-reader", enable_auto_commit=False,
            isolation_level="read_committed", max_partition_fetch_bytes=_MAX_RECORD_BYTES,
            fetch_max_bytes=_MAX_RECORD_BYTES,
            # A fetch the broker holds open waiting for data delays the next read's fetch on that broker:
            # reads ask for records that exist, so the broker need not wait.
            fetch_max_wait_ms=10)
        await consumer.start()
        self._consumer = consumer

    async def stop(self) -> None:
        """Disconnect. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._consumer is not None:
            await self._consumer.stop()

    async def read(self, positions: Iterable[tuple[str, int, int]]) -> dict[tuple[str, int, int], EventBase | None]:
        """The events at ``(topic, partition, offset)`` positions.

        Returns:
            Each position's event; None where the record is gone (past the topic's retention), is not
            there within the reader's timeout, or does not decode.
        """
        wanted = sorted(set(positions))
        found: dict[tuple[str, int, int], EventBase | None] = dict.fromkeys(wanted)
        if not wanted:
            return found
        if self._consumer is None:
            await self.start()
        consumer = self._consumer
        assert consumer is not None
        async with self._lock:
            needed = {TopicPartition(t, p) for t, p, _ in wanted}
            if not needed <= self._assigned:
                # Assigned once and kept, all paused: only the partition being read fetches anything.
                self._assigned |= needed
                consumer.assign(sorted(self._assigned))
                consumer.pause(*self._assigned)
            for topic, partition, offset in wanted:
                if found[(topic, partition, offset)] is not None:
                    continue  # read along with an earlier position
                tp = TopicPartition(topic, partition)
                consumer.resume(tp)
                consumer.seek(tp, offset)  # after resume: a seek wakes the fetcher, a resume does not
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._take(consumer, tp, offset, found), self.timeout_s)
                finally:
                    # Records fetched past the one wanted stay buffered, and while any partition has
                    # unconsumed records the fetcher holds back every fetch to its broker: a seek drops them.
                    consumer.seek(tp, offset)
                    consumer.pause(tp)
        return found

    async def _take(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int,
                    found: dict[tuple[str, int, int], EventBase | None]) -> None:
        # Records before a retained start are gone: the broker answers from its first offset on.
        while True:
            batches = await consumer.getmany(tp, timeout_ms=500, max_records=50)
            reached = False
            for record in batches.get(tp, []):
                key = (tp.topic, tp.partition, record.offset)
                if key in found and found[key] is None:
                    found[key] = _decoded(record.headers, record.value)  # later wanted ones come along
                reached = reached or record.offset >= offset
            if reached or await consumer.position(tp) > offset:
                return  # past the offset: read, or it held a transaction marker or was deleted


def _decoded(headers: object, value: bytes | None) -> EventBase | None:
    try:
        return decode([(k, v) for k, v in (headers or ())], value or b"")  # type: ignore[attr-defined]
    except DecodeError:
        return None
