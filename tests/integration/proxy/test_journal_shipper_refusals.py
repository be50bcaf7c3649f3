"""A record the broker refuses for good must not hold back every record behind it.

Kafka refuses some records whatever the retry: larger than the topic's ``max.message.bytes`` as
the broker has it (an operator may have lowered it below what the registry assumes), a policy.
The shipper used to send the same batch again for ever, so the
journal filled and the proxy refused every call. It now finds the record, puts it on the
dead-letter topic with the broker's reason, and ships on.

A topic that does not exist is not a refusal: its records wait in the journal until it does, and
the shipper says which topic is missing and how to create it. Nor is a journal that cannot be read
for a moment: the shipper tries again from the first record not shipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from producers.journal import Journal
from producers.shipper import Shipper
from schemas import DeadLetterV1
from schemas._errors import DeadLetterErrorType
from schemas.registry import decode
from stream import EventProducer, KafkaSettings, TopicRegistry
from stream.admin import KafkaAdmin
from stream.broker import BROKER_MESSAGE_MAX_BYTES
from stream.topics import DEAD_LETTERS, Topic, TopicSpec

pytestmark = pytest.mark.kafka


async def _records(kafka: KafkaSettings, topic: str, expect: int, timeout_s: float = 20.0) -> list:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka.bootstrap_servers, auto_offset_reset="earliest",
                                enable_auto_commit=False, max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    found: list = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(found) < expect and asyncio.get_running_loop().time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                found.extend(batch)
        for batch in (await consumer.getmany(timeout_ms=300)).values():  # anything more is a copy
            found.extend(batch)
    finally:
        await consumer.stop()
    return found


async def test_a_record_the_broker_refuses_goes_to_the_dead_letter_topic_and_the_rest_ship(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    small = Topic(f"{topics.prefix}refusals.{uuid.uuid4().hex[:8]}", 1,
                  TopicSpec(base_name="refusals", partitions=1, schemas=(), key="", max_message_bytes=20_000))
    async with KafkaAdmin(kafka_settings, topics) as admin:
        await admin.create_topics([small])
    values = [os.urandom(size) for size in (100, 100, 60_000, 100, 100)]  # random: compression cannot shrink it
    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    for value in values:
        journal.append(small.name, b"r-1", value, (("h", b"1"),))
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=topics), journal, topics, ack_timeout_s=10.0,
                      linger_s=60.0, idle_wait_s=0.05)  # a linger after each single record would run out the wait below
    async with _running(shipper, journal):
        await _until(lambda: shipper.shipped >= 4, 30.0)
        assert shipper.shipped == 4 and shipper.refused == 1 and not shipper.failed
        # The batch's refusal only: the record after the refused one is sent by a new producer,
        # as the old one's sequence for the partition counts the refused batch.
        assert shipper.publish_errors == 1
    stored = await _records(kafka_settings, small.name, expect=4)
    assert [r.value for r in stored] == [values[0], values[1], values[3], values[4]]  # in order, once each
    letters = [decode(r.headers, r.value) for r in await _records(kafka_settings, topics[DEAD_LETTERS].name, 1)]
    [letter] = [x for x in letters if isinstance(x, DeadLetterV1) and x.topic == small.name]
    assert letter.error_type is DeadLetterErrorType.REFUSED_BY_BROKER and letter.offset == 2
    assert letter.value == values[2] and letter.key == b"r-1" and letter.headers == [("h", b"1")]
    assert "MessageSizeTooLarge" in letter.reason or "TooLarge" in (letter.exception_type or "")


async def test_a_record_the_client_refuses_while_queueing_goes_to_the_dead_letter_topic(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    # Over the producer's own request limit, the record is refused before it reaches the broker,
    # as it is queued, not by the broker's answer: it must still go to the dead-letter topic
    # rather than be sent again for ever with the journal filling behind it.
    target = f"{topics.prefix}refusals.{uuid.uuid4().hex[:8]}"
    async with KafkaAdmin(kafka_settings, topics) as admin:
        await admin.create_topics([Topic(target, 1, TopicSpec(base_name="refusals", partitions=1, schemas=(), key=""))])
    journal = Journal(tmp_path, 1 << 30)
    journal.open()
    for value in (b"before", os.urandom(BROKER_MESSAGE_MAX_BYTES + 1024), b"after"):
        journal.append(target, b"r-1", value, ())
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=topics), journal, topics, ack_timeout_s=10.0,
                      linger_s=60.0, idle_wait_s=0.05)
    async with _running(shipper, journal):
        await _until(lambda: shipper.shipped >= 2, 60.0)
        assert shipper.shipped == 2 and shipper.refused == 1 and not shipper.failed
    stored = [r.value for r in await _records(kafka_settings, target, expect=2)]
    assert list(dict.fromkeys(stored)) == [b"before", b"after"]
    letters = [decode(r.headers, r.value) for r in await _records(kafka_settings, topics[DEAD_LETTERS].name, 1)]
    [letter] = [x for x in letters if isinstance(x, DeadLetterV1) and x.topic == target]
    assert letter.error_type is DeadLetterErrorType.REFUSED_BY_BROKER and letter.value_truncated
    assert "TooLargeError" in (letter.exception_type or "")  # the client's own refusal, not the broker's

async def test_a_missing_topic_is_named_with_its_remedy_and_its_records_ship_once_it_exists(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, caplog: pytest.LogCaptureFixture) -> None:
    # Brokers here do not create topics on first use; aiokafka then waits for the topic until
    # the batch times out, and the shipper used to log only that timeout, for ever.
    absent = Topic(f"{topics.prefix}absent.{uuid.uuid4().hex[:8]}", 1,
                   TopicSpec(base_name="absent", partitions=1, schemas=(), key=""))
    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    for i in range(3):
        journal.append(absent.name, b"r-1", f"value-{i}".encode(), (("h", b"1"),))
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=topics), journal, topics, ack_timeout_s=2.0,
                      idle_wait_s=0.05)
    caplog.set_level(logging.INFO, logger="producers.shipper")
    async with _running(shipper, journal):
        await _until(lambda: bool(_shipper_errors(caplog)), 10.0)
        [said] = _shipper_errors(caplog)
        assert f"topic {absent.name} does not exist on {kafka_settings.bootstrap_servers}" in said
        assert "openforge topics create" in said and "journalled events (a batch of 3) wait" in said
        assert shipper.shipped == -1 and len(journal) == 3 and not shipper.failed  # kept, not dropped
        # The next try finds it still missing, and says so quietly; readiness's "kafka" stays
        # false through it (not true for the moment the try's producer is up).
        ok_while_missing = False
        deadline = asyncio.get_running_loop().time() + 10.0
        while (not any("still wait for topics" in m for m in _shipper_messages(caplog))
               and asyncio.get_running_loop().time() < deadline):
            ok_while_missing |= shipper.kafka_ok
            await asyncio.sleep(0.001)
        assert not ok_while_missing
        async with KafkaAdmin(kafka_settings, topics) as admin:
            await admin.create_topics([absent])
        await _until(lambda: shipper.shipped == 2, 30.0)
        assert shipper.shipped == 2 and shipper.kafka_ok
    stored = await _records(kafka_settings, absent.name, expect=3)
    assert [r.value for r in stored] == [b"value-0", b"value-1", b"value-2"]  # in order, once each
    # Said loudly once; a retry that finds the same topic still missing does not repeat the error.
    assert len(_shipper_errors(caplog)) == 1
    assert any(f"(a batch of 3) still wait for topics {absent.name}" in m for m in _shipper_messages(caplog))


@contextlib.asynccontextmanager
async def _running(shipper: Shipper, journal: Journal) -> AsyncIterator[None]:
    """The shipper running on ``journal``; afterwards stopped, drained, and the journal closed."""
    runner = asyncio.create_task(shipper.run())
    try:
        yield
    finally:
        shipper.stop_when_done()
        await asyncio.wait_for(runner, 20)
        await shipper.close()
        journal.close()


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Wait until ``condition`` holds or ``timeout_s`` passes (the caller's asserts then say which)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def _shipper_messages(caplog: pytest.LogCaptureFixture, level: int = logging.NOTSET) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "producers.shipper" and r.levelno >= level]


def _shipper_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return _shipper_messages(caplog, logging.ERROR)


async def test_a_journal_read_that_fails_once_injected_ships_every_record_once_in_order(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """An inline shipper whose read fails part-way: opening the next segment finds no descriptor
    left (injected: ``os.open`` of that segment raises EMFILE once). It used to end there (the
    proxy shipped nothing more and refused every call once the journal filled). Now it reads
    again from the first record not shipped: nothing the failed read had passed is skipped, and
    the segment it had closed is opened again rather than read through a stale descriptor."""
    topic = Topic(f"{topics.prefix}reads.{uuid.uuid4().hex[:8]}", 1,
                  TopicSpec(base_name="reads", partitions=1, schemas=(), key=""))
    async with KafkaAdmin(kafka_settings, topics) as admin:
        await admin.create_topics([topic])
    journal = Journal(tmp_path, 64 << 20, segment_bytes=256)
    journal.open()
    values = [f"value-{i}".encode().ljust(100, b".") for i in range(8)]  # two records a segment
    for value in values:
        journal.append(topic.name, b"r-1", value, ())
    real_open, failures = os.open, []

    def open_failing_once(path: object, flags: int, *args: int, **kwargs: object) -> int:
        # Reads open read-only; the first segment's name is all zeros (this skips the writer).
        if not failures and flags == os.O_RDONLY and str(path).endswith(".log") and not str(path).endswith(
                f"{0:020d}.log"):
            failures.append(path)
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", open_failing_once)
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=topics), journal, topics, ack_timeout_s=10.0,
                      linger_s=0, idle_wait_s=0.05)
    async with _running(shipper, journal):
        await _until(lambda: shipper.shipped >= 7, 30.0)
        assert failures and shipper.shipped == 7 and not shipper.failed
    assert [r.value for r in await _records(kafka_settings, topic.name, expect=8)] == values


async def _tight_topics(kafka: KafkaSettings, topics: TopicRegistry) -> tuple[TopicRegistry, Topic, Topic]:
    """A registry whose dead-letter topic takes 50 kB, and a topic of its prefix that takes 20 kB, made
    as an operator might make them outside the registry's tooling (which assumes far more)."""
    registry = TopicRegistry(prefix=f"{topics.prefix}tight{uuid.uuid4().hex[:6]}.")
    letters = Topic(registry[DEAD_LETTERS].name, 1, dataclasses.replace(DEAD_LETTERS, max_message_bytes=50_000))
    small = Topic(f"{registry.prefix}refusals", 1,
                  TopicSpec(base_name="refusals", partitions=1, schemas=(), key="", max_message_bytes=20_000))
    async with KafkaAdmin(kafka, registry) as admin:
        await admin.create_topics([letters, small])
    return registry, letters, small


async def _raise_limit(kafka: KafkaSettings, topic: str) -> None:
    """The operator's remedy: ``topic`` takes records of up to 1 MiB from now on."""
    client = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await client.start()
    try:
        await client.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, {"max.message.bytes": str(1 << 20)})])
    finally:
        await client.close()


async def test_a_record_whose_dead_letter_is_refused_too_waits_reported_once_and_ships_once_the_topic_takes_it(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """Topics made outside the registry's tooling keep the broker's default limit, so a large record
    and its dead letter can both be refused. The shipper used to send the pair again for ever,
    logging a traceback each time and saying nothing of the remedy. Now the record waits, as for a
    missing topic: Kafka counts as not ready, the error names both topics and the sizes to allow,
    once, and once the dead-letter topic takes the letter every record behind it ships, in order."""
    registry, letters, small = await _tight_topics(kafka_settings, topics)
    values = [os.urandom(size) for size in (100, 60_000, 100)]  # the letter: 80 kB of base64
    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    for value in values[:2]:
        journal.append(small.name, b"r-1", value, ())
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=registry), journal, registry, ack_timeout_s=10.0,
                      linger_s=0, idle_wait_s=0.05)
    caplog.set_level(logging.INFO, logger="producers.shipper")
    async with _running(shipper, journal):
        await _until(lambda: shipper.publish_errors >= 3, 30.0)  # the pair was tried again, more than once
        assert shipper.shipped == 0 and not shipper.failed and not shipper.kafka_ok
        [report] = [m for m in _shipper_errors(caplog) if "dead letter" in m]
        assert f"raise max.message.bytes of {small.name}" in report and letters.name in report
        await _raise_limit(kafka_settings, letters.name)
        await _until(lambda: shipper.refused == 1, 40.0)
        assert shipper.kafka_ok  # the letter ended the wait: no later record need ship to say so
        journal.append(small.name, b"r-1", values[2], ())
        shipper.wake()
        await _until(lambda: shipper.shipped >= 2, 40.0)
        assert shipper.shipped == 2 and shipper.refused == 1 and shipper.kafka_ok
    assert [r.value for r in await _records(kafka_settings, small.name, expect=2)] == [values[0], values[2]]
    [letter] = [decode(r.headers, r.value) for r in await _records(kafka_settings, letters.name, 1)]
    assert isinstance(letter, DeadLetterV1) and letter.value == values[1] and letter.offset == 1


async def _topic_and_journal(tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,
                             base: str) -> tuple[Topic, Journal]:
    """A fresh one-partition topic of the broker's limits, and an open journal to ship to it."""
    topic = Topic(f"{topics.prefix}{base}.{uuid.uuid4().hex[:8]}", 1,
                  TopicSpec(base_name=base, partitions=1, schemas=(), key=""))
    async with KafkaAdmin(kafka_settings, topics) as admin:
        await admin.create_topics([topic])
    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    return topic, journal


async def test_a_failure_the_shipping_loop_does_not_expect_starts_it_again_and_nothing_is_skipped_injected(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """Marking records shipped raises once (injected: as listing the folder can in the shipping
    process, out of descriptors). The inline shipper's task used to end there, unseen: the proxy
    stopped shipping and refused every call once the journal filled. Now the loop starts again
    from the first record not shipped; what Kafka had already taken comes again, which consumers
    drop by id, and every record arrives in order."""
    topic, journal = await _topic_and_journal(tmp_path, kafka_settings, topics, "marks")
    values = [f"value-{i}".encode() for i in range(6)]
    for value in values[:3]:
        journal.append(topic.name, b"r-1", value, ())
    real_mark, failures = journal.mark_shipped, []

    def mark_failing_once(records: list) -> None:
        if not failures:
            failures.append(len(records))
            raise OSError(errno.EMFILE, "Too many open files")
        real_mark(records)

    journal.mark_shipped = mark_failing_once  # type: ignore[method-assign]
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=topics), journal, topics, ack_timeout_s=10.0,
                      linger_s=0, idle_wait_s=0.05)
    caplog.set_level(logging.INFO, logger="producers.shipper")
    async with _running(shipper, journal):
        await _until(lambda: shipper.shipped >= 2, 30.0)
        for value in values[3:]:  # appended after the failure: the loop runs again
            journal.append(topic.name, b"r-1", value, ())
        shipper.wake()
        await _until(lambda: shipper.shipped >= 5, 30.0)
        assert failures and shipper.shipped == 5 and not shipper.failed
        assert any("failed unexpectedly" in m for m in _shipper_errors(caplog))
    stored = [r.value for r in await _records(kafka_settings, topic.name, expect=6 + failures[0])]
    assert list(dict.fromkeys(stored)) == values  # copies of what was sent before the failure, in order


@pytest.mark.parametrize(("healthy_run_s", "pauses"), [(3600.0, [1.0, 2.0]), (0.0, [1.0, 1.0])])
async def test_a_restart_after_a_healthy_run_pauses_as_briefly_as_the_first_injected(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, monkeypatch: pytest.MonkeyPatch,
        healthy_run_s: float, pauses: list[float]) -> None:
    """Marking records shipped raises twice, the loop shipping in between (injected, as above).
    The restart pause doubled for ever: a failure a day after the last one waited as long as the
    tenth of a burst. A loop that ran long enough before failing (here: any time at all, or an
    hour) starts again after the shortest pause."""
    monkeypatch.setattr("producers.shipper._HEALTHY_RUN_S", healthy_run_s)
    topic, journal = await _topic_and_journal(tmp_path, kafka_settings, topics, "restarts")
    real_mark, marks = journal.mark_shipped, []

    def mark_failing_at_first_and_third(records: list) -> None:
        marks.append(len(records))
        if len(marks) in (1, 3):
            raise OSError(errno.EMFILE, "Too many open files")
        real_mark(records)

    journal.mark_shipped = mark_failing_at_first_and_third  # type: ignore[method-assign]
    shipper = Shipper(lambda: EventProducer(kafka_settings, registry=topics), journal, topics, ack_timeout_s=10.0,
                      linger_s=0, idle_wait_s=0.05)
    real_pause, paused = shipper._pause, []

    async def pause(seconds: float) -> None:
        paused.append(seconds)
        await real_pause(min(seconds, 0.05))

    shipper._pause = pause  # type: ignore[method-assign]
    async with _running(shipper, journal):
        for i, marked in enumerate((2, 4, 5)):  # a failed mark and its retry, twice; then one that holds
            journal.append(topic.name, b"r-1", f"value-{i}".encode(), ())
            shipper.wake()
            await _until(lambda marked=marked: len(marks) >= marked, 30.0)
        await _until(lambda: shipper.shipped >= 3, 30.0)
    assert len(marks) == 5 and paused == pauses
