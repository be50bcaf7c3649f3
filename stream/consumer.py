"""The event consumer: at-least-once handling that commits only finished work.

Every record is decoded through the schema registry and handed to one async
handler, in offset order per partition. An offset is committed only after its
handler returned (or the record went to the dead-letter topic), so a crash
redelivers unfinished work and never skips it. On a rebalance the revoked
partitions' finished offsets are committed before another member takes them, so
nothing is read twice either. Records that cannot be decoded, carry an unknown
schema, fail validation or keep failing their handler are dead-lettered with the
reason and the consumer keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition
from opentelemetry import context as otel_context
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import DeadLetterErrorType, DeadLetterV1, DecodeError, EventBase, decode
from schemas.backoff import Backoff
from stream.lifecycle import Managed
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.telemetry import ConsumerLag, track_consumer_lag
from stream.topics import DEAD_LETTERS, Topic, TopicRegistry, TopicSpec, start_consumer
from stream.tracing import extract_trace_context

logger = logging.getLogger(__name__)


class ConsumerSettings(BaseSettings):
    """How a consuming process paces, commits and drains (``OPENFORGE_CONSUMER_*``)."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_CONSUMER_", frozen=True, extra="ignore")

    isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed"
    """read_committed hides records of aborted and open transactions (assembler output)."""

    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    """Where a group with no committed offset starts. Earliest loses nothing."""

    commit_interval_s: float = Field(default=1.0, gt=0)
    """How often finished offsets are committed while running. Shorter means less
    redelivery after a crash, at the cost of more commit requests."""

    drain_timeout_s: float = Field(default=20.0, gt=0)
    """How long stop() lets the in-flight handler finish before cancelling it. Keep it
    below the pod's terminationGracePeriodSeconds."""

    max_poll_records: int = Field(default=500, ge=1)
    """Records fetched per poll."""

    handler_attempts: int = Field(default=3, ge=1)
    """Tries per record before a failing handler's record is dead-lettered."""

    retry_backoff_s: float = Field(default=0.2, ge=0)
    """Pause before the first retry; doubles on each further one."""

    session_timeout_ms: int = Field(default=10_000, gt=0)
    """Group membership lease; a crashed member's partitions move after this long."""


@dataclass(frozen=True)
class Received:
    """One decoded record and where it came from."""

    event: EventBase
    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int

    @property
    def trace_context(self) -> otel_context.Context:
        """The producer's trace context, to parent this record's processing span on."""
        return extract_trace_context(self.headers)


Handler = Callable[[Received], Awaitable[None]]


@dataclass
class _Progress:
    handled: dict[TopicPartition, int] = field(default_factory=dict)
    committed: dict[TopicPartition, int] = field(default_factory=dict)

    def pending(self, partitions: Sequence[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        chosen = self.handled if partitions is None else {
            tp: self.handled[tp] for tp in partitions if tp in self.handled
        }
        return {tp: off for tp, off in chosen.items() if self.committed.get(tp) != off}


class EventConsumer(Managed):
    """Consume registry topics in a group and hand each event to ``handler``.

    Use as ``async with EventConsumer(...) as consumer: await consumer.wait()``;
    ``stop()`` (from a signal handler, say) drains and returns.
    """

    def __init__(
        self,
        topics: Sequence[TopicSpec | Topic | str],
        handler: Handler,
        *,
        group_id: str,
        kafka: KafkaSettings | None = None,
        settings: ConsumerSettings | None = None,
        registry: TopicRegistry | None = None,
        dead_letters: EventProducer | None = None,
        read_only: bool = False,
    ) -> None:
        """Set up the consumer; nothing connects before :meth:`start`.

        Args:
            topics: What to read.
            handler: Called once per decoded record, in offset order per partition.
            group_id: The consumer group.
            kafka: How to reach the cluster.
            settings: Pacing, commits and draining.
            registry: The topic registry (prefix).
            dead_letters: The producer for dead letters; one of its own when None.
            read_only: An observer that writes nothing to Kafka (the web UI): a record it cannot
                decode or handle is logged and skipped, since the consumers that own the topic
                dead-letter it themselves.
        """
        self.kafka = kafka or KafkaSettings()
        self.settings = settings or ConsumerSettings()
        self.registry = registry or TopicRegistry.from_settings(self.kafka)
        self.group_id = group_id
        self._topics = [self._resolve(t) for t in topics]
        self._handler = handler
        self._own_dlq = dead_letters is None and not read_only
        self._dlq = None if read_only else dead_letters or EventProducer(
            self.kafka, registry=self.registry, client_id=f"{self.kafka.client_id}-dlq")
        largest = max((t.spec.max_message_bytes for t in self._topics), default=1024 * 1024)
        self._consumer = AIOKafkaConsumer(
            **self.kafka.client_kwargs(),
            client_id=self.kafka.client_id,
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset=self.settings.auto_offset_reset,
            isolation_level=self.settings.isolation_level,
            max_partition_fetch_bytes=largest,
            fetch_max_bytes=max(largest, 52_428_800),
            session_timeout_ms=self.settings.session_timeout_ms,
            request_timeout_ms=self.kafka.request_timeout_ms,
        )
        self._progress = _Progress()
        self._lock = asyncio.Lock()  # held while one record is handled; rebalances wait for it
        self._revoked: set[TopicPartition] = set()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False
        self._last_commit = 0.0
        self._lag: ConsumerLag | None = None
        self.dead_lettered = 0
        """Records sent to the dead-letter topic by this instance (for metrics and tests)."""
        self.skipped = 0
        """Records a read-only consumer could not decode or handle, and skipped."""

    def _resolve(self, topic: TopicSpec | Topic | str) -> Topic:
        if isinstance(topic, Topic):
            return topic
        if isinstance(topic, TopicSpec):
            return self.registry[topic]
        return self.registry.resolve(topic)

    async def start(self) -> None:
        """Join the group and begin consuming in a task owned by this object."""
        if self._started:
            return
        self._started = True
        try:
            if self._own_dlq and self._dlq is not None:
                await self._dlq.start()
            self._consumer.subscribe(
                topics=[t.name for t in self._topics], listener=_CommitOnRevoke(self)
            )
            await start_consumer(self._consumer, [t.name for t in self._topics], self.kafka)
        except BaseException:
            self._stopped = True  # nothing runs: there is nothing left to stop
            with contextlib.suppress(Exception):
                await self._consumer.stop()  # never started if the dead-letter producer's start failed
            if self._own_dlq and self._dlq is not None:
                try:
                    await self._dlq.stop()
                except Exception:  # the start's error is the one to see; this one is logged
                    logger.exception("consumer %s: closing the dead-letter producer failed", self.group_id)
            raise
        self._lag = track_consumer_lag(self.group_id, self._consumer, lambda: self._progress.handled)
        self._task = asyncio.create_task(self._run(), name=f"consume:{self.group_id}")

    async def wait(self) -> None:
        """Return when the consumer stopped; re-raise what ended it, if anything did."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Drain within ``drain_timeout_s``, commit finished offsets, leave the group.

        Idempotent: a signal handler and ``__aexit__`` may both call it.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()  # 1 stop intake: the loop fetches nothing more
        if self._lag is not None:
            self._lag.close()
        if self._task is not None:
            # 2 drain: the in-flight record may finish; past the deadline it is
            # cancelled, stays uncommitted and is redelivered to the next owner.
            done, _ = await asyncio.wait({self._task}, timeout=self.settings.drain_timeout_s)
            if not done:
                logger.warning("%s: drain deadline passed; cancelling the in-flight record", self.group_id)
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        try:
            with contextlib.suppress(Exception):
                await self._commit()  # 3 commit only fully handled offsets
        finally:
            await self._consumer.stop()  # 4 leave the group: the others rebalance at once
            if self._own_dlq and self._dlq is not None:
                await self._dlq.stop()  # 5 flush dead letters


    @property
    def committed_offsets(self) -> dict[TopicPartition, int]:
        """Offsets this instance committed, per partition (next offset to read)."""
        return dict(self._progress.committed)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            fetch = asyncio.ensure_future(
                self._consumer.getmany(timeout_ms=500, max_records=self.settings.max_poll_records)
            )
            stop = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not fetch.done():
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fetch
                break
            batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = fetch.result()
            for tp, records in batches.items():
                for record in records:
                    if self._stopping.is_set():
                        return
                    async with self._lock:
                        if tp in self._revoked or tp not in self._consumer.assignment():
                            break  # another member owns it now; it will read this record
                        await self._process(tp, record)
            if time.monotonic() - self._last_commit >= self.settings.commit_interval_s:
                await self._commit()

    async def _process(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        headers = tuple((k, v) for k, v in (record.headers or ()))
        topic = self.registry.by_name(record.topic)
        try:
            event = decode(headers, record.value if record.value is not None else b"")
        except DecodeError as exc:
            await self._dead_letter(record, exc.kind, exc.reason)
        else:
            if topic is not None and type(event).SCHEMA not in topic.spec.schemas:
                await self._dead_letter(
                    record, DeadLetterErrorType.INVALID_EVENT,
                    f"{type(event).SCHEMA!r} events do not belong on {record.topic}",
                )
            else:
                await self._handle(Received(event, record.topic, record.partition, record.offset,
                                            record.key, headers, record.timestamp), record)
        self._progress.handled[tp] = record.offset + 1

    async def _handle(self, received: Received, record: ConsumerRecord[bytes, bytes]) -> None:
        backoff = Backoff(self.settings.retry_backoff_s)
        for attempt in range(1, self.settings.handler_attempts + 1):
            try:
                await self._handler(received)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - per-record failures must not stop the group
                if attempt == self.settings.handler_attempts:
                    reason = (f"handler failed {attempt} times; last error: "
                              f"{''.join(traceback.format_exception_only(exc)).strip()}")
                    logger.error("%s: %s at %s[%d]@%d", self.group_id, reason,
                                 record.topic, record.partition, record.offset)
                    await self._dead_letter(record, DeadLetterErrorType.HANDLER_ERROR, reason,
                                            f"{type(exc).__module__}.{type(exc).__qualname__}")
                    return
                logger.warning("%s: handler attempt %d failed at %s[%d]@%d: %s; retrying",
                               self.group_id, attempt, record.topic, record.partition, record.offset, exc)
                await asyncio.sleep(backoff.next_s())

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], kind: DeadLetterErrorType,
                           reason: str, exception_type: str | None = None) -> None:
        if self._dlq is None:
            logger.warning("%s: skipping %s[%d]@%d (%s): %s", self.group_id, record.topic, record.partition,
                           record.offset, kind.value, reason)
            self.skipped += 1
            return
        value = record.value
        # The copy travels base64-encoded (4/3 larger); cut what cannot fit, and say so.
        room = self.registry[DEAD_LETTERS].spec.max_message_bytes * 3 // 4 - 64 * 1024
        truncated = value is not None and len(value) > room
        letter = DeadLetterV1(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=record.timestamp,
            key=record.key,
            value=value[:room] if truncated and value is not None else value,
            value_truncated=truncated,
            headers=[(k, v) for k, v in (record.headers or ())],
            error_type=kind,
            reason=reason,
            exception_type=exception_type,
            consumer_group=self.group_id,
        )
        logger.warning("%s: dead-lettering %s[%d]@%d (%s): %s", self.group_id, record.topic,
                       record.partition, record.offset, kind.value, reason)
        # Waiting for the acknowledgement is what makes "dead-lettered" safe to commit.
        await self._dlq.publish(DEAD_LETTERS, letter)
        self.dead_lettered += 1

    async def _commit(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        pending = self._progress.pending(partitions)
        self._last_commit = time.monotonic()
        if not pending:
            return
        await self._consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in pending.items()})
        self._progress.committed.update(pending)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Finish the record in flight, then commit the revoked partitions' progress."""
        async with self._lock:
            self._revoked |= set(revoked)
            try:
                await self._commit(list(revoked))
            except Exception:
                logger.exception("%s: commit on revoke failed; the next owner may reread", self.group_id)
            for tp in revoked:
                self._progress.handled.pop(tp, None)
                self._progress.committed.pop(tp, None)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Forget earlier revocations of partitions this member owns again."""
        self._revoked -= set(assigned)


class _CommitOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: EventConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._owner.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self._owner.on_assigned(set(assigned))
