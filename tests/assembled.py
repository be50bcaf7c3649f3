"""What the real assembler makes of a test's rollouts, and what the learner's grouping counts of it.

Shared by the backend tests (local processes, pod watcher) and the assembler's own: each runs its
rollouts on the real broker, then the real assembler over the same topics, so the failure taxonomy
is checked end to end on every backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from learner.grouping import GroupBuffer
from schemas import TrajectoryV1, decode
from stream import TRAJECTORIES, KafkaSettings, TopicRegistry


def assembler_settings(kafka: KafkaSettings, **overrides: object) -> AssemblerSettings:
    """Settings that finalize within seconds: a short grace period and short reward and lifecycle waits."""
    values: dict[str, object] = {
        "group_id": f"{kafka.topic_prefix}assembler", "grace_s": 0.2, "commit_interval_s": 0.2,
        "poll_timeout_ms": 100, "session_timeout_ms": 6000, "reward_timeout_s": 1.5, "lifecycle_timeout_s": 2.0,
    }
    values.update(overrides)
    return AssemblerSettings.model_validate(values)


async def assemble(kafka: KafkaSettings, topics: TopicRegistry, rollout_ids: Iterable[str], *,
                   timeout_s: float = 60.0, **overrides: object) -> dict[str, TrajectoryV1]:
    """Run the assembler until every rollout in ``rollout_ids`` has its trajectory; return them by rollout id.

    Raises:
        AssertionError: Some trajectories did not arrive within ``timeout_s``.
    """
    wanted = set(rollout_ids)
    found: dict[str, TrajectoryV1] = {}
    consumer = AIOKafkaConsumer(topics[TRAJECTORIES].name, bootstrap_servers=kafka.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                isolation_level="read_committed", max_partition_fetch_bytes=32 * 1024 * 1024)
    async with AssemblerService(assembler_settings(kafka, **overrides), kafka):
        await consumer.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not wanted <= set(found) and loop.time() < deadline:
                for batch in (await consumer.getmany(timeout_ms=300)).values():
                    for record in batch:
                        trajectory = decode(record.headers, record.value)
                        assert isinstance(trajectory, TrajectoryV1)
                        found[trajectory.rollout_id] = trajectory
        finally:
            await consumer.stop()
    missing = wanted - set(found)
    assert not missing, f"no trajectory within {timeout_s:g} s for {sorted(missing)}"
    return {rollout_id: found[rollout_id] for rollout_id in wanted}


def counted_in_groups(trajectories: Iterable[TrajectoryV1]) -> dict[str, set[str]]:
    """Per task, the rollouts the learner's grouping counts in the group's statistics."""
    buffer: GroupBuffer[None] = GroupBuffer(fallback_timeout_s=3600.0, clock=lambda: 0.0)
    groups = []
    for trajectory in trajectories:
        group, _ = buffer.add(trajectory, None)
        if group is not None:
            groups.append(group)
    groups.extend(buffer.expired_all())
    return {group.task_id: {t.rollout_id for t, _ in group.usable} for group in groups}
