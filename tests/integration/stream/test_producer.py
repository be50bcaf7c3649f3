"""The producer wrapper against the real broker: round trips, sizes, transactions, trace context."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.partitioner import DefaultPartitioner
from factories import model_call, reward
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from schemas import decode
from stream.producer import EventProducer, EventTooLargeError, WrongTopicError
from stream.topics import CALLS, REWARDS, TopicRegistry
from stream.tracing import extract_trace_context

pytestmark = pytest.mark.kafka


async def drain(bootstrap: str, topic: str, *, expect: int, isolation_level: str = "read_committed",
                settle_s: float = 0.0) -> list:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, isolation_level=isolation_level,
                                max_partition_fetch_bytes=32 * 1024 * 1024)
    await consumer.start()
    records: list = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while len(records) < expect and loop.time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(batch)
        settle = loop.time() + settle_s
        while loop.time() < settle:
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def test_large_call_round_trips_exactly_with_compression(kafka_settings, topics: TopicRegistry) -> None:
    call = model_call(prompt_tokens=100_000, completion_tokens=2_000, seed=7)
    async with EventProducer(kafka_settings) as producer:
        meta = await producer.publish(CALLS, call)
    [record] = await drain(kafka_settings.bootstrap_servers, topics[CALLS].name, expect=1)
    assert (record.partition, record.offset) == (meta.partition, meta.offset)
    assert record.key == call.rollout_id.encode()
    assert decode(record.headers, record.value) == call
    assert list(decode(record.headers, record.value).prompt_token_ids) == list(call.prompt_token_ids)


async def test_oversized_event_fails_with_the_limit_named(kafka_settings, topics: TopicRegistry) -> None:
    limit = topics[CALLS].spec.max_message_bytes
    huge = model_call(prompt_tokens=limit // 5, completion_tokens=1)  # ~6.7 base64 bytes per id
    async with EventProducer(kafka_settings) as producer:
        with pytest.raises(EventTooLargeError, match=rf"max\.message\.bytes={limit:,}") as info:
            await producer.send(CALLS, huge)
        assert topics[CALLS].name in str(info.value)
        # Nothing half-sent: the topic stays empty, and the producer still works.
        await producer.publish(CALLS, model_call())
    records = await drain(kafka_settings.bootstrap_servers, topics[CALLS].name, expect=2, settle_s=0.5)
    assert len(records) == 1


async def test_raw_record_over_the_broker_topic_limit_is_refused_by_the_broker(
    kafka_settings, topics: TopicRegistry
) -> None:
    # send_raw skips our own check; the broker's max.message.bytes must still hold.
    too_big = b"x" * (topics[REWARDS].spec.max_message_bytes + 1024)
    async with EventProducer(kafka_settings.model_copy(update={"compression": "none"})) as producer:
        future = await producer.send_raw(topics[REWARDS].name, too_big)
        with pytest.raises(Exception, match="(?i)too ?large"):
            await future


async def test_event_on_the_wrong_topic_is_refused(kafka_settings, topics: TopicRegistry) -> None:
    async with EventProducer(kafka_settings) as producer:
        with pytest.raises(WrongTopicError, match="reward"):
            await producer.send(CALLS, reward())


async def test_transactions_committed_visible_aborted_invisible(kafka_settings, topics: TopicRegistry) -> None:
    committed = [reward("r-tx", float(i)) for i in range(3)]
    aborted = [reward("r-tx", 100.0 + i) for i in range(3)]
    async with EventProducer(kafka_settings, transactional_id=f"{kafka_settings.topic_prefix}tx") as producer:
        async with producer.transaction():
            for e in committed:
                await producer.send(REWARDS, e)
        with pytest.raises(RuntimeError, match="abort me"):
            async with producer.transaction():
                for e in aborted:
                    await producer.send(REWARDS, e)
                await producer.flush()  # the records reach the log; only the abort hides them
                raise RuntimeError("abort me")
    name = topics[REWARDS].name
    visible = await drain(kafka_settings.bootstrap_servers, name, expect=3, settle_s=1.0)
    assert [decode(r.headers, r.value) for r in visible] == committed
    everything = await drain(kafka_settings.bootstrap_servers, name, expect=6,
                             isolation_level="read_uncommitted", settle_s=0.5)
    assert len(everything) == 6  # the aborted records exist; read_committed hid them


async def test_transactional_offsets_commit_with_outputs(kafka_settings, topics: TopicRegistry) -> None:
    from aiokafka.structs import TopicPartition
    group = f"{kafka_settings.topic_prefix}assembler"
    tp = TopicPartition(topics[CALLS].name, 0)
    async with EventProducer(kafka_settings, transactional_id=f"{group}-0") as producer:
        async with producer.transaction():
            await producer.send(REWARDS, reward("r-offsets"))
            await producer.send_offsets_to_transaction({tp: 42}, group)
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_settings.bootstrap_servers, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        assert await consumer.committed(tp) == 42
    finally:
        await consumer.stop()


async def test_trace_context_travels_in_headers(kafka_settings, topics: TopicRegistry) -> None:
    parent = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
                         is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    async with EventProducer(kafka_settings) as producer:
        with trace.use_span(NonRecordingSpan(parent)):
            await producer.publish(REWARDS, reward("r-trace"))
    [record] = await drain(kafka_settings.bootstrap_servers, topics[REWARDS].name, expect=1)
    headers = dict(record.headers)
    assert headers["traceparent"] == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    carried = trace.get_current_span(extract_trace_context(record.headers)).get_span_context()
    assert carried.trace_id == parent.trace_id
    assert headers["schema"] == b"reward" and headers["schema-version"] == b"1"


async def test_send_many_raw_keeps_send_raws_partitions_and_order_and_takes_large_records(
        kafka_settings, topics: TopicRegistry) -> None:
    name = topics[CALLS].name
    small = [(name, f"r-{i % 7}".encode(), f"small-{i}".encode(), [("n", str(i).encode())]) for i in range(60)]
    big = (name, b"r-3", b"x" * (2 * 1024 * 1024), [("n", b"big")])  # larger than a producer batch
    records = [*small[:30], big, *small[30:]]
    async with EventProducer(kafka_settings) as producer:
        # Where send_raw puts each key, for comparison.
        probes = {key: (await (await producer.send_raw(name, b"probe", key=key))).partition
                  for key in {r[1] for r in records}}
        # ... which is aiokafka's own default partitioner's choice (the producer caches key hashes).
        all_partitions = sorted(await producer.raw.partitions_for(name))
        assert len(all_partitions) > 1 and len(set(probes.values())) > 1
        assert probes == {key: DefaultPartitioner()(key, all_partitions, all_partitions) for key in probes}
        futures = await producer.send_many_raw(records)
        assert len(futures) < len(records)  # batched, not one future per record
        await asyncio.gather(*futures)
    got = [r for r in await drain(kafka_settings.bootstrap_servers, name, expect=len(records) + len(probes))
           if r.value != b"probe"]
    assert len(got) == len(records)
    for record in got:
        assert record.partition == probes[record.key]
        assert dict(record.headers)["n"] in (b"big", *(str(i).encode() for i in range(60)))
    for key in probes:  # per key (hence per partition), the order they were given in
        sent = [r[3][0][1] for r in records if r[1] == key]
        assert [dict(r.headers)["n"] for r in sorted(got, key=lambda r: r.offset) if r.key == key] == sent
