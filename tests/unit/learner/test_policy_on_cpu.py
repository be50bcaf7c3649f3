"""Staleness, grouping, batching and offset bookkeeping: the learner's pure-Python policy."""

from __future__ import annotations

import pytest
from trajectories import trajectory

from learner.batching import plan_micro_batches
from learner.entropy import EntropyControl
from learner.grouping import GroupBuffer
from learner.positions import Position, PositionLedger
from learner.settings import LearnerSettings
from learner.staleness import StalenessPolicy, behaviour_version, parse_version
from schemas import TrajectoryV1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- staleness -------------------------------------------------------------------------------------

def test_staleness_is_newest_published_minus_oldest_version() -> None:
    policy = StalenessPolicy(max_staleness=2)
    t = trajectory("a", 0, version="3")
    assert policy.staleness(t, 5) == 2
    assert policy.staleness(t, 1) == 0  # newer than the learner (after a restart): fresh


def test_oldest_version_over_all_samples_counts() -> None:
    t = trajectory("a", 0, version="7", samples=2)
    second = t.samples[1].model_dump()
    second["weight_versions"] = [{"version": "4", "start": 0, "end": 8}, {"version": "7", "start": 8, "end": 16}]
    t = TrajectoryV1.model_validate({**t.model_dump(), "samples": [t.samples[0].model_dump(), second]})
    assert behaviour_version(t, 0) == 4


def test_tokens_beyond_the_bound_are_masked_the_rest_trains() -> None:
    t = trajectory("a", 0, version="7")
    sample = t.samples[0].model_dump()
    sample["weight_versions"] = [{"version": "4", "start": 0, "end": 8}, {"version": "7", "start": 8, "end": 16}]
    sample = TrajectoryV1.model_validate({**t.model_dump(), "samples": [sample]}).samples[0]
    trained = list(sample.loss_mask)
    fresh = StalenessPolicy(max_staleness=2).fresh(sample, newest=7)
    assert fresh.loss_mask == [0] * 8 + trained[8:]
    assert fresh.masked == sum(trained[:8]) and fresh.kept == sum(trained[8:])
    assert fresh.oldest_kept_age == 0
    everything = StalenessPolicy(max_staleness=3).fresh(sample, newest=7)
    assert everything.masked == 0 and everything.oldest_kept_age == 3 and everything.loss_mask == trained
    nothing = StalenessPolicy(max_staleness=0).fresh(sample, newest=9)
    assert nothing.kept == 0 and nothing.oldest_kept_age is None and not any(nothing.loss_mask)


def test_unversioned_and_unorderable_labels_count_as_the_configured_version() -> None:
    assert parse_version("12", 0) == 12
    assert parse_version("base-model", 0) == 0
    assert behaviour_version(trajectory("a", 0, version=None), unversioned_as=3) == 3
    assert behaviour_version(trajectory("a", 0, version="tiny"), unversioned_as=1) == 1
    sample = trajectory("a", 0, version="base").samples[0]
    assert StalenessPolicy(0).fresh(sample, 0).masked == 0
    assert StalenessPolicy(0).fresh(sample, 1).kept == 0
    unversioned = trajectory("a", 0, version=None).samples[0]
    assert StalenessPolicy(1, unversioned_as=2).fresh(unversioned, 3).masked == 0
    assert StalenessPolicy(1, unversioned_as=2).fresh(unversioned, 4).kept == 0


# -- grouping --------------------------------------------------------------------------------------

def test_group_completes_when_all_members_arrived() -> None:
    buf: GroupBuffer[int] = GroupBuffer(10, Clock())
    for i in range(3):
        assert buf.add(trajectory("t", i, 4), i) == (None, "added")
    group, ok = buf.add(trajectory("t", 3, 4), 3)
    assert ok == "added" and group is not None and len(group.members) == 4 and not group.timed_out
    assert len(buf) == 0


def test_stragglers_without_a_task_timeout_wait_the_fallback() -> None:
    clock = Clock()
    buf: GroupBuffer[int] = GroupBuffer(5.0, clock, grace_s=60.0)
    buf.add(trajectory("t", 0, 4), 0)
    buf.add(trajectory("t", 1, 4), 1)
    clock.now = 4.9
    assert buf.expired() == []
    clock.now = 5.0
    (group,) = buf.expired()
    assert group.timed_out and group.short and [p for _, p in group.members] == [0, 1]
    assert len(buf) == 0


def test_the_deadline_is_the_task_timeout_plus_grace_and_late_members_never_start_a_group() -> None:
    clock = Clock()
    buf: GroupBuffer[int] = GroupBuffer(5.0, clock, grace_s=30.0)
    member = lambda i: trajectory("t", i, 3).model_copy(update={"timeout_s": 600.0})  # noqa: E731
    buf.add(member(0), 0)
    clock.now = 400.0  # minutes apart, within the task's own timeout
    assert buf.add(member(1), 1) == (None, "added") and buf.expired() == []
    clock.now = 629.9
    assert buf.expired() == []
    clock.now = 630.0
    (group,) = buf.expired()
    assert group.short and len(group.members) == 2
    assert buf.add(member(2), 2) == (None, "late")  # its group is gone: it does not open a new one
    assert len(buf) == 0 and buf.late == 1


def test_infrastructure_failures_complete_the_group_but_not_its_statistics() -> None:
    buf: GroupBuffer[int] = GroupBuffer(10, Clock())
    buf.add(trajectory("t", 0, 3), 0)
    buf.add(trajectory("t", 1, 3, infrastructure_failure=True), 1)
    group, _ = buf.add(trajectory("t", 2, 3), 2)
    assert group is not None
    assert [p for _, p in group.usable] == [0, 2]
    assert [p for _, p in group.infrastructure_failures] == [1]


def test_a_repeated_group_index_is_refused() -> None:
    buf: GroupBuffer[int] = GroupBuffer(10, Clock())
    buf.add(trajectory("t", 0, 2), 0)
    assert buf.add(trajectory("t", 0, 2), 1) == (None, "duplicate")
    assert buf.duplicates == 1


def test_groups_without_size_wait_for_the_timeout() -> None:
    clock = Clock()
    buf: GroupBuffer[int] = GroupBuffer(1.0, clock)
    for i in range(5):
        assert buf.add(trajectory("t", i, None), i)[0] is None
    clock.now = 2
    assert len(buf.expired()[0].members) == 5


# -- batching --------------------------------------------------------------------------------------

def test_micro_batches_respect_the_token_budget() -> None:
    lengths = [10, 50, 20, 40, 30, 5]
    plan = plan_micro_batches(lengths, 80)
    assert sorted(i for batch in plan for i in batch) == list(range(6))
    for batch in plan:
        assert sum(lengths[i] for i in batch) <= 80  # packed: no padding to the longest row
    assert plan == [[5, 0, 2, 4], [3], [1]]  # shortest first


def test_a_row_longer_than_the_budget_trains_alone() -> None:
    assert plan_micro_batches([100, 3, 4], 16) == [[1, 2], [0]]


def test_bad_budget_or_empty_row_is_refused() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([1], 0)
    with pytest.raises(ValueError, match="at least one token"):
        plan_micro_batches([3, 0], 10)


# -- positions -------------------------------------------------------------------------------------

def test_watermark_stops_at_the_first_pending_record_and_remembers_finished_ones_above() -> None:
    ledger = PositionLedger()
    pos = [Position("tr", 0, o) for o in range(5)]
    for p in pos:
        ledger.read(p)
    for o in (0, 2, 4):
        ledger.finish(pos[o])
    assert ledger.watermarks() == {("tr", 0): 1}
    assert ledger.finished_above() == {("tr", 0): [2, 4]}
    resumed = PositionLedger.resume(ledger.watermarks(), ledger.finished_above())
    assert [resumed.already_finished(p) for p in pos[1:]] == [False, True, False, True]
    ledger.finish(pos[1])
    ledger.finish(pos[3])
    assert ledger.watermarks() == {("tr", 0): 5}
    assert ledger.finished_above() == {}


# -- settings --------------------------------------------------------------------------------------

def test_settings_refuse_half_configured_rejection_sampling() -> None:
    with pytest.raises(ValueError, match="rollout_rs and rollout_rs_threshold"):
        LearnerSettings(rollout_rs="token_k1")


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_LEARNER_MAX_STALENESS", "7")
    monkeypatch.setenv("OPENFORGE_LEARNER_ADVANTAGE_ESTIMATOR", "rloo")
    s = LearnerSettings()
    assert s.max_staleness == 7 and s.advantage_estimator == "rloo"


# -- adaptive entropy control ----------------------------------------------------------------------

def test_a_fixed_entropy_coefficient_stays_fixed() -> None:
    control = EntropyControl(0.01)
    assert [control.update(e) for e in (8.0, 0.1, 0.0)] == [0.01, 0.01, 0.01]
    assert control.active and not EntropyControl(0.0).active


def test_the_coefficient_rises_below_the_target_and_falls_above_it_within_bounds() -> None:
    control = EntropyControl(0.01, target=1.0, delta=0.005, max_coeff=0.02)
    assert control.active and EntropyControl(0.0, target=1.0).active
    assert control.update(3.0) == pytest.approx(0.005)  # above the target: less bonus
    assert control.update(3.0) == 0.0
    assert control.update(3.0) == 0.0  # never negative
    assert control.update(0.4) == pytest.approx(0.005)  # below: more bonus
    assert [round(control.update(0.2), 6) for _ in range(4)] == [0.01, 0.015, 0.02, 0.02]  # bounded
    assert control.update(float("nan")) == pytest.approx(0.02)  # an empty step changes nothing


def test_entropy_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        EntropyControl(-0.1)
    with pytest.raises(ValueError, match="target"):
        EntropyControl(0.0, target=-1.0)
    with pytest.raises(ValueError):
        LearnerSettings(entropy_target=-1.0)
