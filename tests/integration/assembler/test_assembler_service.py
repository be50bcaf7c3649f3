"""The assembler against the real broker: joins, bad input, late events, and crashes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from assembled import assemble, counted_in_groups
from assembler_factories import conversation, lifecycle, reward
from meters import counter_values, memory_reader

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from consumers.assembler.state import trajectory_id_for
from schemas import DeadLetterV1, TrajectoryV1, decode, encode
from schemas.failures import FailureReason
from schemas.rollout.v1 import RolloutPhase, RolloutReason
from schemas.trajectory.v1 import FinalizeReason
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CALLS, DEAD_LETTERS, REWARDS, ROLLOUTS, TRAJECTORIES, TopicRegistry

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[3]


async def read_topic(bootstrap: str, topic: str, *, expect: int, timeout_s: float = 30.0,
                     settle_s: float = 0.5) -> list:
    """Every committed record of ``topic`` once ``expect`` arrived (or the timeout passed)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, isolation_level="read_committed",
                                max_partition_fetch_bytes=32 * 1024 * 1024)
    await consumer.start()
    events: list = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(events) < expect and loop.time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                events.extend(decode(r.headers, r.value) for r in batch)
        settle = loop.time() + settle_s
        while loop.time() < settle:
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                events.extend(decode(r.headers, r.value) for r in batch)
    finally:
        await consumer.stop()
    return events


def rollout_events(rollout_id: str, *, seed: int, task_id: str = "task-1", index: int = 0) -> list:
    return [
        lifecycle(rollout_id, RolloutPhase.SCHEDULED, task_id=task_id, group_index=index),
        *conversation(rollout_id, 3, seed=seed),
        lifecycle(rollout_id, RolloutPhase.SUCCEEDED, task_id=task_id, group_index=index),
        reward(rollout_id, float(seed % 2)),
    ]


async def publish(producer: EventProducer, events: list) -> None:
    topic_of = {"model_call": CALLS, "rollout": ROLLOUTS, "reward": REWARDS}
    for event in events:
        await producer.send(topic_of[type(event).SCHEMA], event)
    await producer.flush()


def fast_settings(kafka_settings: KafkaSettings, **overrides: object) -> AssemblerSettings:
    values: dict[str, object] = {
        "group_id": f"{kafka_settings.topic_prefix}assembler", "grace_s": 0.2, "commit_interval_s": 0.2,
        "poll_timeout_ms": 100, "session_timeout_ms": 6000, "reward_timeout_s": 1.5,
    }
    values.update(overrides)
    return AssemblerSettings.model_validate(values)


async def test_assembler_joins_out_of_order_duplicate_and_failed_rollouts(
    kafka_settings: KafkaSettings, topics: TopicRegistry
) -> None:
    complete = rollout_events("r-ok", seed=1)
    # Reward and terminal event first, calls after them, one call sent twice.
    reordered = [complete[-1], complete[-2], complete[0], *complete[1:4], complete[2]]
    failed = [lifecycle("r-failed", RolloutPhase.FAILED, reason=RolloutReason.OOM_KILLED,
                        infrastructure_failure=True, group_index=1)]
    no_reward = [lifecycle("r-quiet", RolloutPhase.SUCCEEDED, group_index=2), *conversation("r-quiet", 1)]
    async with EventProducer(kafka_settings) as producer:
        await publish(producer, reordered + failed + no_reward)
        # Bad input: bytes that are no event at all, on the calls topic.
        await producer.send_raw(topics[CALLS].name, b"not json", key=b"r-ok",
                                headers=[("schema", b"model_call"), ("schema-version", b"1")])
        # A valid event on the wrong topic: a reward written to the calls topic.
        value, headers = encode(reward("r-ok", 0.0))
        await producer.send_raw(topics[CALLS].name, value, key=b"r-ok", headers=headers)
        await producer.flush()
        async with AssemblerService(fast_settings(kafka_settings), kafka_settings) as service:
            trajectories = await read_topic(kafka_settings.bootstrap_servers, topics[TRAJECTORIES].name,
                                            expect=3, settle_s=0.3)
            by_rollout = {t.rollout_id: t for t in trajectories}
            assert sorted(by_rollout) == ["r-failed", "r-ok", "r-quiet"]
            ok = by_rollout["r-ok"]
            assert isinstance(ok, TrajectoryV1)
            assert ok.finalize_reason is FinalizeReason.COMPLETED and ok.reward == 1.0
            assert ok.trajectory_id == trajectory_id_for("r-ok")
            assert [len(s.call_ids) for s in ok.samples] == [3]
            assert ok.merge_stats.calls == 3 and ok.merge_stats.merged == 2
            assert by_rollout["r-failed"].finalize_reason is FinalizeReason.NO_REWARD_EXPECTED
            assert by_rollout["r-failed"].infrastructure_failure
            assert by_rollout["r-failed"].failure_reason is FailureReason.OOM_KILLED
            assert by_rollout["r-quiet"].finalize_reason is FinalizeReason.REWARD_TIMEOUT
            assert (by_rollout["r-quiet"].failure_reason, by_rollout["r-quiet"].infrastructure_failure) == (
                FailureReason.REWARD_TIMEOUT, True)
            assert (ok.failure_reason, ok.infrastructure_failure) == (None, False)
            assert service.stats.duplicates == 1

            # A call for a finalized rollout is late: dead-lettered with the reason, no new trajectory.
            await publish(producer, conversation("r-ok", 1, seed=99))
            letters = await read_topic(kafka_settings.bootstrap_servers, topics[DEAD_LETTERS].name,
                                       expect=3, settle_s=0.3)
            assert all(isinstance(letter, DeadLetterV1) for letter in letters)
            reasons = [letter.reason for letter in letters]
            assert len(reasons) == 3, reasons
            assert any("not valid UTF-8 JSON" in r for r in reasons)
            assert any("'reward' events do not belong on" in r for r in reasons)
            assert any(r.startswith("late event: rollout r-ok") for r in reasons)
            assert all(letter.value is not None for letter in letters)  # the original bytes are kept
            assert service.stats.late == 1
    again = await read_topic(kafka_settings.bootstrap_servers, topics[TRAJECTORIES].name, expect=4, timeout_s=1.0)
    assert len(again) == 3


async def test_a_clean_restart_resumes_open_rollouts_without_republishing(
    kafka_settings: KafkaSettings, topics: TopicRegistry
) -> None:
    settings = fast_settings(kafka_settings)
    first, second = rollout_events("r-1", seed=1), rollout_events("r-2", seed=2)
    async with EventProducer(kafka_settings) as producer:
        await publish(producer, first + second[:3])  # r-2 is still open when the service stops
        async with AssemblerService(settings, kafka_settings):
            assert len(await read_topic(kafka_settings.bootstrap_servers, topics[TRAJECTORIES].name,
                                        expect=1, settle_s=0.0)) == 1
            await asyncio.sleep(0.5)
        await publish(producer, second[3:])
        async with AssemblerService(settings, kafka_settings) as service:
            trajectories = await read_topic(kafka_settings.bootstrap_servers, topics[TRAJECTORIES].name,
                                            expect=2, settle_s=1.0)
            assert service.stats.replayed > 0  # r-1 was re-read (closed_retention_s) and recognised
    assert sorted(t.rollout_id for t in trajectories) == ["r-1", "r-2"]
    [r2] = [t for t in trajectories if t.rollout_id == "r-2"]
    assert len(r2.samples[0].call_ids) == 3  # calls from before and after the restart joined


async def test_open_state_evicted_or_timed_out_is_counted_per_reason_as_infrastructure(
    kafka_settings: KafkaSettings, topics: TopicRegistry
) -> None:
    memory_reader()
    before = counter_values("openforge.assembler.failures")
    async with EventProducer(kafka_settings) as producer:
        await publish(producer, [*conversation("r-a", 2, seed=1), *conversation("r-b", 2, seed=2)])  # neither ends
    # Room for one open rollout: when the second arrives the older is evicted; the other times out.
    trajectories = await assemble(kafka_settings, topics, ["r-a", "r-b"], max_open_rollouts=1)
    verdicts = sorted((t.failure_reason, t.infrastructure_failure) for t in trajectories.values())
    assert verdicts == [(FailureReason.ASSEMBLER_EVICTED, True), (FailureReason.LIFECYCLE_TIMEOUT, True)]
    assert {t.finalize_reason for t in trajectories.values()} == {FinalizeReason.EVICTED,
                                                                  FinalizeReason.LIFECYCLE_TIMEOUT}
    assert counted_in_groups(trajectories.values()) == {"r-a": set(), "r-b": set()}
    after = counter_values("openforge.assembler.failures")
    for reason in (FailureReason.ASSEMBLER_EVICTED, FailureReason.LIFECYCLE_TIMEOUT):
        labels = (("infrastructure", "true"), ("reason", reason.value))
        assert after.get(labels, 0) - before.get(labels, 0) == 1, after


def start_assembler(kafka_settings: KafkaSettings, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
        "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
        "OPENFORGE_KAFKA_PARTITIONS": str(kafka_settings.partitions),
        "OPENFORGE_KAFKA_LINGER_MS": "0",
        "OPENFORGE_ASSEMBLER_GROUP_ID": f"{kafka_settings.topic_prefix}assembler",
        "OPENFORGE_ASSEMBLER_GRACE_S": "0.1",
        "OPENFORGE_ASSEMBLER_COMMIT_INTERVAL_S": "0.2",
        "OPENFORGE_ASSEMBLER_POLL_TIMEOUT_MS": "100",
        "OPENFORGE_ASSEMBLER_SESSION_TIMEOUT_MS": "6000",
        "OPENFORGE_ASSEMBLER_MAX_POLL_RECORDS": "7",  # many small transactions: more places to die in
    }
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "openforge", "assembler"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def test_killing_the_assembler_mid_stream_loses_and_duplicates_no_trajectory(
    kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path
) -> None:
    rollouts = [f"r-{i:02d}" for i in range(24)]
    events = {r: rollout_events(r, seed=i, task_id=f"task-{i // 4}", index=i % 4) for i, r in enumerate(rollouts)}
    # Interleave rollouts so that many are open at any moment and watermarks lag behind positions.
    waves = [[events[r][k] for r in rollouts[start:start + 8] for k in range(len(events[r]))
              if k % 2 == part] for start in range(0, 24, 8) for part in (0, 1)]
    log = tmp_path / "assembler.log"
    trajectories_topic = topics[TRAJECTORIES].name
    process = start_assembler(kafka_settings, log)
    try:
        async with EventProducer(kafka_settings) as producer:
            await publish(producer, waves[0] + waves[1])
            seen = await read_topic(kafka_settings.bootstrap_servers, trajectories_topic, expect=4,
                                    timeout_s=60, settle_s=0.0)
            assert len(seen) >= 4, log.read_text()
            await publish(producer, waves[2])
            await asyncio.sleep(0.3)  # mid-stream: some of wave 2 handled, transactions in flight
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            await publish(producer, waves[3])
            process = start_assembler(kafka_settings, log)
            await asyncio.sleep(8.0)  # the dead member's session expires; the new one rebuilds
            process.send_signal(signal.SIGKILL)  # and die again, possibly during the rebuild
            process.wait(timeout=10)
            await publish(producer, waves[4] + waves[5])
            process = start_assembler(kafka_settings, log)
            trajectories = await read_topic(kafka_settings.bootstrap_servers, trajectories_topic,
                                            expect=len(rollouts), timeout_s=60, settle_s=3.0)
    finally:
        process.terminate()
        process.wait(timeout=30)
    counts = Counter(t.rollout_id for t in trajectories)
    text = log.read_text()
    assert sorted(counts) == rollouts, text
    assert [r for r, n in counts.items() if n > 1] == [], text
    assert all(t.finalize_reason is FinalizeReason.COMPLETED for t in trajectories)
    assert all(len(t.samples) == 1 and len(t.samples[0].call_ids) == 3 for t in trajectories)
    assert "already published" in text  # a restart did re-read published rollouts and skip them


async def test_the_default_group_and_transactional_id_carry_the_topic_prefix(
    kafka_settings: KafkaSettings, topics: TopicRegistry
) -> None:
    """Two experiments under different prefixes never share a consumer group or fence each other."""
    settings = fast_settings(kafka_settings, group_id=AssemblerSettings().group_id)
    async with EventProducer(kafka_settings) as producer:
        await publish(producer, rollout_events("r-scoped", seed=1))
        async with AssemblerService(settings, kafka_settings) as service:
            assert await read_topic(kafka_settings.bootstrap_servers, topics[TRAJECTORIES].name, expect=1)
            assert service.group_id == f"{kafka_settings.topic_prefix}openforge-assembler"
            assert service._producer._transactional_id == f"{kafka_settings.topic_prefix}openforge-assembler-0"
            admin = AIOKafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap_servers)
            await admin.start()
            try:
                groups = {group[0] for group in await admin.list_consumer_groups()}
            finally:
                await admin.close()
    assert service.group_id in groups
