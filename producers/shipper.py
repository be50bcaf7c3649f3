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
and the rollout's end ahead of its last call. While Kafka is down that wait gives up after the
acknowledgement timeout and the reward stays in the journal, durable, like any other event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from producers.durable import Outcome, connect_producer
from producers.journal import Journal, JournalCorruptError
from producers.spool import DiskSpool
from schemas import EventBase
from stream import EventProducer, TopicRegistry, TopicSpec
from stream.producer import encode_record

logger = logging.getLogger(__name__)


class JournalPublisher:
    """The journal in front, one in-order shipper to Kafka behind it."""

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
    ) -> None:
        self._factory = producer_factory
        self._producer: EventProducer | None = None
        self.journal = journal
        self.registry = registry
        self.ack_timeout_s = ack_timeout_s
        self.fsync_interval_s = fsync_interval_s
        self.batch_records = batch_records
        self.batch_bytes = batch_bytes
        self.linger_s = linger_s
        self._before_start = before_start
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._stopped = False
        self._kafka_ok = False
        self.failed = False
        """The journal could not be read back; nothing more is accepted."""
        self.publish_errors = 0
        """Batches that failed or timed out and were sent again."""

    @property
    def kafka_ok(self) -> bool:
        """True while the last batch reached Kafka (or nothing needed sending since connecting)."""
        return self._kafka_ok

    @property
    def backlog(self) -> int:
        """Events in the journal that Kafka does not have yet."""
        return len(self.journal)

    @property
    def accepting(self) -> bool:
        """False when the journal's unshipped bytes reach its bound: answer 503, take no work."""
        return not self.failed and not self.journal.full

    async def start(self) -> None:
        """Recover the journal, connect to Kafka if it is there, start shipping."""
        await asyncio.to_thread(self.journal.open)
        if self._before_start is not None:  # e.g. taking over an old spool, once the journal is open
            await asyncio.to_thread(self._before_start)
        await self._connect()
        self._tasks.append(asyncio.create_task(self._ship_forever(), name="journal-shipper"))
        if self.fsync_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._sync_forever(), name="journal-sync"))

    async def publish(self, topic: TopicSpec, event: EventBase, *, wait_for_kafka: bool = False) -> Outcome:
        """Write ``event`` into the journal; with ``wait_for_kafka``, also wait until it is shipped.

        Admission is the caller's job (:attr:`accepting`), as with the spool.

        Returns:
            ``"kafka"`` when the event is known to be in Kafka, else ``"journal"``.

        Raises:
            ValueError: the event does not fit its topic (wrong type or too large).
        """
        resolved = self.registry[topic]
        key, value, headers = encode_record(resolved, event)
        seq = self.journal.append(resolved.name, key, value, tuple(headers))
        if self.fsync_interval_s == 0:
            await asyncio.to_thread(self.journal.sync)
        self._wake.set()
        if not wait_for_kafka:
            return "journal"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ack_timeout_s):
                while self.journal.shipped < seq:
                    await self._progress.wait()
        return "kafka" if self.journal.shipped >= seq else "journal"

    async def _connect(self) -> bool:
        if self._producer is None:
            self._producer = await connect_producer(self._factory, self.ack_timeout_s * 2,
                                                    f"events wait in the journal at {self.journal.directory}")
        self._kafka_ok = self._producer is not None
        return self._kafka_ok

    async def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        self._kafka_ok = False
        if producer is not None:
            # Its unacknowledged records are all still in the journal; do not wait for them.
            with contextlib.suppress(Exception):
                await producer.abort(self.ack_timeout_s)

    async def _ship_forever(self) -> None:
        backoff = 0.5
        while True:
            try:
                records = self.journal.read(self.batch_records, self.batch_bytes)
            except JournalCorruptError:
                # Nothing after the damage can be shipped in order: stop taking calls (not
                # ready, 503) and leave the folder for an operator.
                logger.exception("the journal at %s is damaged; refusing new calls", self.journal.directory)
                self.failed = True
                return
            if not records:
                if self._stopping:
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                await self._linger()
                continue
            try:
                if not await self._connect():
                    raise ConnectionError("Kafka unreachable")
                assert self._producer is not None
                async with asyncio.timeout(self.ack_timeout_s):
                    futures = await self._producer.send_many_raw(
                        [(r.topic, r.key, r.value, r.headers) for r in records])
                    await asyncio.gather(*futures)
            except Exception as exc:  # noqa: BLE001 - keep the records and try again; Kafka may be restarting
                self.journal.rewind()
                self.publish_errors += 1
                if self._producer is not None:
                    logger.warning("shipping %d journalled events failed (%s); will retry", len(records), exc)
                await self._drop_producer()
                if self._stopping:
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)  # a returning broker is found within 10 s
                continue
            backoff = 0.5
            self._kafka_ok = True
            self.journal.mark_shipped(records)
            self._progress.set()
            self._progress = asyncio.Event()
            if len(records) < self.batch_records:
                await self._linger()

    async def _linger(self) -> None:
        """Let a few more events join the next batch.

        No answer waits for the shipper, so a few milliseconds cost nothing a harness sees,
        and the broker's and this process's cost per produce request is shared by more events.
        """
        if self.linger_s > 0 and not self._stopping:
            await asyncio.sleep(self.linger_s)

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.fsync_interval_s)
            await asyncio.to_thread(self.journal.sync)

    async def stop(self) -> None:
        """Ship what is left (for at most twice the ack timeout), then close the journal. Idempotent.

        What Kafka does not take in time stays in the journal for the next start.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        self._wake.set()
        deadline = self.ack_timeout_s * 2
        shipper = self._tasks[0] if self._tasks else None
        if shipper is not None:
            started = time.monotonic()
            done, _ = await asyncio.wait({shipper}, timeout=deadline)
            if not done:
                logger.warning("Kafka did not take the journal within %.1fs; %d events stay in %s",
                               time.monotonic() - started, len(self.journal), self.journal.directory)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._drop_producer()
        self.journal.close()


def import_spool(spool: DiskSpool, journal: Journal) -> int:
    """Move records an acknowledgement-mode proxy left in its spool into the journal, in order.

    Switching a proxy from ``ack`` to ``journal`` durability must not strand what its spool
    holds. Returns how many records moved.
    """
    moved = 0
    while batch := spool.oldest(256):
        for record in batch:
            journal.append(record.topic, record.key, record.value, record.headers)
            spool.remove(record)
            moved += 1
    if moved:
        journal.sync()
        logger.info("moved %d records from the spool at %s into the journal", moved, spool.directory)
    return moved


def spool_path(directory: Path) -> Path:
    """Where the journal lives inside the proxy's spool folder."""
    return directory / "journal"


__all__ = ["JournalPublisher", "import_spool", "spool_path"]
