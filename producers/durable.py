"""Publish so that nothing is lost: Kafka's acknowledgement, or the disk spool.

``publish`` returns only when the event is durable: acknowledged by Kafka
(acks=all) or fsynced into the spool. While Kafka is unreachable every event goes
to the spool, in order; a background drainer re-sends spooled records oldest
first and switches back to direct publishing only once the spool is empty, so a
rollout's events never overtake each other. A spool left by a crashed or stopped
process is drained after restart.

A record whose acknowledgement timed out is spooled too; if the client still
delivers it later, Kafka holds it twice with the same ``event_id``, which the
assembler drops. Duplicates are recoverable; a lost call is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import aiokafka.errors as kafka_errors

from producers.capture import CallCapture
from producers.disk_room import DiskRoom
from producers.raw_calls import EngineExchange, dead_letter, pack_raw_call
from producers.spool import DiskSpool, SpooledRecord
from schemas import EventBase
from schemas._errors import DeadLetterErrorType
from schemas.call.v1 import CallStatus
from stream import CALLS, REWARDS, EventProducer, NotAuthorizedError, TopicRegistry, TopicSpec
from stream.producer import EventTooLargeError, encode_record
from stream.topics import unauthorized_topics

logger = logging.getLogger(__name__)

Outcome = Literal["kafka", "spool", "journal"]
"""Where a published event went: acknowledged by Kafka, fsynced to the spool, or in the journal."""


_refused_start: str | None = None
"""The last refusal of a producer's start by the cluster's ACLs that was logged (see ``connect_producer``)."""


async def connect_producer(factory: Callable[[], EventProducer], timeout_s: float,
                           meanwhile: str) -> EventProducer | None:
    """A started producer, or None (logged, saying what happens ``meanwhile``) when Kafka is unreachable.

    Both event logs of the proxy start without Kafka and keep events on disk until it answers.
    """
    global _refused_start
    producer = factory()
    try:
        await asyncio.wait_for(producer.start(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - unreachable Kafka is an expected state here
        if (topics := unauthorized_topics(exc, ())) is not None:
            # Said loudly once; every later try (each few seconds) quietly, until it changes.
            said = str(NotAuthorizedError.of(topics, producer.settings, cluster=True))
            logger.log(logging.INFO if said == _refused_start else logging.ERROR, "%s; %s", said, meanwhile)
            _refused_start = said
        else:
            logger.warning("Kafka unreachable (%r); %s", exc, meanwhile)
        with contextlib.suppress(Exception):
            await producer.stop()
        return None
    _refused_start = None
    return producer


class LetterRefusedError(RuntimeError):
    """Kafka refused a record and its dead letter too: a topic's limit to raise, not a record to drop.

    Topics made outside ``openforge topics create`` keep the broker's default ``max.message.bytes``
    (about 1 MiB), below a long conversation's event; the record waits, with those after it.
    """

    @classmethod
    def of(cls, record: str, topic: str, size: int, refusal: Exception, letters: str, letter_size: int,
           letter_refusal: Exception, folder: Path) -> LetterRefusedError:
        """The error for ``record`` (as the log names it), with the remedy: the two limits to raise."""
        return cls(f"Kafka refused {record} for {topic} ({refusal!r}) and its dead letter for {letters} too "
                   f"({letter_refusal!r}); it and the records after it wait in {folder} and are sent once either "
                   f"topic takes it: raise max.message.bytes of {topic} above {size} bytes, or of {letters} above "
                   f"{letter_size} (`openforge topics describe` shows what the broker has)")


REFUSED: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError, kafka_errors.RecordListTooLargeError, kafka_errors.RecordTooLargeError,
    kafka_errors.CorruptRecordException, kafka_errors.InvalidTopicError,
    kafka_errors.UnsupportedForMessageFormatError, kafka_errors.PolicyViolationError, EventTooLargeError,
)
"""Kafka's ways of refusing a record itself rather than the connection: sending it again cannot
help, and every record behind it would wait for ever. Such a record goes to the dead-letter topic.
The broker's answer and the client's own checks while queueing (its size limit) alike.

Not among them: a topic this client may not write (``TopicAuthorizationFailedError``). That is
the cluster's ACLs, an operator's to fix; until then the events wait on local disk
(:class:`stream.NotAuthorizedError` says what to grant) instead of every one going to the
dead-letter topic."""


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """Read a send's outcome nobody waits for, so asyncio does not report it as never retrieved."""
    if not future.cancelled():
        future.exception()



def first_reward_after_a_call(topics: list[str], rewards_topic: str) -> int | None:
    """In a batch of records to these ``topics``, the index of the first reward after another record.

    A batch is cut there: the reward goes only once the calls before it are acknowledged. Within
    one batch, a reward's partition may have a leader that answers while a call's does not (it
    moves, or is down), and a reward in Kafka ahead of its rollout's last call ends the rollout in
    the assembler without that call. Rewards in a row still share a batch: what each must follow
    is its rollout's calls, not the other rewards.
    """
    calls = False
    for index, topic in enumerate(topics):
        if topic != rewards_topic:
            calls = True
        elif calls:
            return index
    return None

class EventLog(Protocol):
    """What the proxy needs of whatever keeps its events: this module's or the journal's."""

    @property
    def publish_errors(self) -> int:
        """Sends or batches that failed and were kept on disk or sent again."""

    @property
    def flush_errors(self) -> int:
        """Flushes of local storage to the disk that failed (readiness and a metric report them)."""

    @property
    def kafka_ok(self) -> bool:
        """Events are reaching Kafka (readiness reports it)."""

    @property
    def backlog(self) -> int:
        """Events kept on local disk that Kafka does not have yet."""

    @property
    def accepting(self) -> bool:
        """False when the local bound is reached: answer 503 rather than take work."""

    @property
    def disk(self) -> DiskRoom:
        """Free space on the disk that keeps events (readiness reports it)."""

    async def start(self) -> None:
        """Open local storage and connect to Kafka if it is there."""

    async def publish(self, topic: TopicSpec, event: EventBase, *, wait_for_kafka: bool = ...) -> Outcome:
        """Keep ``event`` durably; with ``wait_for_kafka``, try to have it in Kafka before returning."""

    async def publish_call(self, capture: CallCapture, status: CallStatus, *, upstream_status_code: int | None,
                           error_message: str | None, upstream_replica: str | None,
                           exchange: EngineExchange | None = None) -> Outcome:
        """Keep the event of a finished call (built here, or journalled raw and built when shipped).

        ``exchange``, for a whole answer that ended ``ok``, lets a journal keep the engine's bytes
        instead of the capture's fields.
        """

    async def stop(self) -> None:
        """Hand over what Kafka will take in time; keep the rest on disk. Idempotent."""


class DurablePublisher:
    """Kafka first, disk when Kafka cannot take it; drains the disk in the background."""

    def __init__(
        self,
        producer_factory: Callable[[], EventProducer],
        spool: DiskSpool,
        registry: TopicRegistry,
        *,
        ack_timeout_s: float = 5.0,
        drain_interval_s: float = 1.0,
        min_free_bytes: int = 0,
    ) -> None:
        self._factory = producer_factory
        self._producer: EventProducer | None = None
        self.spool = spool
        self.disk = DiskRoom(spool.directory, min_free_bytes)
        """Free space on the spool's disk; while spooling, calls are refused below ``min_free_bytes``."""
        self.registry = registry
        self._rewards_topic = registry[REWARDS].name
        self.ack_timeout_s = ack_timeout_s
        self.drain_interval_s = drain_interval_s
        self._direct = False
        self._order = asyncio.Lock()  # spool appends vs. the switch back to direct mode
        self._spooling = 0  # appends waiting for the spool (see _drain_once)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.publish_errors = 0
        """Sends that failed or timed out and were spooled instead."""
        self.refused = 0
        """Spooled records Kafka refused, sent to the dead-letter topic instead."""
        self._one_at_a_time = False  # after an authorization failure: see _drain_once
        self._keeping: set[asyncio.Future[Outcome]] = set()

    @property
    def direct(self) -> bool:
        """True while events go straight to Kafka (healthy, spool empty)."""
        return self._direct

    @property
    def flush_errors(self) -> int:
        """Always 0: the spool flushes each record as it is written, and a failed flush raises to its caller."""
        return 0

    @property
    def kafka_ok(self) -> bool:
        """Readiness's view: events reach Kafka directly."""
        return self._direct

    @property
    def backlog(self) -> int:
        """Events waiting on disk for Kafka."""
        return len(self.spool)

    @property
    def accepting(self) -> bool:
        """False when the spool is full, or its disk nearly is, while spooling: the proxy answers 503."""
        return self._direct or (not self.spool.full and self.disk.ok)

    async def start(self) -> None:
        """Connect to Kafka if it is there; either way begin draining any old spool.

        Raises:
            SpoolLockedError: another process spools into the same folder.
        """
        self.spool.claim()
        await self._connect()
        self._direct = self._producer is not None and len(self.spool) == 0
        if len(self.spool):
            logger.info("spool holds %d records from before; draining", len(self.spool))
        self._task = asyncio.create_task(self._drain_forever(), name="spool-drainer")

    async def _connect(self) -> bool:
        if self._producer is None:
            self._producer = await connect_producer(self._factory, self.ack_timeout_s * 2,
                                                    f"spooling to {self.spool.directory}")
        return self._producer is not None

    async def publish(self, topic: TopicSpec, event: EventBase, *, wait_for_kafka: bool = True) -> Outcome:
        """Make ``event`` durable; say where it went.

        ``wait_for_kafka`` is accepted for the journal publisher's sake: here every event
        waits for Kafka's acknowledgement (or the spool's fsync) anyway.

        Admission is the caller's job (check :attr:`accepting` before doing the work
        the event records): once the work is done its event is kept even if that
        overshoots the spool's bound, because dropping it would lose data.

        Raises:
            ValueError: the event does not fit its topic (wrong type or too large).
        """
        del wait_for_kafka
        resolved = self.registry[topic]
        key, value, headers = encode_record(resolved, event)
        return await self._durably(resolved.name, key, value, headers, event.event_id)

    async def _durably(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]],
                       event_id: str) -> Outcome:
        """Kafka's acknowledgement, or the spool's fsync, of one encoded record."""
        # A caller cancelled while this waits (a harness that left while its answer waited for
        # Kafka) must not take the event with it: the wait runs as a task of its own, which ends
        # in Kafka or the spool either way, and which stop() lets finish.
        keeping = asyncio.ensure_future(self._keep(topic, key, value, headers, event_id))
        self._keeping.add(keeping)
        keeping.add_done_callback(self._kept)
        return await asyncio.shield(keeping)

    def _kept(self, keeping: asyncio.Future[Outcome]) -> None:
        self._keeping.discard(keeping)
        # Read here, so that a failure whose caller had left is logged rather than lost.
        if not keeping.cancelled() and (exc := keeping.exception()) is not None:
            logger.error("an event could be kept neither in Kafka nor in the spool: %r", exc)

    async def _keep(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]],
                    event_id: str) -> Outcome:
        if self._direct and self._producer is not None:
            try:
                # One deadline for queueing and acknowledgement. ``asyncio.timeout`` instead of
                # ``wait_for``: the latter would add a second task to each call.
                async with asyncio.timeout(self.ack_timeout_s):
                    future = await self._producer.send_raw(topic, value, key=key, headers=headers)
                    await future
                return "kafka"
            except Exception as exc:  # noqa: BLE001 - any send failure falls back to the spool
                self.publish_errors += 1
                logger.warning("publishing %s failed (%r); switching to the spool", event_id, exc)
                self._direct = False
                await self._spool(topic, key, value, headers, force=True)
                return "spool"
        await self._spool(topic, key, value, headers, force=True)
        return "spool"

    async def publish_call(self, capture: CallCapture, status: CallStatus, *, upstream_status_code: int | None,
                           error_message: str | None, upstream_replica: str | None,
                           exchange: EngineExchange | None = None) -> Outcome:
        """Build the call's event and publish it (this mode waits for Kafka anyway).

        A capture that makes no event the calls topic takes (over its size limit, or not
        valid) is kept as a dead letter holding its fields, as the journal's shipper keeps
        one: the call was served, so its record must not be lost with a 500.
        """
        del exchange
        try:
            event = capture.build(status, upstream_status_code=upstream_status_code, error_message=error_message,
                                  upstream_replica=upstream_replica)
            resolved = self.registry[CALLS]
            key, value, headers = encode_record(resolved, event)
        except ValueError as exc:  # pydantic's ValidationError and EventTooLargeError are ValueErrors
            logger.error("call %s of rollout %s made no valid event (%s); keeping it as a dead letter",
                         capture.call_id, capture.rollout_id, exc)
            raw = pack_raw_call(capture, status, upstream_status_code=upstream_status_code,
                                error_message=error_message, upstream_replica=upstream_replica)
            topic, letter_key, letter, letter_headers = dead_letter(
                self.registry, raw, 0, DeadLetterErrorType.INVALID_EVENT, f"call capture made no valid event: {exc}",
                exc)
            return await self._durably(topic, letter_key, letter, list(letter_headers), capture.call_id)
        return await self._durably(resolved.name, key, value, headers, event.event_id)

    async def _spool(self, topic: str, key: bytes | None, value: bytes,
                     headers: list[tuple[str, bytes]], *, force: bool) -> None:
        self._spooling += 1  # the drainer must not go direct while this waits its turn
        try:
            async with self._order:
                await asyncio.to_thread(self.spool.append, topic, key, value, tuple(headers), force=force)
        finally:
            self._spooling -= 1
        self._wake.set()

    async def _drain_forever(self) -> None:
        backoff = self.drain_interval_s
        unauthorized: list[str] | None = None  # the topics last reported as not this client's to write
        refused: str | None = None  # the last refusal of a record and its dead letter, said once while it lasts
        while not self._stopped:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff)
            self._wake.clear()
            if self._direct and len(self.spool) == 0:
                continue
            try:
                drained = await self._drain_once()
            except Exception as exc:  # noqa: BLE001 - keep trying; Kafka may be restarting
                topics = unauthorized_topics(exc, ())
                if topics is not None:
                    self._one_at_a_time = True
                if isinstance(exc, LetterRefusedError):
                    # Its batch found it one record at a time: go on so, or every try would send
                    # the records ahead of it (stored already) again.
                    self._one_at_a_time = True
                if isinstance(exc, LetterRefusedError) and str(exc) != refused:
                    refused = str(exc)
                    logger.error("%s", exc)
                elif topics is not None and topics != unauthorized and self._producer is not None:
                    unauthorized = topics  # said once while it lasts
                    cluster = isinstance(exc, kafka_errors.ClusterAuthorizationFailedError)
                    logger.error("%s; spooled events wait in %s and are sent once it is granted",
                                 NotAuthorizedError.of(topics, self._producer.settings, cluster=cluster),
                                 self.spool.directory)
                else:
                    logger.info("spool drain paused: %s", exc)
                await self._drop_producer()  # a fresh one: an idempotent producer may be stuck in a bad sequence
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = self.drain_interval_s
            unauthorized = refused = None
            if drained:
                self._wake.set()  # more may be waiting: go again at once

    async def _drain_once(self) -> int:
        if not await self._connect():
            raise ConnectionError("Kafka unreachable")
        assert self._producer is not None
        batch = await asyncio.to_thread(self.spool.oldest, 256)
        if not batch:
            async with self._order:
                # An event whose send failed may still be on its way into the spool: publishing
                # directly now would put later events into Kafka before it.
                if len(self.spool) == 0 and self._spooling == 0:
                    if not self._direct:
                        logger.info("spool drained; publishing directly again")
                    self._direct = True
            return 0
        if self._one_at_a_time:
            # Kafka refused this client a topic of an earlier batch, and may have stored the
            # records of the others: one at a time until the head goes, so none is sent again.
            await self._drain_one_by_one(batch)
            self._one_at_a_time = False
            logger.info("drained %d spooled records one at a time (%d left)", len(batch), len(self.spool))
            return len(batch)
        cut = first_reward_after_a_call([r.topic for r in batch], self._rewards_topic)
        if cut is not None:  # the calls before a reward are acknowledged first (see the function)
            batch = batch[:cut]
        futures: list[asyncio.Future[Any]] = []
        try:
            try:
                # Queueing inside the try: the client refuses some records itself, before the broker.
                for r in batch:
                    futures.append(await self._producer.send_raw(r.topic, r.value, key=r.key, headers=r.headers))  # noqa: PERF401 - the queued ones are needed when a later one fails
                await asyncio.wait_for(asyncio.gather(*futures), self.ack_timeout_s * 4)
            except BaseException:
                for queued in futures:  # the batch is sent again; these sends' own outcomes no longer matter
                    queued.add_done_callback(_read_outcome)
                raise
        except REFUSED as exc:
            logger.warning("Kafka refused a spooled record of a batch of %d (%r); sending them one at a time",
                           len(batch), exc)
            await self._drop_producer()  # see _drain_one_by_one
            if not await self._connect():
                raise ConnectionError("Kafka unreachable") from exc
            await self._drain_one_by_one(batch)
        else:
            for record in batch:
                await asyncio.to_thread(self.spool.remove, record)
        logger.info("drained %d spooled records (%d left)", len(batch), len(self.spool))
        return len(batch)

    async def _drain_one_by_one(self, batch: list[SpooledRecord]) -> None:
        """Send ``batch`` record by record; one Kafka refuses goes to the dead-letter topic instead.

        Without this the refused record would head the spool for ever: every drain would send
        it again and fail, and every later event would wait behind it until the spool filled.
        Records of the batch that had arrived are sent again (consumers drop the copy by id).
        """
        for record in batch:
            assert self._producer is not None
            try:
                await asyncio.wait_for(await self._producer.send_raw(
                    record.topic, record.value, key=record.key, headers=record.headers), self.ack_timeout_s * 4)
            except REFUSED as exc:
                topic, key, value, headers = dead_letter(
                    self.registry, (record.topic, record.key, record.value, record.headers), 0,
                    DeadLetterErrorType.REFUSED_BY_BROKER, f"Kafka refused the record: {exc!r}", exc)
                try:
                    await asyncio.wait_for(await self._producer.send_raw(topic, value, key=key,
                                                                         headers=list(headers)),
                                           self.ack_timeout_s * 4)
                except REFUSED as failure:
                    raise LetterRefusedError.of(f"spooled record {record.path.name}", record.topic, len(record.value),
                                                exc, topic, len(value), failure, self.spool.directory) from failure
                self.refused += 1
                logger.error("Kafka refused spooled record %s for %s (%r); it is on %s instead", record.path.name,
                             record.topic, exc, topic)
                # The refused batch took a sequence number the broker never stored: the same
                # producer's next record for that partition would be refused as out of order.
                await asyncio.to_thread(self.spool.remove, record)
                await self._drop_producer()
                if not await self._connect():
                    raise ConnectionError("Kafka unreachable") from exc
                continue
            await asyncio.to_thread(self.spool.remove, record)

    async def _drop_producer(self) -> None:
        """Stop the producer; the next :meth:`_connect` starts a new one."""
        producer, self._producer = self._producer, None
        if producer is not None:
            # Aborted, not flushed: the spool holds everything unacknowledged, and a flush waits
            # out the client's delivery timeout while the broker is away.
            with contextlib.suppress(Exception):
                await producer.abort(self.ack_timeout_s)

    async def stop(self) -> None:
        """Stop draining and flush Kafka; what is still spooled stays on disk. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Events whose callers left before Kafka or the spool had them; any published while this
        # waits go to the spool (the drainer is stopped, so the publisher is not direct any more).
        self._direct = False
        deadline = asyncio.get_running_loop().time() + self.ack_timeout_s * 2
        while self._keeping and (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.wait(set(self._keeping), timeout=left)
        if self._producer is not None:
            # Everything unacknowledged is in the spool already, so waiting for Kafka is optional.
            with contextlib.suppress(Exception):
                await self._producer.abort(self.ack_timeout_s)
            self._producer = None
        self.spool.release()


__all__ = ["DurablePublisher", "EventLog", "LetterRefusedError", "Outcome", "connect_producer"]
