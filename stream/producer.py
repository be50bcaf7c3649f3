"""The event producer: typed events in, durable Kafka records out.

A thin layer over aiokafka's producer that adds what every OpenForge writer
needs and nothing else: idempotence with ``acks=all`` (no duplicates or losses on
retries), compression, the registry's per-topic size and type checks with errors
that name the limit, schema headers, and W3C trace context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner, murmur2
from aiokafka.structs import RecordMetadata, TopicPartition

from schemas import EventBase, default_registry, encode
from stream.broker import BROKER_MESSAGE_MAX_BYTES
from stream.lifecycle import Managed
from stream.settings import KafkaSettings
from stream.topics import Topic, TopicRegistry, TopicSpec
from stream.tracing import Headers, inject_trace_context

logger = logging.getLogger(__name__)


_KEY_HASHES = 65_536
"""Keys whose partition hash is remembered; the table is emptied when it reaches this size."""


class EventTooLargeError(ValueError):
    """An event exceeds its topic's ``max.message.bytes``; nothing was sent."""


class WrongTopicError(ValueError):
    """An event's schema is not declared for the topic it was sent to."""


def encode_record(
    topic: Topic, event: EventBase, *, key: str | bytes | None = None
) -> tuple[bytes | None, bytes, Headers]:
    """Encode and check one event for ``topic``; returns key, value and headers.

    Raises:
        WrongTopicError: the event's schema is not declared for the topic.
        EventTooLargeError: the encoded event exceeds the topic's limit.
    """
    _check_schema(topic, type(event))
    value, headers = encode(event)
    _check_size(topic, type(event), value)
    record_key = event.kafka_key() if key is None else key
    inject_trace_context(headers)
    return (record_key.encode() if isinstance(record_key, str) else record_key), value, headers


def encoded_record(topic: Topic, cls: type[EventBase], key: bytes, value: bytes) -> tuple[bytes, bytes, Headers]:
    """Key, value and headers of a ``cls`` event whose JSON was written without building it.

    For writers that make an event's JSON straight from its fields (the proxy's shipper does,
    see ``producers.capture.event_json``): the same checks and headers as :func:`encode_record`,
    with no trace context added (the caller adds the event's own).

    Raises:
        WrongTopicError: ``cls`` is not declared for the topic.
        EventTooLargeError: ``value`` exceeds the topic's limit.
    """
    _check_schema(topic, cls)
    _check_size(topic, cls, value)
    return key, value, default_registry.headers_of(cls)


def _check_schema(topic: Topic, cls: type[EventBase]) -> None:
    if cls.SCHEMA not in topic.spec.schemas:
        raise WrongTopicError(
            f"{cls.SCHEMA!r} events do not belong on {topic.name} (it carries {', '.join(topic.spec.schemas)})"
        )


def _check_size(topic: Topic, cls: type[EventBase], value: bytes) -> None:
    if len(value) > topic.spec.max_message_bytes:
        raise EventTooLargeError(
            f"{cls.SCHEMA} event of {len(value):,} bytes exceeds {topic.name}'s "
            f"max.message.bytes={topic.spec.max_message_bytes:,}"
        )


class EventProducer(Managed):
    """Publish registry events to their topics.

    ``send`` returns once the record is queued in the client's buffer and gives a
    future for the broker's acknowledgement; ``publish`` waits for the
    acknowledgement. With ``transactional_id`` the producer joins Kafka
    transactions (see :meth:`transaction`).
    """

    def __init__(
        self,
        settings: KafkaSettings | None = None,
        *,
        registry: TopicRegistry | None = None,
        transactional_id: str | None = None,
        client_id: str | None = None,
    ) -> None:
        self.settings = settings or KafkaSettings()
        self.registry = registry or TopicRegistry.from_settings(self.settings)
        self._transactional_id = transactional_id
        compression = None if self.settings.compression == "none" else self.settings.compression
        self._producer = AIOKafkaProducer(
            **self.settings.client_kwargs(),
            client_id=client_id or self.settings.client_id,
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id,
            compression_type=compression,
            linger_ms=self.settings.linger_ms,
            max_batch_size=self.settings.batch_size_bytes,
            # Our own per-topic check runs first and names the topic's limit; this
            # only has to admit the largest record any topic allows.
            max_request_size=BROKER_MESSAGE_MAX_BYTES,
            request_timeout_ms=self.settings.request_timeout_ms,
        )
        self._started = False
        self._stopped = False
        self._key_hashes: dict[bytes, int] = {}

    async def start(self) -> None:
        """Connect to the cluster (and register the transactional id, if any)."""
        if self._started:
            return
        try:
            await self._producer.start()
        except BaseException:
            await self._producer.stop()  # a failed start still holds sockets and tasks
            raise
        self._started = True

    async def stop(self) -> None:
        """Flush what is buffered, then disconnect. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if not self._started:
            await self._producer.stop()  # never connected; closed, so aiokafka reports no leak
            return
        with contextlib.suppress(Exception):
            await self._producer.flush()
        await self._producer.stop()

    async def abort(self, timeout_s: float) -> None:
        """Stop, giving buffered records at most ``timeout_s`` to be delivered, then drop them.

        For callers that keep their own copy of everything unacknowledged (the proxy's
        spool): with the brokers gone, aiokafka's ``stop()`` would wait for delivery
        retries to expire before closing.
        """
        if self._stopped:
            return
        self._stopped = True
        if not self._started:
            await self._producer.stop()  # never connected; closed, so aiokafka reports no leak
            return
        stopping = asyncio.ensure_future(self._producer.stop())
        done, _ = await asyncio.wait({stopping}, timeout=timeout_s)
        if not done:
            # The sender retries delivery until its own timeout; end it, which lets stop() finish.
            sender = getattr(self._producer, "_sender", None)
            task = getattr(sender, "sender_task", None)
            if task is not None:
                task.cancel()
            await self._producer.client.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(stopping, timeout_s)


    def topic(self, spec: TopicSpec | Topic | str) -> Topic:
        """Resolve a spec, resolved topic or name against this producer's registry."""
        if isinstance(spec, Topic):
            return spec
        if isinstance(spec, TopicSpec):
            return self.registry[spec]
        return self.registry.resolve(spec)

    def encode(
        self, topic: Topic, event: EventBase, *, key: str | bytes | None = None
    ) -> tuple[bytes | None, bytes, Headers]:
        """Encode and check one event for ``topic`` (see :func:`encode_record`)."""
        return encode_record(topic, event, key=key)

    async def send(
        self,
        topic: TopicSpec | Topic | str,
        event: EventBase,
        *,
        key: str | bytes | None = None,
        partition: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue ``event``; the returned future resolves on the broker's acknowledgement."""
        resolved = self.topic(topic)
        record_key, value, headers = self.encode(resolved, event, key=key)
        return await self._send(resolved.name, value, record_key, headers, partition, resolved)

    async def publish(
        self,
        topic: TopicSpec | Topic | str,
        event: EventBase,
        *,
        key: str | bytes | None = None,
    ) -> RecordMetadata:
        """Send ``event`` and wait until the broker has it durably (acks=all)."""
        return await (await self.send(topic, event, key=key))

    async def send_raw(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue already-encoded bytes unchanged (replay tooling, dead letters)."""
        return await self._send(topic, value, key, list(headers), partition, self.registry.by_name(topic),
                                timestamp_ms=timestamp_ms)

    async def send_many_raw(
        self, records: Sequence[tuple[str, bytes | None, bytes | None, Sequence[tuple[str, bytes]]]]
    ) -> list[asyncio.Future[Any]]:
        """Queue many encoded ``(topic, key, value, headers)`` records, one batch per partition.

        Far cheaper per record than :meth:`send_raw` (no future, partition lookup and
        accumulator round per record), for callers that ship a backlog (the proxy's journal).
        Records land on the partitions :meth:`send_raw` would choose, in the given order within
        each partition. A record too large for a batch of its own size goes through
        :meth:`send_raw`. The futures resolve when the broker has acknowledged each batch.
        """
        futures: list[asyncio.Future[Any]] = []
        open_batches: dict[tuple[str, int], Any] = {}
        known: set[str] = set()
        for topic, key, value, headers in records:
            if topic not in known:
                await self._producer.partitions_for(topic)  # waits for metadata, as send() does
                known.add(topic)
            partition = self._partition(topic, key, value)
            batch = open_batches.get((topic, partition))
            if batch is None:
                batch = open_batches[(topic, partition)] = self._producer.create_batch()
            if batch.append(timestamp=None, key=key, value=value, headers=list(headers)) is not None:
                continue
            if batch.record_count() > 0:  # full: submit it (keeps order) and start another
                batch.close()
                futures.append(await self._producer.send_batch(batch, topic, partition=partition))
                batch = open_batches[(topic, partition)] = self._producer.create_batch()
                if batch.append(timestamp=None, key=key, value=value, headers=list(headers)) is not None:
                    continue
            # Larger than a batch: on its own, after what was queued for its partition.
            del open_batches[(topic, partition)]
            futures.append(await self._send(topic, value, key, list(headers), partition, self.registry.by_name(topic)))
        for (topic, partition), batch in open_batches.items():
            if batch.record_count() > 0:
                batch.close()
                futures.append(await self._producer.send_batch(batch, topic, partition=partition))
        return futures

    def _partition(self, topic: str, key: bytes | None, value: bytes | None) -> int:
        """The partition aiokafka's ``send`` would choose for ``key`` (metadata must be known).

        A record lands where ``send()`` would put it, so a rollout's events stay together
        whichever path sent them. aiokafka's default partitioner hashes the key with murmur2
        in pure Python, which cost a capturing proxy tens of microseconds per call event; the
        hash depends on the key alone and a rollout's many calls share their key, so it is
        remembered here and the partition still taken over the current metadata, exactly as
        the default partitioner does. A custom partitioner is always asked.
        """
        if key is None or type(self._producer._partitioner) is not DefaultPartitioner:
            chosen: int = self._producer._partition(topic, None, key, value, key, value)
            return chosen
        hashed = self._key_hashes.get(key)
        if hashed is None:
            if len(self._key_hashes) >= _KEY_HASHES:
                self._key_hashes.clear()
            hashed = self._key_hashes[key] = murmur2(key) & 0x7FFFFFFF
        all_partitions = list(self._producer._metadata.partitions_for_topic(topic))
        chosen = all_partitions[hashed % len(all_partitions)]
        return chosen

    async def _send(
        self,
        name: str,
        value: bytes | None,
        key: bytes | None,
        headers: Headers,
        partition: int | None,
        topic: Topic | None,
        timestamp_ms: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        if partition is None and key is not None:
            await self._producer.partitions_for(name)  # waits for metadata, as send() does
            partition = self._partition(name, key, value)
        try:
            fut: asyncio.Future[RecordMetadata] = await self._producer.send(
                name, value=value, key=key, headers=headers, partition=partition,
                timestamp_ms=timestamp_ms,
            )
        except MessageSizeTooLargeError as exc:
            limit = topic.spec.max_message_bytes if topic else BROKER_MESSAGE_MAX_BYTES
            raise EventTooLargeError(
                f"record of {len(value or b''):,} bytes for {name} exceeds max.message.bytes={limit:,}"
            ) from exc
        return fut

    async def flush(self) -> None:
        """Wait until everything queued so far is acknowledged."""
        await self._producer.flush()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        """Run the block in a Kafka transaction: all its records commit or none do.

        Raises:
            RuntimeError: the producer has no ``transactional_id``.
        """
        if self._transactional_id is None:
            raise RuntimeError("transactions need EventProducer(transactional_id=...)")
        async with self._producer.transaction():
            yield

    async def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int], group_id: str
    ) -> None:
        """Commit a consumer group's offsets as part of the open transaction.

        This is what makes consume-transform-produce exactly-once: the outputs and
        the fact that their inputs were consumed become visible together.
        """
        await self._producer.send_offsets_to_transaction(dict(offsets), group_id)

    async def missing_topics(self, names: Iterable[str]) -> list[str]:
        """Which of ``names`` the cluster does not have, asked of the brokers now.

        Why: a record for a topic that does not exist is not refused; aiokafka waits for the
        topic's metadata until the send times out, so a shipper sees only a timeout. This tells
        an operator what is missing.

        Raises:
            KafkaError: no broker answered (then nothing can be said about the topics).
        """
        cluster = await self._producer.client.fetch_all_metadata()
        present = cluster.topics(exclude_internal_topics=False)
        return sorted({name for name in names if name not in present})

    @property
    def raw(self) -> Any:
        """The underlying aiokafka producer, for what this wrapper does not cover."""
        return self._producer
