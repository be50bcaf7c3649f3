"""Pacing counts a rollout that ended until its trajectory arrives (driven clock, no broker)."""

from __future__ import annotations

from consumers.rollouts.pacing import Pace
from stream import KafkaSettings, TopicRegistry


async def test_an_ended_rollout_counts_until_its_tasks_trajectory_arrives_or_the_timeout() -> None:
    now = [0.0]
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic_prefix="unit.")
    pace = Pace(kafka, TopicRegistry.from_settings(kafka), transit_timeout_s=100.0, clock=lambda: now[0])
    try:
        for index in range(3):
            pace.launched("t1", f"r-t1-{index}")
        pace.launched("t2", "r-t2-0")
        running = {"r-t1-0", "r-t1-1", "r-t1-2", "r-t2-0"}
        assert pace.in_transit(running) == 0  # running rollouts are counted as running, not here
        assert pace.in_transit(running - {"r-t1-0", "r-t1-1"}) == 2
        pace.arrived("t1")  # one of them reached the trajectories topic
        pace.arrived("other")  # a task this launcher did not start
        assert pace.in_transit(running - {"r-t1-0", "r-t1-1"}) == 1
        now[0] = 50.0
        assert pace.in_transit(set()) == 3  # t1's last and t2's rollout ended now; t1-1 still waits
        now[0] = 120.0  # t1-1 ended 120 s ago: its trajectory is taken as lost, the others still count
        assert pace.in_transit(set()) == 2
        pace.arrived("t1")
        pace.arrived("t1")
        pace.arrived("t2")
        assert pace.in_transit(set()) == 0
        pace.launched("t1", "r-t1-0")  # the task is forgotten once all its trajectories arrived
        assert pace.in_transit(set()) == 1
    finally:
        await pace.stop()
