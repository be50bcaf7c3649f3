"""The journal shipper's pause between batches, and where a batch ends, against the real broker.

The shipper lingers after a batch so that the next one gathers more events (fewer produce
requests per call). Two things must not follow from that pause: a backlog shipped one batch per
linger (a busy proxy journals faster than that, so its journal would grow until it refused
calls), and a reward waiting out the pause before its rollout's calls reach Kafka.

The linger here is far longer than any of the waits, so a pause taken where none is due shows
as a wait that runs out, not as a slightly slower run. A batch also ends before a reward that
follows calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from factories import reward
from proxy_helpers import stored, until

from producers.journal import Journal
from producers.shipper import JournalPublisher, Shipper
from stream import EventProducer, KafkaSettings, TopicRegistry
from stream.topics import REWARDS, ROLLOUTS

pytestmark = pytest.mark.kafka

LINGER_S = 60.0


async def _stored(kafka: KafkaSettings, registry: TopicRegistry) -> int:
    return await stored(kafka, registry, registry[REWARDS].name)


@contextlib.asynccontextmanager
async def _shipping(tmp_path: Path, kafka: KafkaSettings, registry: TopicRegistry, *,
                    batch_bytes: int) -> AsyncIterator[tuple[Journal, Shipper]]:
    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    shipper = Shipper(lambda: EventProducer(kafka, registry=registry), journal, registry, ack_timeout_s=10.0,
                      batch_records=1024, batch_bytes=batch_bytes, linger_s=LINGER_S, idle_wait_s=0.05)
    assert await shipper.connect()
    runner = asyncio.create_task(shipper.run())
    try:
        yield journal, shipper
    finally:
        shipper.stop_when_done()
        await asyncio.wait_for(runner, 20)
        await shipper.close()
        journal.close()


def _append(journal: Journal, registry: TopicRegistry, count: int, size: int) -> int:
    seq = -1
    for i in range(count):
        seq = journal.append(registry[REWARDS].name, f"r-{i % 4}".encode(), bytes([i % 256]) * size, ())
    return seq


async def test_a_backlog_of_full_batches_ships_without_pausing_between_them(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    # 40 records of 2 KiB, batches of at most 8 KiB: at least five full batches in a row.
    async with _shipping(tmp_path, kafka_settings, topics, batch_bytes=8 * 1024) as (journal, shipper):
        last = _append(journal, topics, 40, 2048)
        shipper.wake()
        assert await until(lambda: shipper.shipped >= last, 20.0), \
            f"shipped up to {shipper.shipped} of {last}: the shipper paused after a full batch"
    assert await _stored(kafka_settings, topics) == 40


async def test_an_append_leaves_the_linger_alone_and_a_waiting_reward_cuts_it_short(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    async with _shipping(tmp_path, kafka_settings, topics, batch_bytes=1 << 20) as (journal, shipper):
        first = _append(journal, topics, 1, 100)
        shipper.wake()
        assert await until(lambda: shipper.shipped >= first, 20.0)
        # The shipper now lingers. Appends wake it on every call; they must not end the pause,
        # or no batch would ever gather more than one event.
        second = _append(journal, topics, 3, 100)
        shipper.wake()
        assert not await until(lambda: shipper.shipped >= second, 1.0)
        shipper.hurry()  # a verifier's reward waits for its rollout's calls
        assert await until(lambda: shipper.shipped >= second, 20.0), "the waiting reward sat out the linger"
    assert await _stored(kafka_settings, topics) == 4


async def test_a_record_a_poll_finds_leaves_without_a_linger(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    # The shipping process is not woken per append: it polls every idle wait. What a poll finds
    # has gathered for that wait already; a linger on top would double the delay of each event.
    async with _shipping(tmp_path, kafka_settings, topics, batch_bytes=1 << 20) as (journal, shipper):
        await asyncio.sleep(0.3)  # idle: several polls found nothing
        last = _append(journal, topics, 2, 100)  # no wake, as for records journalled at start
        assert await until(lambda: shipper.shipped >= last, 10.0), "a record found by a poll sat out a linger"
    assert await _stored(kafka_settings, topics) == 2


async def test_a_reward_waiting_for_kafka_does_not_sit_out_the_linger(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    journal = Journal(tmp_path, 64 << 20)
    publisher = JournalPublisher(lambda: EventProducer(kafka_settings, registry=topics), journal, topics,
                                 ack_timeout_s=10.0, linger_s=LINGER_S)
    await publisher.start()
    try:
        # The first event leaves at once (nothing was waiting); the shipper lingers after it.
        assert await publisher.publish(REWARDS, reward(), wait_for_kafka=True) == "kafka"
        started = asyncio.get_running_loop().time()
        outcome = await publisher.publish(REWARDS, reward(), wait_for_kafka=True)
        waited = asyncio.get_running_loop().time() - started
        assert outcome == "kafka", f"the reward was still only in the journal after {waited:.1f}s"
    finally:
        await publisher.stop()
    assert await _stored(kafka_settings, topics) == 2


class _BatchesSeen(EventProducer):
    """The real producer, noting the topics of each batch it is given to send."""

    batches: list[list[str]] = []

    async def send_many_raw(self, records, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.batches.append([record[0] for record in records])
        return await super().send_many_raw(records, *args, **kwargs)


async def test_a_reward_is_sent_only_after_the_calls_before_it_are_acknowledged(
        tmp_path: Path, kafka_settings: KafkaSettings, topics: TopicRegistry) -> None:
    # In one batch a reward's partition may be stored while a call's is not (its leader moving):
    # the reward would end the rollout in the assembler without that call. So a reward starts a
    # batch of its own after other records; rewards in a row still share one.
    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    calls, rewards = topics[ROLLOUTS].name, topics[REWARDS].name
    for topic in (calls, calls, rewards, rewards, calls, rewards):
        journal.append(topic, b"r-1", b"{}", ())
    _BatchesSeen.batches = []
    shipper = Shipper(lambda: _BatchesSeen(kafka_settings, registry=topics), journal, topics, ack_timeout_s=10.0,
                      batch_records=1024, linger_s=0.01, idle_wait_s=0.05)
    runner = asyncio.create_task(shipper.run())
    try:
        assert await until(lambda: shipper.shipped >= 5, 20.0), shipper.shipped
    finally:
        shipper.stop_when_done()
        await asyncio.wait_for(runner, 20)
        await shipper.close()
        journal.close()
    assert _BatchesSeen.batches == [[calls, calls], [rewards, rewards, calls], [rewards]]
    assert await _stored(kafka_settings, topics) == 3
