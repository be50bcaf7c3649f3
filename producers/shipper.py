"""Publish through the local journal: durable on disk at once, shipped to Kafka in batches.

``publish`` returns once the event is in the journal (:mod:`producers.journal`), a ``write`` into
the page cache, so a model call's answer does not wait for the broker. One background task, the
shipper, reads the journal in order and sends what it holds to Kafka one batch at a time: each
batch is everything that arrived while the previous one was in flight, so under load many events
share a produce request (the broker's CPU per event falls with batch size), and at low load an
event leaves at once. Kafka order follows journal order, so a rollout's events never overtake
each other. When Kafka is unreachable the journal simply grows, up to its bound, and the proxy
answers 503 beyond it; a restarted process ships what its predecessor left.

Rewards ask to wait for Kafka (``wait_for_kafka``): when the verifier's post returns, the
rollout's calls, journalled before it, are in Kafka too, so the assembler never sees a reward
and the rollout's end ahead of its last call. For the same reason a reward never shares a batch
with calls before it (their partitions' leaders may answer apart). While Kafka is down that wait gives up after the
acknowledgement timeout and the reward stays in the journal, durable, like any other event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import aiokafka.errors as kafka_errors
from aiokafka.errors import ClusterAuthorizationFailedError as ClusterDenied

from producers.capture import CallCapture
from producers.disk_room import DiskRoom
from producers.journal import (
    Journal,
    JournalCorruptError,
    JournalRecord,
    Record,
    lock_folder,
    unpack_record,
)
from producers.outage import PROBE_EVERY_S, STALL_S, OutageLog, broker_reachable
from producers.raw_calls import (
    EngineExchange,
    dead_letter,
    pack_raw_call,
    raw_exchange_parts,
    ship_record,
)
from schemas import EventBase
from schemas._errors import DeadLetterErrorType
from schemas.call.v1 import CallStatus
from stream import (
    REWARDS,
    EventProducer,
    EventTooLargeError,
    MissingTopicsError,
    NotAuthorizedError,
    TopicRegistry,
    TopicSpec,
)
from stream.producer import encode_record
from stream.topics import unauthorized_topics

logger = logging.getLogger(__name__)

# A shipping loop that ran this long before failing starts again after the shortest pause.
_HEALTHY_RUN_S = 60.0

_ABORT_S = 0.2
"""How long a producer may go on delivering once no broker takes a connection."""

_BUILD_CHUNK = 64
"""Records whose events are made between two yields to the event loop (a few milliseconds' work)."""

Outcome = Literal["kafka", "journal"]
"""Where a published event is known to be: in Kafka, or (durably) in the journal."""

REFUSED: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError, kafka_errors.RecordListTooLargeError, kafka_errors.RecordTooLargeError,
    kafka_errors.CorruptRecordException, kafka_errors.InvalidTopicError,
    kafka_errors.UnsupportedForMessageFormatError, kafka_errors.PolicyViolationError, EventTooLargeError,
)
"""Kafka's ways of refusing a record itself rather than the connection: sending it again cannot
help, and every record behind it would wait for ever. Such a record goes to the dead-letter topic.
The broker's answer and the client's own checks while queueing (its size limit) alike.

Not among them: a topic this client may not write (``TopicAuthorizationFailedError``). That is
the cluster's ACLs, an operator's to fix; until then the events wait in the journal
(:class:`stream.NotAuthorizedError` says what to grant) instead of every one going to the
dead-letter topic."""


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


_refused_start: str | None = None
"""The last refusal of a producer's start by the cluster's ACLs that was logged (see ``connect_producer``)."""


async def connect_producer(factory: Callable[[], EventProducer], timeout_s: float, meanwhile: str, *,
                           on_unreachable: Callable[[Exception], object] | None = None) -> EventProducer | None:
    """A started producer, or None when Kafka is unreachable.

    That is logged, saying what happens ``meanwhile``, or handed to ``on_unreachable`` (which
    then says it); a refusal by the cluster's ACLs is always logged here.
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
        elif on_unreachable is not None:
            on_unreachable(exc)
        else:
            logger.warning("Kafka unreachable (%r); %s", exc, meanwhile)
        with contextlib.suppress(Exception):
            await producer.stop()
        return None
    _refused_start = None
    return producer


class _UnreachableError(ConnectionError):
    """Kafka did not answer: no producer could start, or no broker takes a connection while a batch waits."""


class Shipper:
    """Reads a journal in order and sends it to Kafka one batch at a time.

    Each batch is everything that arrived while the previous one was in flight, so under load many
    events share a produce request (the broker's CPU per event falls with batch size), and at low
    load an event leaves at once. Raw call records (:mod:`producers.raw_calls`) become their events
    here, on the proxy's event loop.
    """

    def __init__(
        self,
        producer_factory: Callable[[], EventProducer],
        source: Journal,
        registry: TopicRegistry,
        *,
        ack_timeout_s: float,
        batch_records: int = 1024,
        batch_bytes: int = 4 * 1024 * 1024,
        linger_s: float = 0.02,
        idle_wait_s: float = 1.0,
        on_progress: Callable[[], object] | None = None,
        outage_report_s: float = 30.0,  # while Kafka is away, how often the log says so (OutageLog)
    ) -> None:
        self._factory = producer_factory
        self._bootstrap = ""  # the producers' bootstrap servers, known from the first connect
        self._unreachable = ""  # why the last producer did not start
        self._producer: EventProducer | None = None
        self.source = source
        self.registry = registry
        self.ack_timeout_s = ack_timeout_s
        self.batch_records = batch_records
        self.batch_bytes = batch_bytes
        self.linger_s = linger_s
        self.idle_wait_s = idle_wait_s
        self._on_progress = on_progress
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self.kafka_ok = False
        """True while the last batch reached Kafka (or nothing needed sending since connecting)."""
        self.failed = False
        """The journal could not be read back; nothing more can be shipped."""
        self.publish_errors = 0
        """Batches that failed or timed out and were sent again."""
        self.shipped = -1
        """The last sequence number Kafka acknowledged (in this run)."""
        self.refused = 0
        """Records Kafka refused (too large for the broker's topic, a policy) and that went to the
        dead-letter topic instead."""
        self._one_by_one_to = -1  # records up to this one go one at a time, to find one Kafka refuses
        self._rewards_topic = registry[REWARDS].name
        self._missing_reported: list[str] = []  # the missing topics last logged, so a wait is logged once
        self._unauthorized_reported: list[str] = []  # likewise the topics last found not ours to write
        self._letter_refused: int | None = None  # the record whose dead letter Kafka refused too, once logged
        self.outage = OutageLog(str(source.directory), outage_report_s)

    def wake(self) -> None:
        """Something was appended: look now instead of at the next poll."""
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """:meth:`stop_when_done` was called."""
        return self._stop_requested.is_set()

    def hurry(self) -> None:
        """Someone waits for what the journal holds to reach Kafka: look now, and cut any linger short."""
        self._wake.set()
        self._hurry.set()

    def stop_when_done(self) -> None:
        """Ship what is there, then return from :meth:`run` (or on the first failure)."""
        self._stop_requested.set()
        self.hurry()

    async def connect(self) -> bool:
        """Connect to Kafka if not connected; False while it is unreachable."""
        if self._producer is None:
            producer = self._factory()
            self._bootstrap = producer.settings.bootstrap_servers
            self._unreachable = "the producer did not start"

            def unreachable(exc: Exception) -> None:
                self._unreachable = repr(exc)  # said by the outage's line, not here

            self._producer = await connect_producer(lambda: producer, self.ack_timeout_s * 2,
                                                    f"events wait in the journal at {self.source.directory}",
                                                    on_unreachable=unreachable)
        # A producer that starts is not yet a Kafka that takes the events: while the last batch
        # waits for a topic or a grant, readiness keeps saying so rather than true for each try.
        connected = self._producer is not None
        self.kafka_ok = connected and not (self._missing_reported or self._unauthorized_reported
                                           or self._letter_refused is not None)
        return connected

    async def close(self, wait_s: float | None = None) -> None:
        """Drop the Kafka connection; unacknowledged records are all still in the journal.

        Args:
            wait_s: How long the producer may go on delivering (default: the acknowledgement timeout).
        """
        self.kafka_ok = False
        await self._drop_producer(wait_s)

    async def _drop_producer(self, wait_s: float | None = None) -> None:
        """Stop the producer without waiting out its deliveries; the next :meth:`connect` starts a new one.

        Also after Kafka refused a batch, which is no lost connection: the refused batch took
        sequence numbers the broker never stored, so the same idempotent producer's next record
        for that partition would be refused as out of order (and counted as a failure).
        """
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.abort(self.ack_timeout_s if wait_s is None else wait_s)

    def _progress(self) -> None:
        if self._on_progress is not None:
            self._on_progress()

    async def run(self) -> None:
        """Ship until stopped (and nothing is left) or the journal is found damaged.

        A failure the shipping loop does not expect (marking records shipped when the folder
        cannot be listed, a dead letter that cannot be made) starts it again from the first record
        not shipped, after a pause. Left to end the task, it stopped shipping unseen: the journal
        filled and every call was refused, though nothing was wrong with Kafka or the journal.
        Records Kafka had taken before the failure are sent again; consumers drop copies by id.
        """
        self.outage.gate.install()
        try:
            await self._run()
        finally:
            self.outage.gate.uninstall()

    async def _run(self) -> None:
        backoff = 1.0
        while True:
            began = time.monotonic()
            try:
                await self._ship()
                return
            except Exception:  # whatever it was, the records wait in the journal
                ran_s = time.monotonic() - began
                self.publish_errors += 1
                logger.exception("shipping the journal at %s failed unexpectedly; starting again from the first "
                                 "record not shipped", self.source.directory)
            await self.close()
            self._progress()
            if self.stopping:
                return
            if ran_s >= _HEALTHY_RUN_S:
                backoff = 1.0  # a failure after a long healthy run is a new one, not the last one again
            await self._pause(backoff)
            backoff = min(backoff * 2, 10.0)
            if not await self._rewind():
                return

    async def _ship(self) -> None:
        """The shipping loop: read, send, mark shipped; Kafka's and the journal's failures are handled here."""
        backoff = 0.5
        while True:
            try:
                one_by_one = self.shipped < self._one_by_one_to
                records = self.source.read(1 if one_by_one else self.batch_records, self.batch_bytes)
            except JournalCorruptError:
                # Nothing after the damage can be shipped in order: stop taking calls (not
                # ready, 503) and leave the folder for an operator.
                logger.exception("the journal at %s is damaged; refusing new calls", self.source.directory)
                self.failed = True
                self._progress()
                return
            except OSError as exc:
                # Not damage: the journal could not be read just now (no descriptor left, an I/O
                # error). The read may have moved the cursor past records it never returned, so
                # it goes back to the first record not shipped before the next try.
                logger.error("reading the journal at %s failed (%r); trying again", self.source.directory, exc)
                await self._pause(backoff)
                backoff = min(backoff * 2, 10.0)
                if self.stopping or not await self._rewind():
                    return
                continue
            self.outage.tick(len(self.source))
            if not records:
                if self.stopping:
                    return
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.idle_wait_s)
                except TimeoutError:
                    # A poll: what was appended without a wake (journalled at start) has waited
                    # the idle wait already; a linger now would only double the delay.
                    continue
                await self._linger()
                continue
            # A reward goes only after the calls before it are acknowledged (see the function).
            cut = first_reward_after_a_call([r.topic for r in records], self._rewards_topic)
            if cut is not None:
                records = records[:cut]
            outgoing: list[Record] = []
            try:
                if not await self.connect():
                    raise _UnreachableError(self._unreachable)
                outgoing = await self._build(records)
                await self._send(outgoing)
            except Exception as exc:  # noqa: BLE001 - keep the records and try again; Kafka may be restarting
                if isinstance(exc, _UnreachableError):
                    # An outage: said once (OutageLog), and over as soon as a broker takes connections.
                    self.publish_errors += 1
                    self.outage.went(self._bootstrap, str(exc), len(self.source))
                    await self.close(_ABORT_S)  # nothing to wait for: no broker takes a connection
                    self._progress()
                    if self.stopping or not await self._rewind():
                        return
                    await self._until_reachable(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                refused = isinstance(exc, REFUSED)
                if refused and len(records) == 1 and outgoing and await self._dead_letter(records[0], outgoing[0], exc):
                    await self._drop_producer()
                    continue
                if not await self._rewind():
                    return
                if refused and len(records) > 1:
                    # Some record of this batch is refused: send them one at a time to find it.
                    logger.warning("Kafka refused a record of a batch of %d (%r); sending them one at a time",
                                   len(records), exc)
                    self._one_by_one_to = records[-1].seq
                    self.publish_errors += 1
                    await self._drop_producer()
                    continue
                self.publish_errors += 1
                # Waiting for a missing topic ends in our timeout, or in aiokafka's own
                # (UnknownTopicOrPartition) where its request timeout is the shorter.
                waited = isinstance(exc, TimeoutError | kafka_errors.KafkaTimeoutError
                                    | kafka_errors.UnknownTopicOrPartitionError)
                missing = (await self._missing_topics(outgoing)
                           if waited and self._producer is not None and not self.stopping else [])
                # The topics sent to (a raw record's journal name is no Kafka topic).
                topics = [record[0] for record in outgoing] or [record.topic for record in records]
                if (unauthorized := unauthorized_topics(exc, topics)) is not None and self._producer is not None:
                    self._report_unauthorized(unauthorized, len(records), cluster=isinstance(exc, ClusterDenied))
                    # Kafka may have stored the batch's records for the topics it allows: one at a
                    # time from here, so that each try sends only the record that waits, not them again.
                    self._one_by_one_to = max(self._one_by_one_to, records[-1].seq)
                elif missing:
                    self._report_missing(missing, len(records))
                elif not (refused and self._letter_refused is not None):
                    # Also a failure to make the producer (its settings, say): never a silent retry loop.
                    logger.warning("shipping %d journalled events failed (%r); will retry", len(records), exc)
                await self.close()
                self._progress()
                if self.stopping:
                    return
                # A stop ends the pause (it then tries once more within its deadline).
                await self._pause(backoff)
                backoff = min(backoff * 2, 10.0)  # a returning broker is found within 10 s
                continue
            backoff = 0.5
            self.outage.back(len(self.source))
            if self._unauthorized_reported:
                logger.info("topics %s take this client's events again", ", ".join(self._unauthorized_reported))
            self._missing_reported, self._unauthorized_reported, self._letter_refused = [], [], None
            self.kafka_ok = True
            self.source.mark_shipped(records)
            self.shipped = records[-1].seq
            self._progress()
            if cut is not None:
                if not await self._rewind():  # back to the reward, which the cursor had passed
                    return
                continue
            # A batch cut short by a limit leaves records waiting: send them now. Lingering
            # after every full batch would cap shipping at one batch per linger, below what a
            # busy proxy journals, and the journal would grow until calls were refused.
            if (len(records) < self.batch_records and sum(r.size for r in records) < self.batch_bytes
                    and not one_by_one):
                await self._linger()

    async def _build(self, records: list[JournalRecord]) -> list[Record]:
        """What to send for ``records`` (:func:`ship_record`), yielding to the calls now and then.

        The shipper shares the proxy's event loop, and making a call's event takes tens of
        microseconds: a backlog's batch of a thousand, made in one go, would hold every call in
        flight for a tenth of a second.
        """
        outgoing: list[Record] = []
        for n, r in enumerate(records):
            if n and n % _BUILD_CHUNK == 0:
                await asyncio.sleep(0)
            outgoing.append(ship_record(self.registry, r.topic, r.key, r.value, r.headers, r.seq))
        return outgoing

    async def _rewind(self) -> bool:
        """Put the cursor back on the first record not shipped; False when shipping must end.

        A journal that cannot be opened just now is tried again, with a pause, until it can be
        or a stop is asked for: reading on from a cursor left anywhere else would skip records.
        """
        backoff = 0.5
        while True:
            try:
                self.source.rewind()
                return True
            except JournalCorruptError:
                logger.exception("the journal at %s is damaged; refusing new calls", self.source.directory)
                self.failed = True
                self._progress()
                return False
            except OSError as exc:
                logger.error("the journal at %s cannot be opened (%r); trying again", self.source.directory, exc)
            if self.stopping:
                return False
            await self._pause(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before trying again, or less if a stop is asked for."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_requested.wait(), seconds)

    async def _missing_topics(self, outgoing: list[Record]) -> list[str]:
        """The topics of ``outgoing`` the cluster does not have; none when that cannot be told.

        A record for a missing topic is not refused: the producer waits for the topic to appear
        until the batch times out, and the operator would see only a timeout, again and again.
        """
        assert self._producer is not None
        try:
            # Short: a broker that is away makes every retry (and a stop) wait this long more.
            async with asyncio.timeout(min(self.ack_timeout_s, 2.0)):
                return await self._producer.missing_topics({record[0] for record in outgoing})
        except Exception:  # noqa: BLE001 - the broker is away too: the timeout is all there is to say
            return []

    def _report_missing(self, missing: list[str], records: int) -> None:
        """Say which topics are missing and how to create them: loudly once, quietly while it lasts."""
        if missing == self._missing_reported:
            logger.info("journalled events (a batch of %d) still wait for topics %s", records, ", ".join(missing))
            return
        self._missing_reported = missing
        assert self._producer is not None
        remedy = MissingTopicsError.of(missing, self._producer.settings.bootstrap_servers)
        logger.error("%s; journalled events (a batch of %d) wait in %s and ship once it exists. (A topic this "
                     "client may not describe looks missing too.)", remedy, records, self.source.directory)

    def _report_unauthorized(self, topics: list[str], records: int, *, cluster: bool = False) -> None:
        """Say which topics this client may not write and what to grant: loudly once, quietly while it lasts.

        The events wait in the journal, as for a missing topic, rather than go to the dead-letter
        topic: a missing ACL is the operator's to fix, and every call of the run would otherwise
        be set aside.
        """
        if topics == self._unauthorized_reported:
            logger.info("journalled events (a batch of %d) still wait for the right to write to %s", records,
                        ", ".join(topics))
            return
        self._unauthorized_reported = topics
        assert self._producer is not None  # the failure came from a send
        remedy = NotAuthorizedError.of(topics, self._producer.settings, cluster=cluster)
        logger.error("%s; journalled events (a batch of %d) wait in %s and ship once it is granted", remedy,
                     records, self.source.directory)

    async def _send(self, outgoing: list[Record]) -> None:
        """Send ``outgoing`` and wait until Kafka has acknowledged all of it.

        Raises:
            _UnreachableError: unacknowledged after :data:`STALL_S`, and no broker takes a
                connection: an outage, found long before the acknowledgement timeout.
        """
        producer = self._producer
        assert producer is not None

        async def deliver() -> None:
            futures = await producer.send_many_raw(outgoing)
            await asyncio.gather(*futures)

        delivery = asyncio.ensure_future(deliver())
        try:
            async with asyncio.timeout(self.ack_timeout_s):
                done, _ = await asyncio.wait({delivery}, timeout=min(STALL_S, self.ack_timeout_s))
                if not done and not await broker_reachable(self._bootstrap):
                    raise _UnreachableError(f"no broker took a connection while a batch waited {STALL_S:.0f} s")
                await delivery
        finally:
            if not delivery.done():
                delivery.cancel()
                with contextlib.suppress(BaseException):
                    await delivery

    async def _until_reachable(self, backoff: float) -> None:
        """Wait until a broker takes connections again; ``backoff`` where one did all along.

        Probed every :data:`PROBE_EVERY_S`: a broker that was away is tried as soon as it is
        back. One that takes connections but does not serve (still starting, credentials it
        refuses) is tried after ``backoff`` instead, so that is no loop of producers.
        """
        deadline = time.monotonic() + backoff
        was_away = False
        while not self.stopping:
            if await broker_reachable(self._bootstrap):
                if was_away or time.monotonic() >= deadline:
                    return
            else:
                was_away = True
            self.outage.tick(len(self.source))
            await self._pause(PROBE_EVERY_S)

    async def _dead_letter(self, record: JournalRecord, sent: Record, exc: Exception) -> bool:
        """Put a record Kafka refused on the dead-letter topic instead, and move on; False if that failed too.

        The letter holds the record as it was sent (a call's event, not its raw capture), its
        topic and the broker's reason, so an operator can see what was refused and send it again
        once the topic takes it.
        """
        letter = dead_letter(self.registry, sent, record.seq, DeadLetterErrorType.REFUSED_BY_BROKER,
                             f"Kafka refused the record: {exc!r}", exc)
        try:
            await self._send([letter])
        except Exception as failure:
            if (topics := unauthorized_topics(failure, [letter[0]])) is not None:
                self._report_unauthorized(topics, 1, cluster=isinstance(failure, ClusterDenied))
            elif isinstance(failure, REFUSED):
                self._report_letter_refused(record, sent, exc, letter, failure)
            else:
                logger.warning("sending the dead letter for journal record %d failed too", record.seq, exc_info=True)
            return False
        logger.error("Kafka refused journal record %d for %s (%r); it is on %s instead", record.seq, sent[0], exc,
                     letter[0])
        if self._letter_refused is not None:  # said earlier that it waited: the letter is what ended the wait
            logger.info("Kafka took journal record %d's dead letter; shipping goes on", record.seq)
            self._letter_refused = None
            self.kafka_ok = True
        self.refused += 1
        self.source.mark_shipped([record])
        self.shipped = record.seq
        self._progress()
        return True

    def _report_letter_refused(self, record: JournalRecord, sent: Record, exc: Exception, letter: Record,
                               failure: Exception) -> None:
        """Say that a record and its dead letter were both refused, and what to change: once, then quietly.

        The record waits in the journal, as for a missing topic or grant, rather than be dropped
        or cut down to what the dead-letter topic takes: both topics refusing is a configuration
        to fix (topics made outside ``openforge topics create`` keep the broker's default limit of
        about 1 MiB, below a long conversation's event), and every record behind it ships once
        either topic takes it.
        """
        if self._letter_refused == record.seq:
            logger.info("journal record %d and its dead letter are still refused; it and the records after it wait",
                        record.seq)
            return
        self._letter_refused = record.seq
        self.kafka_ok = False
        logger.error("%s", LetterRefusedError.of(f"journal record {record.seq}", sent[0], len(sent[2]), exc, letter[0],
                                                 len(letter[2]), failure, self.source.directory))

    async def _linger(self) -> None:
        """Let a few more events join the next batch, unless someone waits for Kafka.

        No answer waits for the shipper, so a few milliseconds cost nothing a harness sees,
        and the broker's and this process's cost per produce request is shared by more events.
        A reward waiting for its rollout's calls (:meth:`hurry`) or a stop ends the pause early;
        an append (:meth:`wake`) does not, or every call would end it.
        """
        if self.linger_s > 0 and not self._hurry.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), self.linger_s)
        if not self.stopping:
            self._hurry.clear()


class JournalPublisher:
    """The journal in front, one in-order shipper to Kafka behind it, both on the proxy's event loop."""

    def __init__(
        self,
        producer_factory: Callable[[], EventProducer],
        journal: Journal,
        registry: TopicRegistry,
        *,
        ack_timeout_s: float = 5.0,
        fsync_interval_s: float = 0.1,
        batch_records: int = 1024,
        batch_bytes: int = 4 * 1024 * 1024,
        linger_s: float = 0.02,
        before_start: Callable[[], object] | None = None,
        min_free_bytes: int = 0,
        outage_report_s: float = 30.0,
    ) -> None:
        """Start with :meth:`start`.

        Args:
            producer_factory: Makes the Kafka producer.
            journal: The journal, not yet opened.
            registry: Topics, for encoding.
            ack_timeout_s: Per shipped batch, and for a reward waiting for Kafka.
            fsync_interval_s: How often the journal is flushed to disk (0: at every append).
            batch_records: Most records per batch.
            batch_bytes: Most bytes per batch.
            linger_s: Pause after a batch to let the next one gather.
            before_start: Run once the journal is open, before shipping starts.
            min_free_bytes: Take no calls while less is free on the journal's disk (0: no floor).
            outage_report_s: While Kafka is away, how often the log says so.
        """
        self.journal = journal
        self.registry = registry
        self.ack_timeout_s = ack_timeout_s
        self.fsync_interval_s = fsync_interval_s
        self.disk = DiskRoom(journal.directory, min_free_bytes)
        self._before_start = before_start
        self._shipper = Shipper(producer_factory, journal, registry, ack_timeout_s=ack_timeout_s,
                                batch_records=batch_records, batch_bytes=batch_bytes, linger_s=linger_s,
                                on_progress=self._on_progress, outage_report_s=outage_report_s)
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self.flush_errors = 0
        """Flushes of the journal to the disk that failed (each is logged; readiness and a metric count them)."""

    @property
    def kafka_ok(self) -> bool:
        """True while the last batch reached Kafka (or nothing needed sending since connecting)."""
        return self._shipper.kafka_ok

    @property
    def failed(self) -> bool:
        """The journal could not be read back; nothing more is accepted."""
        return self._shipper.failed

    @property
    def publish_errors(self) -> int:
        """Batches that failed or timed out and were sent again."""
        return self._shipper.publish_errors

    @property
    def backlog(self) -> int:
        """Events in the journal that Kafka does not have yet."""
        return len(self.journal)

    @property
    def accepting(self) -> bool:
        """False when the journal's unshipped bytes reach its bound, or its disk is nearly full: answer 503."""
        return not self.failed and not self.journal.full and self.disk.ok

    def _on_progress(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def start(self) -> None:
        """Recover the journal, connect to Kafka if it is there, start shipping."""
        await asyncio.to_thread(self.journal.open)
        if self._before_start is not None:  # e.g. taking over an old spool, once the journal is open
            await asyncio.to_thread(self._before_start)
        await self._shipper.connect()
        self._tasks.append(asyncio.create_task(self._shipper.run(), name="journal-shipper"))
        if self.fsync_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._sync_forever(), name="journal-sync"))

    def wake(self) -> None:
        """Have the shipper look at the journal now rather than at its next poll (it ends an idle wait)."""
        self._shipper.wake()

    async def _appended(self) -> None:
        if self.fsync_interval_s == 0:
            try:
                await asyncio.to_thread(self.journal.sync)
            except OSError as exc:  # the record is in the journal; only its flush failed, as in _sync_forever
                self.flush_errors += 1
                logger.error("flushing the journal at %s failed: %s", self.journal.directory, exc)
        self._shipper.wake()

    async def publish(self, topic: TopicSpec, event: EventBase, *, wait_for_kafka: bool = False) -> Outcome:
        """Write ``event`` into the journal; with ``wait_for_kafka``, also wait until it is shipped.

        Admission is the caller's job (:attr:`accepting`).

        Returns:
            ``"kafka"`` when the event is known to be in Kafka, else ``"journal"``.

        Raises:
            ValueError: the event does not fit its topic (wrong type or too large).
        """
        resolved = self.registry[topic]
        key, value, headers = encode_record(resolved, event)
        seq = self.journal.append(resolved.name, key, value, tuple(headers))
        await self._appended()
        if not wait_for_kafka:
            return "journal"
        self._shipper.hurry()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ack_timeout_s):
                while self.journal.shipped < seq:
                    await self._progress.wait()
        return "kafka" if self.journal.shipped >= seq else "journal"

    async def publish_call(self, capture: CallCapture, status: CallStatus, *, upstream_status_code: int | None,
                           error_message: str | None, upstream_replica: str | None,
                           exchange: EngineExchange | None = None) -> Outcome:
        """Journal the call's capture as it is; the shipper builds its event (:mod:`producers.raw_calls`).

        A whole answer that ended ``ok`` is journalled as its engine exchange (``exchange``),
        the cheapest record to write; anything else as the capture's fields.
        """
        if exchange is not None and status is CallStatus.OK:
            topic, key, parts = raw_exchange_parts(capture, exchange, upstream_status_code=upstream_status_code,
                                                   upstream_replica=upstream_replica)
            self.journal.append_parts(topic, key, parts, ())
        else:
            self.journal.append(*pack_raw_call(capture, status, upstream_status_code=upstream_status_code,
                                               error_message=error_message, upstream_replica=upstream_replica))
        await self._appended()
        return "journal"

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.fsync_interval_s)
            try:
                await asyncio.to_thread(self.journal.sync)
            except OSError as exc:
                # Keep flushing: a flush that failed once (a disk briefly full) may succeed next
                # time, and a task that ended here would stop every later flush unseen.
                self.flush_errors += 1
                logger.error("flushing the journal at %s failed: %s", self.journal.directory, exc)

    async def stop(self) -> None:
        """Ship what is left (for at most twice the ack timeout), then close the journal. Idempotent.

        What Kafka does not take in time stays in the journal for the next start.
        """
        if self._stopped:
            return
        self._stopped = True
        deadline = self.ack_timeout_s * 2
        started = time.monotonic()
        if self._tasks:
            self._shipper.stop_when_done()
            done, _ = await asyncio.wait({self._tasks[0]}, timeout=deadline)
            if not done:
                logger.warning("Kafka did not take the journal within %.1fs; %d events stay in %s",
                               time.monotonic() - started, len(self.journal), self.journal.directory)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("journal task %s had failed", task.get_name())
        await self._shipper.close()
        self.journal.close()


def take_over_spool(folder: Path, journal: Journal) -> int:
    """Move the records a proxy of an earlier version left in ``folder`` (its ``ack`` spool) into the journal.

    That proxy kept one file per record (``<number>.rec``, named in arrival order) while Kafka was
    away; nothing else reads them any more, so they would wait unseen. Moved in order, flushed
    before their files go: a crash in between journals them again (consumers drop the copies by
    event id) rather than losing them. Returns how many moved.

    Raises:
        JournalLockedError: a proxy of that version still spools into the folder.
    """
    files = sorted(folder.glob("*.rec"))
    if not files:
        return 0
    lock = lock_folder(folder / "writer.lock", f"another process is spooling events in {folder}")
    try:
        for path in files:
            journal.append(*unpack_record(path, path.read_bytes()))
        journal.sync()
        for path in files:
            path.unlink()
        for leftover in folder.glob("*.tmp"):  # a record whose call was never answered
            leftover.unlink()
    finally:
        os.close(lock)
    logger.info("moved %d records an earlier proxy left in %s into the journal", len(files), folder)
    return len(files)


def spool_path(directory: Path) -> Path:
    """Where the journal lives inside the proxy's spool folder."""
    return directory / "journal"


__all__ = ["JournalPublisher", "LetterRefusedError", "Outcome", "Shipper", "connect_producer",
           "spool_path", "take_over_spool"]
