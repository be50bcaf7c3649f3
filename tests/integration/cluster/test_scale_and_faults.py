"""Hundreds of rollouts through the real launcher and pod watcher on the simulated cluster.

The nodes are kwok's (simulated kubelets); scheduler, controller manager, API server and etcd are
real. Pods fail as on a real cluster (image pulls, OOM kills, evictions, a node going NotReady)
while the launcher, the watcher (twice) and the API server are restarted. ``bench/cluster.py``
runs the same scenario at 2,000 rollouts.
"""

from __future__ import annotations

from collections import Counter

import pytest
from cluster_scenario import infra_marking_errors, run_scenario
from simcluster import SimCluster

from schemas.rollout.v1 import RolloutPhase, RolloutReason
from stream import KafkaSettings

pytestmark = [pytest.mark.cluster, pytest.mark.kafka]


@pytest.mark.timeout(900)
async def test_300_rollouts_on_20_simulated_nodes_with_faults_and_restarts_end_once_each(
        sim_cluster: SimCluster, kafka_settings: KafkaSettings) -> None:
    result = await run_scenario(sim_cluster, kafka_settings, rollouts=300, group_size=4, max_in_flight=100,
                                finished_ttl_s=5.0, timeout_s=600.0, progress=print)
    print(result.summary())

    by_rollout = result.by_rollout()
    assert set(by_rollout) == result.rollouts, "events for rollouts nobody launched"
    for rollout_id, events in by_rollout.items():
        ids = {p: {e.event_id for e in events if e.phase is p} for p in RolloutPhase}
        # Exactly one scheduled and one terminal event. A record can repeat (the watcher's patch that notes
        # it failed while the API server restarted), but only with the same event_id, which consumers drop.
        assert len(ids[RolloutPhase.SCHEDULED]) == 1, (rollout_id, events)
        assert sum(len(ids[p]) for p in RolloutPhase if p.is_terminal) == 1, (rollout_id, events)
        assert len(ids[RolloutPhase.RUNNING]) <= 1, (rollout_id, events)

    assert infra_marking_errors(result) == []
    reasons = Counter(e.reason for e in result.terminal().values())
    # Every fault kwok injects was seen and judged: each one is the infrastructure's but exit codes.
    for reason in (RolloutReason.IMAGE_PULL, RolloutReason.OOM_KILLED, RolloutReason.EVICTED,
                   RolloutReason.NODE_LOST, RolloutReason.EXIT_CODE):
        assert reasons[reason] >= 1, (reason, reasons)
    assert reasons[None] >= len(result.rollouts) // 2  # most succeed

    assert (result.launcher_restarts, result.watcher_restarts, result.apiserver_restarts) == (1, 2, 1)
    # Finished pods went after their TTL, and the garbage collector took their Secrets with them.
    assert (result.pods_left, result.secrets_left) == (0, 0)
