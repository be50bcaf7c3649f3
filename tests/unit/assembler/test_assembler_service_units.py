"""Service pieces that need no broker: the oversized-trajectory fallback."""

from __future__ import annotations

import dataclasses

from aiokafka.structs import TopicPartition
from assembler_factories import conversation, lifecycle, reward

from consumers.assembler.service import encode_trajectory
from consumers.assembler.state import FinalizePolicy, RolloutTable
from schemas import decode
from schemas.rollout.v1 import RolloutPhase
from stream.topics import TRAJECTORIES, Topic, TopicRegistry


def test_a_trajectory_too_large_for_its_topic_is_published_without_samples() -> None:
    table = RolloutTable(FinalizePolicy(grace_s=0.0))
    tp = TopicPartition("calls", 0)
    for i, event in enumerate([*conversation("r-big", 4), lifecycle("r-big", RolloutPhase.SUCCEEDED),
                               reward("r-big")]):
        table.add(event, tp, i, 0.0)
    [item] = table.due(1.0)
    topic = TopicRegistry()[TRAJECTORIES]
    full = encode_trajectory(topic, item)[1]
    small = Topic(topic.name, topic.partitions, dataclasses.replace(topic.spec, max_message_bytes=len(full) - 1))
    _, value, headers = encode_trajectory(small, item)
    published = decode(headers, value)
    assert published.rollout_id == "r-big" and published.samples == []
    assert published.reward == item.trajectory.reward
    assert published.merge_stats == item.trajectory.merge_stats  # the counts still tell what happened
