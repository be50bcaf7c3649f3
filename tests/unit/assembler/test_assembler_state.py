"""The join state: duplicates, out-of-order and late events, finalize rules, watermarks."""

from __future__ import annotations

import pytest
from aiokafka.structs import TopicPartition
from assembled import counted_in_groups
from assembler_factories import call, conversation, lifecycle, reward

from consumers.assembler.state import FinalizePolicy, Outcome, RolloutTable, trajectory_id_for
from schemas.call.v1 import CallStatus
from schemas.failures import FailureReason
from schemas.rollout.v1 import RolloutPhase, RolloutReason
from schemas.trajectory.v1 import FinalizeReason

CALLS = TopicPartition("calls", 0)
ROLLOUTS = TopicPartition("rollouts", 0)
REWARDS = TopicPartition("rewards", 0)
POLICY = FinalizePolicy(grace_s=1.0, reward_timeout_s=10.0, lifecycle_timeout_s=100.0, closed_retention_s=5.0)


def feed_complete_rollout(table: RolloutTable, rollout_id: str, now: float, offset: int = 0) -> None:
    for i, event in enumerate(conversation(rollout_id, 3)):
        assert table.add(event, CALLS, offset + i, now) is Outcome.ACCEPTED
    table.add(lifecycle(rollout_id, RolloutPhase.SCHEDULED), ROLLOUTS, offset, now)
    table.add(lifecycle(rollout_id, RolloutPhase.SUCCEEDED), ROLLOUTS, offset + 1, now)
    table.add(reward(rollout_id, 0.5), REWARDS, offset, now)


def test_terminal_event_plus_reward_finalizes_after_the_grace_period() -> None:
    table = RolloutTable(POLICY)
    feed_complete_rollout(table, "r-1", now=0.0)
    assert table.due(0.5) == []
    [done] = table.due(1.0)
    trajectory = done.trajectory
    assert trajectory.finalize_reason is FinalizeReason.COMPLETED
    assert (trajectory.reward, trajectory.task_id, trajectory.group_size, trajectory.harness) == (0.5, "task-1", 4, "codex")
    assert trajectory.phase is RolloutPhase.SUCCEEDED
    assert trajectory.trajectory_id == trajectory_id_for("r-1") != trajectory_id_for("r-2")
    [sample] = trajectory.samples
    assert len(sample.call_ids) == 3 and trajectory.merge_stats.merged == 2
    assert table.open_count == 0


def test_reward_before_lifecycle_and_calls_after_the_terminal_event_are_joined() -> None:
    table = RolloutTable(POLICY)
    calls = conversation("r-1", 3)
    assert table.add(reward("r-1"), REWARDS, 0, 0.0) is Outcome.ACCEPTED
    table.add(lifecycle("r-1", RolloutPhase.SUCCEEDED), ROLLOUTS, 0, 0.1)
    table.add(calls[0], CALLS, 0, 0.2)
    table.add(calls[1], CALLS, 1, 0.3)
    assert table.due(1.0) == []  # the grace period restarts with each event
    table.add(calls[2], CALLS, 2, 1.2)  # spooled by the proxy, arrives after the terminal event
    [done] = table.due(2.2)
    assert done.trajectory.samples[0].call_ids == [c.call_id for c in calls]


def test_duplicate_events_are_dropped_by_event_id_and_a_second_reward_is_ignored() -> None:
    table = RolloutTable(POLICY)
    first = call([1], [2], call_id="a")
    assert table.add(first, CALLS, 0, 0.0) is Outcome.ACCEPTED
    assert table.add(first, CALLS, 1, 0.0) is Outcome.DUPLICATE
    assert table.add(reward("r-1", 1.0), REWARDS, 0, 0.0) is Outcome.ACCEPTED
    assert table.add(reward("r-1", 0.0), REWARDS, 1, 0.0) is Outcome.DUPLICATE
    table.add(lifecycle("r-1", RolloutPhase.SUCCEEDED), ROLLOUTS, 0, 0.0)
    [done] = table.due(5.0)
    assert done.trajectory.reward == 1.0
    assert done.trajectory.merge_stats.calls == 1


def test_events_after_finalization_are_late_or_duplicate_and_never_reopen_the_rollout() -> None:
    table = RolloutTable(POLICY)
    feed_complete_rollout(table, "r-1", 0.0)
    assert len(table.due(2.0)) == 1
    straggler = call([1], [2], call_id="too-late", rollout_id="r-1")
    assert table.add(straggler, CALLS, 10, 3.0) is Outcome.LATE
    assert table.open_count == 0
    assert table.due(10.0) == []  # closed state expires into the remembered ids
    assert table.add(straggler, CALLS, 11, 11.0) is Outcome.LATE
    assert table.open_count == 0


def test_rollouts_published_before_a_restart_are_replayed_not_reopened() -> None:
    table = RolloutTable(POLICY)
    table.remember_published(["r-1"])
    assert table.add(call([1], [2], call_id="a", rollout_id="r-1"), CALLS, 0, 0.0) is Outcome.REPLAYED
    assert table.open_count == 0
    assert table.watermark(CALLS, 1) == 1


def test_failed_rollouts_finalize_without_waiting_for_a_reward() -> None:
    table = RolloutTable(POLICY)
    table.add(lifecycle("r-1", RolloutPhase.FAILED, reason=RolloutReason.EVICTED, infrastructure_failure=True),
              ROLLOUTS, 0, 0.0)
    [done] = table.due(1.0)
    assert done.trajectory.finalize_reason is FinalizeReason.NO_REWARD_EXPECTED
    assert done.trajectory.infrastructure_failure and done.trajectory.samples == []
    assert done.trajectory.failure_reason is FailureReason.EVICTED


@pytest.mark.parametrize(("events", "wait", "reason", "failure"), [
    ("succeeded", 10.0, FinalizeReason.REWARD_TIMEOUT, FailureReason.REWARD_TIMEOUT),
    ("calls-only", 100.0, FinalizeReason.LIFECYCLE_TIMEOUT, FailureReason.LIFECYCLE_TIMEOUT),
])
def test_timeouts_finalize_with_the_reason_that_applies(events: str, wait: float, reason: FinalizeReason,
                                                        failure: FailureReason) -> None:
    table = RolloutTable(POLICY)
    table.add(call([1], [2], call_id="a"), CALLS, 0, 0.0)
    if events == "succeeded":
        table.add(lifecycle("r-1", RolloutPhase.SUCCEEDED), ROLLOUTS, 0, 0.0)
    assert table.due(wait - 0.01) == []
    [done] = table.due(wait)
    assert done.trajectory.finalize_reason is reason
    assert done.trajectory.reward is None
    # Neither is the policy's doing: both stay out of the group's statistics.
    assert (done.trajectory.failure_reason, done.trajectory.infrastructure_failure) == (failure, True)
    if events == "calls-only":
        assert done.trajectory.task_id == "r-1"  # no event named a task; the rollout stands alone


def test_the_oldest_open_rollouts_are_evicted_past_the_memory_bound() -> None:
    table = RolloutTable(FinalizePolicy(max_open_rollouts=2))
    for index in range(3):
        table.add(call([1], [2], call_id=f"c{index}", rollout_id=f"r-{index}"), CALLS, index, float(index))
    [done] = table.due(3.0)
    assert (done.trajectory.rollout_id, done.trajectory.finalize_reason) == ("r-0", FinalizeReason.EVICTED)
    assert (done.trajectory.failure_reason, done.trajectory.infrastructure_failure) == (
        FailureReason.ASSEMBLER_EVICTED, True)
    assert table.open_count == 2


def test_the_verdict_weighs_calls_reward_and_lifecycle_together() -> None:
    table = RolloutTable(POLICY)
    feed_complete_rollout(table, "scored", 0.0)
    # The harness got a 503 on its last call and exited 1: the engine's failure, not the policy's.
    table.add(call([1], [2], call_id="u0", rollout_id="upstream", at=0), CALLS, 0, 0.0)
    table.add(call([1, 2, 3], [], call_id="u1", rollout_id="upstream", status=CallStatus.UPSTREAM_ERROR, at=1)
              .model_copy(update={"upstream_status_code": 503}), CALLS, 1, 0.0)
    table.add(lifecycle("upstream", RolloutPhase.FAILED, reason=RolloutReason.EXIT_CODE, group_index=1),
              ROLLOUTS, 0, 0.0)
    # A harness that failed on its own (its context was too long, 400): the policy's.
    table.add(call([1], [], call_id="p0", rollout_id="policy", status=CallStatus.UPSTREAM_ERROR)
              .model_copy(update={"upstream_status_code": 400}), CALLS, 2, 0.0)
    table.add(lifecycle("policy", RolloutPhase.FAILED, reason=RolloutReason.EXIT_CODE, group_index=2),
              ROLLOUTS, 1, 0.0)
    # An old watcher said a harness OOM was the policy's; the taxonomy decides, not the flag.
    table.add(lifecycle("oom", RolloutPhase.FAILED, reason=RolloutReason.OOM_KILLED, group_index=3), ROLLOUTS, 2, 0.0)
    done = {d.trajectory.rollout_id: d.trajectory for d in table.due(2.0)}
    verdicts = {r: (t.failure_reason, t.infrastructure_failure) for r, t in done.items()}
    assert verdicts == {
        "scored": (None, False),
        "upstream": (FailureReason.UPSTREAM_FAILED, True),
        "policy": (FailureReason.EXIT_CODE, False),
        "oom": (FailureReason.OOM_KILLED, True),
    }
    assert counted_in_groups(done.values()) == {"task-1": {"scored", "policy"}}


def test_watermark_is_held_by_open_and_recently_closed_rollouts() -> None:
    table = RolloutTable(POLICY)
    table.add(call([1], [2], call_id="a", rollout_id="r-old"), CALLS, 3, 0.0)
    feed_complete_rollout(table, "r-new", 0.0, offset=5)
    assert table.watermark(CALLS, 20) == 3
    assert table.watermark(TopicPartition("calls", 1), 7) == 7
    table.add(lifecycle("r-old", RolloutPhase.CANCELLED), ROLLOUTS, 9, 0.0)
    assert {d.trajectory.rollout_id for d in table.due(1.5)} == {"r-old", "r-new"}
    assert table.watermark(CALLS, 20) == 3  # closed, but a restart must still re-read it whole
    table.due(10.0)
    assert table.watermark(CALLS, 20) == 20


def test_dropping_revoked_partitions_forgets_their_rollouts() -> None:
    table = RolloutTable(POLICY)
    table.add(call([1], [2], call_id="a", rollout_id="r-1"), CALLS, 0, 0.0)
    table.add(call([1], [2], call_id="b", rollout_id="r-2"), TopicPartition("calls", 1), 0, 0.0)
    assert table.drop_partitions([CALLS]) == 1
    assert table.open_count == 1


def test_events_of_other_kinds_are_refused_with_a_clear_error() -> None:
    from schemas import DeadLetterV1
    from schemas._errors import DeadLetterErrorType

    letter = DeadLetterV1(topic="t", partition=0, offset=0, error_type=DeadLetterErrorType.UNDECODABLE,
                          reason="x", consumer_group="g")
    with pytest.raises(TypeError, match="does not join DeadLetterV1"):
        RolloutTable().add(letter, CALLS, 0, 0.0)


def test_settings_come_from_the_assembler_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from consumers.assembler.settings import AssemblerSettings

    monkeypatch.setenv("OPENFORGE_ASSEMBLER_GRACE_S", "0.5")
    monkeypatch.setenv("OPENFORGE_ASSEMBLER_INSTANCE_ID", "3")
    settings = AssemblerSettings()
    assert settings.policy().grace_s == 0.5
    assert settings.transactional_id == "openforge-assembler-3"
    monkeypatch.setenv("OPENFORGE_ASSEMBLER_GRACE_S", "-1")
    with pytest.raises(ValueError, match="grace_s"):
        AssemblerSettings()
