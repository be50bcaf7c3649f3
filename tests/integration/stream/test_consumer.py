"""The consumer wrapper against the real broker: commits, rebalances, dead letters, drain."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import pytest
from aiokafka import AIOKafkaConsumer
from factories import reward

from schemas import DeadLetterErrorType, DeadLetterV1, RewardV1, decode, encode
from stream.admin import KafkaAdmin
from stream.consumer import ConsumerSettings, EventConsumer, Received
from stream.lifecycle import supervise
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import DEAD_LETTERS, REWARDS, Topic, TopicRegistry

pytestmark = pytest.mark.kafka

FAST = ConsumerSettings(commit_interval_s=0.2, drain_timeout_s=5, retry_backoff_s=0.01,
                        session_timeout_ms=6000)


async def wait_until(predicate, limit_s: float = 30.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def publish_rewards(settings: KafkaSettings, n: int, prefix: str = "r") -> list[RewardV1]:
    events = [reward(f"{prefix}-{i % 7}", value=float(i)) for i in range(n)]
    async with EventProducer(settings) as producer:
        futures = [await producer.send(REWARDS, e) for e in events]
        await asyncio.gather(*futures)
    return events


async def read_dead_letters(settings: KafkaSettings, registry: TopicRegistry, n: int) -> list[DeadLetterV1]:
    consumer = AIOKafkaConsumer(registry[DEAD_LETTERS].name, bootstrap_servers=settings.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    out: list[DeadLetterV1] = []
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while len(out) < n and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    event = decode(r.headers, r.value)
                    assert isinstance(event, DeadLetterV1)
                    out.append(event)
    finally:
        await consumer.stop()
    return out


async def test_consumer_hands_over_decoded_events_and_commits(kafka_settings, topics) -> None:
    sent = await publish_rewards(kafka_settings, 20)
    got: list[Received] = []

    async def handle(received: Received) -> None:
        got.append(received)

    async with EventConsumer([REWARDS], handle, group_id="g-basic", kafka=kafka_settings, settings=FAST):
        await wait_until(lambda: len(got) == 20, what="20 events")
    assert sorted(r.event.event_id for r in got) == sorted(e.event_id for e in sent)
    assert {r.event.event_id: r.event for r in got} == {e.event_id: e for e in sent}
    # Per key, order is produce order.
    for key in {e.rollout_id for e in sent}:
        assert [r.event.value for r in got if r.event.rollout_id == key] == \
            [e.value for e in sent if e.rollout_id == key]


async def test_restarted_consumer_resumes_from_committed_offset(kafka_settings, topics) -> None:
    await publish_rewards(kafka_settings, 10)
    first: list[str] = []

    async def handle_first(received: Received) -> None:
        first.append(received.event.event_id)

    async with EventConsumer([REWARDS], handle_first, group_id="g-resume", kafka=kafka_settings, settings=FAST):
        await wait_until(lambda: len(first) == 10, what="first 10")
    later = await publish_rewards(kafka_settings, 5, prefix="later")
    second: list[str] = []

    async def handle_second(received: Received) -> None:
        second.append(received.event.event_id)

    async with EventConsumer([REWARDS], handle_second, group_id="g-resume", kafka=kafka_settings, settings=FAST):
        await wait_until(lambda: len(second) >= 5, what="5 later events")
        await asyncio.sleep(1.0)  # anything re-read would show up by now
    assert sorted(second) == sorted(e.event_id for e in later)


async def test_rebalance_loses_nothing_and_reads_nothing_twice(kafka_settings, topics) -> None:
    settings = kafka_settings.model_copy(update={"partitions": 4})
    registry = TopicRegistry.from_settings(settings)
    # A 4-partition topic of our own, so the two members really split the work.
    topic = Topic(registry[REWARDS].name + "-4p", 4, REWARDS)
    async with KafkaAdmin(settings, registry) as admin:
        await admin.create_topics([topic])
    seen: Counter[str] = Counter()
    by_member: dict[str, int] = Counter()

    def handler(member: str):
        async def handle(received: Received) -> None:
            seen[received.event.event_id] += 1
            by_member[member] += 1
            await asyncio.sleep(0.002)
        return handle

    events = [reward(f"k-{i % 16}", float(i)) for i in range(400)]
    async with EventProducer(settings, registry=registry) as producer:
        for e in events[:200]:
            await producer.send(topic, e)
        await producer.flush()
    a = EventConsumer([topic], handler("a"), group_id="g-rebalance", kafka=settings, settings=FAST,
                      registry=registry)
    b = EventConsumer([topic], handler("b"), group_id="g-rebalance", kafka=settings, settings=FAST,
                      registry=registry)
    await a.start()
    await wait_until(lambda: by_member["a"] >= 50, what="a consuming")
    await b.start()  # joins: a gives up some partitions mid-stream
    async with EventProducer(settings, registry=registry) as producer:
        for e in events[200:]:
            await producer.send(topic, e)
        await producer.flush()
    await wait_until(lambda: by_member["b"] > 0, what="b consuming")
    await a.stop()  # leaves: b takes everything over
    await wait_until(lambda: len(seen) == 400, what="all 400 events")
    await asyncio.sleep(1.0)
    await b.stop()
    assert set(seen) == {e.event_id for e in events}
    assert [k for k, n in seen.items() if n > 1] == []


async def test_undecodable_and_unknown_version_are_dead_lettered_and_consumer_keeps_going(
    kafka_settings, topics
) -> None:
    name = topics[REWARDS].name
    good = reward("r-good")
    value, headers = encode(good)
    wrong_version = [(k, b"99" if k == "schema-version" else v) for k, v in headers]
    async with EventProducer(kafka_settings) as producer:
        await (await producer.send_raw(name, b"\x00\xffnot json", key=b"r-bad", headers=headers))
        await (await producer.send_raw(name, value, key=b"r-bad", headers=wrong_version))
        await (await producer.send_raw(name, value, key=b"r-bad", headers=[]))
        await (await producer.send_raw(name, b'{"rollout_id": 5}', key=b"r-bad", headers=headers))
        await producer.publish(REWARDS, good)
    got: list[Received] = []

    async def handle(received: Received) -> None:
        got.append(received)

    async with EventConsumer([REWARDS], handle, group_id="g-dlq", kafka=kafka_settings,
                             settings=FAST) as consumer:
        await wait_until(lambda: len(got) == 1, what="the good event after the bad ones")
        assert consumer.dead_lettered == 4
    assert got[0].event == good
    letters = await read_dead_letters(kafka_settings, topics, 4)
    kinds = [letter.error_type for letter in letters]
    assert kinds == [DeadLetterErrorType.UNDECODABLE, DeadLetterErrorType.UNKNOWN_SCHEMA,
                     DeadLetterErrorType.MISSING_SCHEMA, DeadLetterErrorType.INVALID_EVENT]
    assert "99" in letters[1].reason
    assert letters[0].value == b"\x00\xffnot json"  # the original bytes, exactly
    assert all(letter.topic == name and letter.consumer_group == "g-dlq" for letter in letters)
    assert [letter.offset for letter in letters] == [0, 1, 2, 3]


async def test_failing_handler_is_retried_then_dead_lettered(kafka_settings, topics) -> None:
    await publish_rewards(kafka_settings, 3)
    attempts: Counter[float] = Counter()
    handled: list[float] = []

    async def handle(received: Received) -> None:
        assert isinstance(received.event, RewardV1)
        attempts[received.event.value] += 1
        if received.event.value == 1.0:
            raise RuntimeError("cannot handle reward 1.0")
        handled.append(received.event.value)

    async with EventConsumer([REWARDS], handle, group_id="g-fail", kafka=kafka_settings, settings=FAST):
        await wait_until(lambda: len(handled) == 2, what="the two good events")
    assert attempts[1.0] == FAST.handler_attempts
    [letter] = await read_dead_letters(kafka_settings, topics, 1)
    assert letter.error_type == DeadLetterErrorType.HANDLER_ERROR
    assert "cannot handle reward 1.0" in letter.reason
    assert letter.exception_type == "builtins.RuntimeError"


async def test_sigterm_drains_in_flight_event_and_commits(kafka_settings, topics) -> None:
    await publish_rewards(kafka_settings, 6)
    started = asyncio.Event()
    finished: list[float] = []

    async def slow(received: Received) -> None:
        assert isinstance(received.event, RewardV1)
        started.set()
        await asyncio.sleep(0.5)  # in flight when SIGTERM arrives; must complete, not be cut
        finished.append(received.event.value)

    consumer = EventConsumer([REWARDS], slow, group_id="g-drain", kafka=kafka_settings, settings=FAST)
    run = asyncio.create_task(supervise([consumer]))
    await asyncio.wait_for(started.wait(), 30)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(run, 30)
    assert 1 <= len(finished) < 6
    # The group's committed position is exactly what was finished: no loss, no skip.
    committed = sum(consumer.committed_offsets.values())
    assert committed == len(finished)
    rest: list[float] = []

    async def collect(received: Received) -> None:
        assert isinstance(received.event, RewardV1)
        rest.append(received.event.value)

    async with EventConsumer([REWARDS], collect, group_id="g-drain", kafka=kafka_settings, settings=FAST):
        await wait_until(lambda: len(finished) + len(rest) == 6, what="the remaining events")
    assert sorted(finished + rest) == [float(i) for i in range(6)]


async def test_a_missing_topic_fails_the_start_naming_it_and_leaves_nothing_open(kafka_settings) -> None:
    from stream.topics import MissingTopicsError

    absent = kafka_settings.model_copy(update={"topic_prefix": f"absent{os.urandom(4).hex()}."})
    name = TopicRegistry.from_settings(absent)[REWARDS].name

    async def handle(_: Received) -> None:
        raise AssertionError("nothing can arrive")

    consumer = EventConsumer([REWARDS], handle, group_id="missing-topic", kafka=absent)
    with pytest.raises(MissingTopicsError, match=rf"{name} does not exist.*openforge topics create"):
        await consumer.start()
    assert consumer._consumer._closed  # stopped again, not left running
