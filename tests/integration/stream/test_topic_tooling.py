"""`openforge topics …` and `openforge kafka …` on real topics of the real broker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord
from factories import model_call, reward
from netutil import refused_address

from producers.raw_calls import RAW_CALLS, dead_letter
from schemas import DeadLetterV1, ModelCallV1, RewardV1, decode
from schemas._errors import DeadLetterErrorType
from stream.admin import KafkaAdmin
from stream.consumer import ConsumerSettings, EventConsumer, Received
from stream.producer import EventProducer, encode_record
from stream.settings import KafkaSettings
from stream.topics import CALLS, CHECKPOINTS, DEAD_LETTERS, REWARDS, TopicRegistry, TopicSpec

pytestmark = pytest.mark.kafka


def openforge(settings: KafkaSettings, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": settings.topic_prefix,
           "OPENFORGE_KAFKA_PARTITIONS": str(settings.partitions or 2)}
    proc = subprocess.run([sys.executable, "-m", "openforge", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"openforge {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


async def test_create_is_idempotent_and_list_describe_show_the_registry(kafka_settings, registry) -> None:
    first = await asyncio.to_thread(openforge, kafka_settings, "topics", "create")
    assert first.stdout.count("created") == len(registry)
    second = await asyncio.to_thread(openforge, kafka_settings, "topics", "create")
    assert second.stdout.count("exists") == len(registry) and "created" not in second.stdout
    assert "drift" not in second.stderr
    listed = (await asyncio.to_thread(openforge, kafka_settings, "topics", "list")).stdout
    for topic in registry:
        assert topic.name in listed
    described = (await asyncio.to_thread(openforge, kafka_settings, "topics", "describe", "checkpoints")).stdout
    assert f"{registry[CHECKPOINTS].name}: 2 partitions" in described
    assert "cleanup.policy=compact" in described
    missing = await asyncio.to_thread(openforge, kafka_settings, "topics", "describe", "no-such-topic", check=False)
    assert missing.returncode != 0 and "does not exist" in missing.stderr


async def test_an_unreachable_cluster_is_one_line_naming_it_not_a_traceback(kafka_settings) -> None:
    with refused_address() as address:
        gone = kafka_settings.model_copy(update={"bootstrap_servers": address})
        for command in (("topics", "create"), ("topics", "list")):
            out = await asyncio.to_thread(openforge, gone, *command, check=False)
            assert out.returncode == 1 and "Traceback" not in out.stderr, out
            errors = [line for line in out.stderr.splitlines() if line.startswith("Error: ")]
            assert len(errors) == 1 and "KafkaConnectionError" in errors[0], out.stderr
            assert address.split(":")[1] in errors[0], errors


async def test_create_reports_drift_of_an_existing_topic(kafka_settings, registry) -> None:
    async with KafkaAdmin(kafka_settings, registry) as admin:
        await admin.create_topics()
    other = kafka_settings.model_copy(update={"partitions": 3})
    out = await asyncio.to_thread(openforge, other, "topics", "create")
    assert "drift: partitions: cluster has 2, registry wants 3" in out.stderr


async def test_created_topics_have_leaders_at_once_and_one_never_created_times_out(kafka_settings, registry) -> None:
    """``create_topics`` returns only once the brokers show every topic with a leader per partition.

    The controller answers CreateTopics before the brokers' metadata has the topics; a service
    started in that moment was told its topic did not exist.
    """
    async with KafkaAdmin(kafka_settings, registry) as admin:
        await admin.create_topics()
        for meta in await admin._admin.describe_topics([t.name for t in registry]):
            assert meta["error_code"] == 0, meta
            assert len(meta["partitions"]) == 2 and all(p["leader"] >= 0 for p in meta["partitions"]), meta
        never = f"{kafka_settings.topic_prefix}never-created"
        with pytest.raises(TimeoutError, match=f"did not show {never} with a leader on every partition within 0.3 s"):
            await admin.await_visible([never], timeout_s=0.3)


async def test_tail_decodes_and_filters_by_key_and_type(kafka_settings, topics: TopicRegistry) -> None:
    async with EventProducer(kafka_settings) as producer:
        await producer.publish(REWARDS, reward("r-alpha", 0.25))
        await producer.publish(REWARDS, reward("r-beta", 0.75))
        await producer.publish(CALLS, model_call(prompt_tokens=5000, rollout_id="r-alpha"))
        await producer.send_raw(topics[REWARDS].name, b"garbage", key=b"r-alpha")
        await producer.flush()
    out = (await asyncio.to_thread(openforge, kafka_settings, "topics", "tail", "rewards", "--key", "r-alpha")).stdout
    assert '"value": 0.25' in out and "r-beta" not in out
    assert "UNDECODABLE (missing_schema)" in out  # shown with its reason, not hidden
    typed = (await asyncio.to_thread(openforge, kafka_settings, "topics", "tail", "rewards", "--type", "reward")).stdout
    assert typed.count("reward v1") == 2 and "UNDECODABLE" not in typed
    calls = (await asyncio.to_thread(openforge, kafka_settings, "topics", "tail", "calls")).stdout
    assert "model_call v1" in calls and "5,000 TokenIds in all" in calls  # packed ids summarized
    assert len(calls) < 20_000


async def test_tail_follow_prints_new_events_until_interrupted(kafka_settings, topics: TopicRegistry) -> None:
    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "openforge", "topics", "tail", "rewards", "-f",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        await asyncio.sleep(3)  # let it reach the end of the (empty) topic
        async with EventProducer(kafka_settings) as producer:
            await producer.publish(REWARDS, reward("r-follow", 0.5))
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"r-follow" in line
    finally:
        proc.send_signal(2)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0


async def test_replay_topic_to_file_and_back_is_byte_exact(kafka_settings, topics: TopicRegistry,
                                                           tmp_path: Path) -> None:
    events = [reward(f"r-{i % 3}", float(i)) for i in range(10)]
    async with EventProducer(kafka_settings) as producer:
        for e in events:
            await producer.send(REWARDS, e)
        await producer.send_raw(topics[REWARDS].name, b"\xff\x00binary", key=b"\x01\x02")
        await producer.flush()
    dump = tmp_path / "rewards.jsonl"
    await asyncio.to_thread(openforge, kafka_settings, "topics", "replay", "--from-topic", "rewards",
                            "--to-file", str(dump))
    lines = dump.read_bytes().splitlines()
    assert len(lines) == 11
    docs = [orjson.loads(x) for x in lines]
    assert all(d["topic"] == topics[REWARDS].name for d in docs)
    assert sum(isinstance(d["value"], str) for d in docs) == 10  # events stay readable text
    assert [d["value"] for d in docs if isinstance(d["value"], dict)] == [{"b64": "/wBiaW5hcnk="}]
    # Offset range: only offsets 1..2 of each partition.
    ranged = tmp_path / "ranged.jsonl"
    await asyncio.to_thread(openforge, kafka_settings, "topics", "replay", "--from-topic", "rewards",
                            "--to-file", str(ranged), "--from-offset", "1", "--to-offset", "3")
    assert {orjson.loads(x)["offset"] for x in ranged.read_bytes().splitlines()} == {1, 2}
    # Back into a fresh topic: same keys, values and headers, byte for byte.
    dest = f"{kafka_settings.topic_prefix}replayed"
    from stream.topics import Topic
    async with KafkaAdmin(kafka_settings, topics) as admin:
        await admin.create_topics([Topic(dest, 1, REWARDS)])
    await asyncio.to_thread(openforge, kafka_settings, "topics", "replay", "--from-file", str(dump),
                            "--to-topic", dest)
    consumer = AIOKafkaConsumer(dest, bootstrap_servers=kafka_settings.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    got = []
    try:
        while len(got) < 11:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                got.extend(batch)
    finally:
        await consumer.stop()
    original = {d["value"].encode() for d in docs if isinstance(d["value"], str)}
    assert {r.value for r in got if r.value != b"\xff\x00binary"} == original
    binary = [r for r in got if r.value == b"\xff\x00binary"]
    assert len(binary) == 1 and binary[0].key == b"\x01\x02"
    decoded = sorted((decode(r.headers, r.value) for r in got if r.key != b"\x01\x02"),
                     key=lambda e: e.value)
    assert decoded == events


async def test_replay_time_range(kafka_settings, topics: TopicRegistry, tmp_path: Path) -> None:
    from datetime import UTC, datetime
    async with EventProducer(kafka_settings) as producer:
        await producer.publish(REWARDS, reward("r-early", 1.0))
        await asyncio.sleep(1.2)
        middle = datetime.now(UTC)
        await asyncio.sleep(0.2)
        await producer.publish(REWARDS, reward("r-late", 2.0))
    out = tmp_path / "late.jsonl"
    await asyncio.to_thread(openforge, kafka_settings, "topics", "replay", "--from-topic", "rewards",
                            "--to-file", str(out), "--since", middle.isoformat())
    keys = [orjson.loads(x)["key"] for x in out.read_bytes().splitlines()]
    assert keys == ["r-late"]


async def test_replay_rejects_a_malformed_file_naming_the_line(kafka_settings, topics, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"topic": "x", "value": "ok"}\n{not json\n')
    out = await asyncio.to_thread(openforge, kafka_settings, "topics", "replay", "--from-file", str(bad),
                                  "--to-topic", topics[REWARDS].name, check=False)
    assert out.returncode != 0 and "bad.jsonl:2" in out.stderr


async def test_lag_shows_each_group_per_partition(kafka_settings, topics: TopicRegistry) -> None:
    async with EventProducer(kafka_settings) as producer:
        for i in range(8):
            await producer.send(REWARDS, reward(f"r-{i}", float(i)), )
        await producer.flush()
    seen: list[Received] = []

    async def handle(received: Received) -> None:
        seen.append(received)

    group = f"{kafka_settings.topic_prefix}lagger"
    consumer = EventConsumer([REWARDS], handle, group_id=group, kafka=kafka_settings,
                             settings=ConsumerSettings(commit_interval_s=0.1))
    async with consumer:
        while len(seen) < 8:
            await asyncio.sleep(0.05)
    async with EventProducer(kafka_settings) as producer:
        for i in range(3):
            await producer.send(REWARDS, reward("r-0", float(i)))
        await producer.flush()
    out = (await asyncio.to_thread(openforge, kafka_settings, "topics", "lag", "--group", group)).stdout
    assert f"{group}: total lag 3" in out
    assert out.count(topics[REWARDS].name) == 2  # one row per partition


async def _dead_letters(kafka_settings: KafkaSettings, topics: TopicRegistry
                        ) -> tuple[tuple[bytes | None, bytes, list[tuple[str, bytes]]], RewardV1]:
    """The dead letters OpenForge writes, each kind once: what the shipper and a consumer set aside.

    Returns the call record the shipper's letter holds (key, value, headers) and the reward a
    consumer's failing handler dead-lettered.
    """
    call = model_call(rollout_id="r-redrive")
    key, value, headers = encode_record(topics[CALLS], call)
    refused = _refused_letter(topics, call)
    # A record over the dead-letter topic's own limit is kept cut short (the shipper's 32 MiB).
    short = DeadLetterV1(topic=topics[CALLS].name, partition=0, offset=8, key=key, value=value[:100],
                         value_truncated=True, error_type=DeadLetterErrorType.REFUSED_BY_BROKER, reason="too large",
                         consumer_group="openforge-proxy-shipper")
    cut_key, cut_value, cut_headers = encode_record(topics[DEAD_LETTERS], short)
    cut = (topics[DEAD_LETTERS].name, cut_key, cut_value, tuple(cut_headers))
    raw = dead_letter(topics, (RAW_CALLS, key, b"{}", ()), 9, DeadLetterErrorType.INVALID_EVENT,
                      "call capture made no valid event", ValueError("invalid"))
    async with EventProducer(kafka_settings) as producer:
        for letter_topic, letter_key, letter_value, letter_headers in (refused, cut, raw):
            await producer.send_raw(letter_topic, letter_value, key=letter_key, headers=letter_headers)
        await producer.send_raw(topics[DEAD_LETTERS].name, b"not a letter", key=b"x")
        lost = reward("r-redrive", 0.5)
        await producer.publish(REWARDS, lost)
        await producer.flush()

    async def failing(received: Received) -> None:
        raise RuntimeError("a bug, fixed since")

    consumer = EventConsumer([REWARDS], failing, group_id=f"{kafka_settings.topic_prefix}buggy", kafka=kafka_settings,
                             settings=ConsumerSettings(commit_interval_s=0.1, retry_backoff_s=0.01))
    async with consumer:
        for _ in range(300):
            if await _count(kafka_settings, topics, DEAD_LETTERS) >= 5:
                break
            await asyncio.sleep(0.1)
    assert await _count(kafka_settings, topics, DEAD_LETTERS) == 5, "the consumer did not dead-letter the reward"
    return (key, value, list(headers)), lost


def _refused_letter(topics: TopicRegistry, call: ModelCallV1) -> tuple[str, bytes | None, bytes, tuple[tuple[str, bytes], ...]]:
    """The letter the shipper writes for a call Kafka refused (its topic's size limit lowered)."""
    key, value, headers = encode_record(topics[CALLS], call)
    return dead_letter(topics, (topics[CALLS].name, key, value, tuple(headers)), 7,
                       DeadLetterErrorType.REFUSED_BY_BROKER, "Kafka refused the record: MessageSizeTooLargeError()",
                       ValueError("too large"))


def _next_runs(out: str) -> list[list[str]]:
    """The per-partition arguments a run prints for the next one."""
    return [line.split(": ", 1)[1].split() for line in out.splitlines() if line.startswith("next run, partition ")]


async def test_redrive_sends_dead_lettered_records_back_byte_for_byte_and_counts_what_it_skips(
        kafka_settings, topics: TopicRegistry) -> None:
    (key, value, headers), lost = await _dead_letters(kafka_settings, topics)

    dry = (await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--dry-run")).stdout
    assert f"would send 1 to {topics[CALLS].name}" in dry and f"would send 1 to {topics[REWARDS].name}" in dry
    assert "skipped 1: value cut short" in dry and "skipped 1: error type invalid_event" in dry
    assert "skipped 1: not a dead letter" in dry
    assert await _count(kafka_settings, topics, CALLS) == 0  # a dry run sends nothing
    assert await _count(kafka_settings, topics, REWARDS) == 1

    only = (await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--error-type",
                                    "refused_by_broker")).stdout
    assert f"sent 1 to {topics[CALLS].name}" in only and "skipped 1: error type handler_error" in only
    assert await _count(kafka_settings, topics, CALLS) == 1
    records = await _read(kafka_settings, topics[CALLS].name, 1)
    assert [(r.key, r.value, list(r.headers)) for r in records] == [(key, value, headers)]

    rest = (await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--topic", "rewards")).stdout
    assert f"sent 1 to {topics[REWARDS].name}" in rest and "skipped 2: another topic" in rest
    again = await _read(kafka_settings, topics[REWARDS].name, 2)
    assert [decode(list(r.headers), r.value) for r in again] == [lost, lost]  # the original, and the re-driven copy

    # Named, an invalid event's letter is looked at: a raw journal record is never sent.
    raw = (await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--error-type", "invalid_event",
                                   "--dry-run")).stdout
    assert "skipped 1: a raw journal record" in raw and "would send" not in raw

    # Each partition's printed start takes the next run past what was read: only a new letter goes.
    next_runs = _next_runs(rest)
    assert next_runs and all(args[0] == "--partition" and args[2] == "--from-offset" for args in next_runs)
    async with EventProducer(kafka_settings) as producer:
        letter_topic, letter_key, letter_value, letter_headers = _refused_letter(
            topics, model_call(rollout_id="r-later", seed=1))
        await producer.send_raw(letter_topic, letter_value, key=letter_key, headers=letter_headers)
        await producer.flush()
    sent = 0
    for args in next_runs:
        out = (await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", *args)).stdout
        sent += sum(int(line.split()[1]) for line in out.splitlines() if line.startswith("sent "))
    assert sent == 1 and await _count(kafka_settings, topics, CALLS) == 2


async def test_redrive_names_the_records_a_topic_will_not_take_and_sends_the_rest(
        kafka_settings, topics: TopicRegistry) -> None:
    await _dead_letters(kafka_settings, topics)
    # A model call does not belong on the rewards topic: it is refused; the reward goes.
    out = await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--to-topic", "rewards",
                                  check=False)
    assert out.returncode == 1, out
    assert "WrongTopicError: model_call events do not go to" in out.stderr, out.stderr
    assert "1 record not taken (above); the rest went on" in out.stderr, out.stderr
    assert f"sent 1 to {topics[REWARDS].name}" in out.stdout
    # The next run of the refused letter's partition starts at it, not past it.
    refused = next(line for line in out.stderr.splitlines() if line.startswith("not taken: dead letter "))
    partition, offset = refused.removeprefix("not taken: dead letter ").split(":", 1)[0].split("@")
    assert ["--partition", partition, "--from-offset", offset] in _next_runs(out.stdout), out.stdout

    dry = await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--to-topic", "rewards",
                                  "--dry-run", check=False)
    assert dry.returncode == 1 and "1 record would be refused" in dry.stderr, dry
    missing = await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--to-topic",
                                      f"{kafka_settings.topic_prefix}no-such-topic", check=False)
    assert missing.returncode == 1 and "no-such-topic does not exist" in missing.stderr, missing
    assert await _count(kafka_settings, topics, REWARDS) == 2  # the original and one re-driven copy
    bad = await asyncio.to_thread(openforge, kafka_settings, "topics", "redrive", "--error-type", "bogus",
                                  check=False)
    assert bad.returncode == 2 and "bogus" in bad.stderr


async def _count(kafka_settings: KafkaSettings, topics: TopicRegistry, spec: TopicSpec) -> int:
    async with KafkaAdmin(kafka_settings, topics) as admin:
        return sum((await admin.end_offsets(await admin.partitions(topics[spec].name))).values())


async def _read(kafka_settings: KafkaSettings, topic: str, expect: int) -> list[ConsumerRecord[bytes, bytes]]:
    consumer = AIOKafkaConsumer(topic, **kafka_settings.client_kwargs(), auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while len(records) < expect and asyncio.get_running_loop().time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return sorted(records, key=lambda r: (r.partition, r.offset))


async def test_tail_and_replay_to_a_file_show_calls_whole(kafka_settings, topics: TopicRegistry,
                                                          tmp_path: Path) -> None:
    from assembler_factories import conversation
    from linear_calls import linked

    whole = conversation("r-linear", 3, seed=5)
    stored = [whole[0], linked(whole[1], whole[0]), linked(whole[2], whole[1])]
    async with EventProducer(kafka_settings) as producer:
        for event in stored:
            await producer.send(CALLS, event)
        await producer.flush()
    out = (await asyncio.to_thread(openforge, kafka_settings, "topics", "tail", "calls", "--full")).stdout
    prompts = [orjson.loads(part[part.index("{"):part.index("\n}") + 2])["prompt_token_ids"]
               for part in out.split("model_call v1")[1:]]
    assert prompts == [list(c.prompt_token_ids) for c in whole]
    assert '"prompt_prefix": null' in out and "not rebuilt" not in out
    dump = tmp_path / "calls.jsonl"
    await asyncio.to_thread(openforge, kafka_settings, "topics", "replay", "--from-topic", "calls",
                            "--to-file", str(dump))
    docs = [orjson.loads(x) for x in dump.read_bytes().splitlines()]
    events = [decode([(k, v.encode()) for k, v in d["headers"]], d["value"].encode()) for d in docs]
    assert [(e.call_id, list(e.prompt_token_ids), e.prompt_prefix) for e in events] == [
        (c.call_id, list(c.prompt_token_ids), None) for c in whole]
