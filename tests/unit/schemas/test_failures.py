"""The failure taxonomy: every reason's kind, which calls count as upstream failures, and classify()."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from assembler_factories import call

from schemas.call.v1 import CallStatus, ModelCallV1
from schemas.failures import (
    POLICY_REASONS,
    REQUEST_REFUSED_CODES,
    FailureReason,
    classify,
    ended_by_upstream,
    failed_upstream,
)
from schemas.rollout.v1 import RolloutPhase, RolloutReason
from schemas.trajectory.v1 import FinalizeReason, MergeStats, TrajectoryV1

F = FailureReason
DOCS = Path(__file__).resolve().parents[3] / "docs" / "rollouts.md"

# Written out member by member: a reason added later fails here until someone decides its kind.
KIND = {
    F.EXIT_CODE: "policy", F.DEADLINE_EXCEEDED: "policy", F.HARNESS_TIMEOUT: "policy",
    F.OOM_KILLED: "infrastructure", F.VERIFIER_FAILED: "infrastructure", F.EVICTED: "infrastructure",
    F.NODE_LOST: "infrastructure", F.IMAGE_PULL: "infrastructure", F.UNSCHEDULABLE: "infrastructure",
    F.CANCELLED_BY_USER: "infrastructure", F.SHUTDOWN: "infrastructure", F.OTHER: "infrastructure",
    F.UPSTREAM_FAILED: "infrastructure", F.REWARD_TIMEOUT: "infrastructure",
    F.LIFECYCLE_TIMEOUT: "infrastructure", F.ASSEMBLER_EVICTED: "infrastructure",
}


def test_every_reason_has_the_kind_it_was_given() -> None:
    assert set(KIND) == set(FailureReason)
    assert {r: "infrastructure" if r.is_infrastructure else "policy" for r in FailureReason} == KIND
    assert {r for r, kind in KIND.items() if kind == "policy"} == POLICY_REASONS


def test_lifecycle_reasons_are_failure_reasons_with_the_same_values() -> None:
    assert {r.value for r in RolloutReason} <= {r.value for r in FailureReason}


def test_the_docs_table_lists_every_reason_with_its_kind() -> None:
    rows = re.findall(r"^\| `([a-z_]+)` \| (policy|infrastructure) \|", DOCS.read_text(), flags=re.M)
    assert dict(rows) == {r.value: kind for r, kind in KIND.items()}
    assert len(rows) == len(FailureReason)


# --- which calls failed upstream ----------------------------------------------------------------------

CODES = [None, 200, 400, 401, 404, 408, 413, 422, 429, 500, 502, 503, 504]


def failed(status: CallStatus, code: int | None = None, *, call_id: str = "c", at: float = 0.0) -> ModelCallV1:
    made = call([1], [2] if status is CallStatus.OK else [], call_id=call_id, status=status, at=at)
    return made.model_copy(update={"upstream_status_code": code})


@pytest.mark.parametrize(("status", "code"), list(itertools.product(CallStatus, CODES)))
def test_which_call_statuses_count_as_upstream_failures(status: CallStatus, code: int | None) -> None:
    expected = {
        CallStatus.OK: False,
        CallStatus.CLIENT_DISCONNECTED: False,  # the harness went away
        CallStatus.INVALID_REQUEST: False,  # the proxy refused what the harness sent
        CallStatus.UPSTREAM_UNREACHABLE: True,
        CallStatus.UPSTREAM_TIMEOUT: True,
        CallStatus.INTERNAL_ERROR: True,  # the proxy itself failed
        CallStatus.UPSTREAM_ERROR: code not in (400, 413, 422),  # 5xx, 429, 401, an aborted answer (200), ...
    }[status]
    assert failed_upstream(failed(status, code)) is expected


def test_request_refusals_are_the_three_codes_that_blame_the_request() -> None:
    assert frozenset({400, 413, 422}) == REQUEST_REFUSED_CODES


def test_only_the_last_call_decides_whether_upstream_ended_the_rollout() -> None:
    bad, ok = failed(CallStatus.UPSTREAM_ERROR, 503, call_id="bad", at=1), failed(CallStatus.OK, call_id="ok", at=2)
    assert not ended_by_upstream([])
    assert not ended_by_upstream([bad, ok])  # a 5xx, a retry that worked: the harness carried on
    assert ended_by_upstream([ok, bad.model_copy(update={"timings": ok.timings.model_copy(
        update={"started_at": ok.timings.started_at.replace(second=3)})})])
    assert not ended_by_upstream([ok.model_copy(update={"timings": bad.timings.model_copy(
        update={"started_at": bad.timings.started_at.replace(second=9)})}), bad])  # by start time, not arrival
    same_time = ok.model_copy(update={"timings": bad.timings})
    assert ended_by_upstream([same_time, bad]) and not ended_by_upstream([bad, same_time])  # ties: arrival order
    assert not ended_by_upstream([failed(CallStatus.UPSTREAM_ERROR, 400)])  # context too long: the policy's


# --- classify --------------------------------------------------------------------------------------------

UPSTREAM_5XX = [failed(CallStatus.OK, call_id="a", at=0), failed(CallStatus.UPSTREAM_ERROR, 502, call_id="b", at=1)]
REFUSED_400 = [failed(CallStatus.UPSTREAM_ERROR, 400, call_id="a", at=0)]
FINE = [failed(CallStatus.OK, call_id="a", at=0)]


@pytest.mark.parametrize(("phase", "reason", "calls", "reward_missing", "evicted", "expected"), [
    # The verifier scored it: the score stands, even after a refused request.
    (RolloutPhase.SUCCEEDED, None, FINE, False, False, None),
    (RolloutPhase.SUCCEEDED, None, REFUSED_400, False, False, None),
    (RolloutPhase.SUCCEEDED, None, FINE, False, True, None),  # evicted once complete: nothing was missing
    # The policy's failures.
    (RolloutPhase.FAILED, RolloutReason.EXIT_CODE, FINE, True, False, F.EXIT_CODE),
    (RolloutPhase.FAILED, RolloutReason.EXIT_CODE, REFUSED_400, True, False, F.EXIT_CODE),
    (RolloutPhase.TIMED_OUT, RolloutReason.DEADLINE_EXCEEDED, FINE, True, False, F.DEADLINE_EXCEEDED),
    (RolloutPhase.TIMED_OUT, None, (), True, False, F.DEADLINE_EXCEEDED),
    (RolloutPhase.FAILED, RolloutReason.HARNESS_TIMEOUT, FINE, True, False, F.HARNESS_TIMEOUT),
    # A harness that exited after the proxy or engine failed, scored or not.
    (RolloutPhase.FAILED, RolloutReason.EXIT_CODE, UPSTREAM_5XX, True, False, F.UPSTREAM_FAILED),
    (RolloutPhase.SUCCEEDED, None, UPSTREAM_5XX, False, False, F.UPSTREAM_FAILED),
    (RolloutPhase.TIMED_OUT, RolloutReason.DEADLINE_EXCEEDED, UPSTREAM_5XX, True, False, F.UPSTREAM_FAILED),
    # Infrastructure named by a backend wins over what the calls show.
    (RolloutPhase.FAILED, RolloutReason.EVICTED, UPSTREAM_5XX, True, False, F.EVICTED),
    (RolloutPhase.FAILED, RolloutReason.NODE_LOST, FINE, True, False, F.NODE_LOST),
    (RolloutPhase.FAILED, RolloutReason.OOM_KILLED, FINE, True, False, F.OOM_KILLED),
    (RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED, FINE, False, False, F.VERIFIER_FAILED),
    (RolloutPhase.FAILED, RolloutReason.IMAGE_PULL, (), True, False, F.IMAGE_PULL),
    (RolloutPhase.FAILED, RolloutReason.UNSCHEDULABLE, (), True, False, F.UNSCHEDULABLE),
    (RolloutPhase.CANCELLED, RolloutReason.SHUTDOWN, FINE, True, False, F.SHUTDOWN),
    (RolloutPhase.CANCELLED, None, FINE, True, False, F.CANCELLED_BY_USER),
    (RolloutPhase.CANCELLED, RolloutReason.CANCELLED_BY_USER, FINE, True, False, F.CANCELLED_BY_USER),
    (RolloutPhase.FAILED, None, FINE, True, False, F.OTHER),
    (RolloutPhase.FAILED, RolloutReason.OTHER, FINE, True, False, F.OTHER),
    # What only the assembler sees.
    (RolloutPhase.SUCCEEDED, None, FINE, True, False, F.REWARD_TIMEOUT),
    (RolloutPhase.SUCCEEDED, None, FINE, True, True, F.ASSEMBLER_EVICTED),
    (None, None, FINE, True, False, F.LIFECYCLE_TIMEOUT),
    (None, None, UPSTREAM_5XX, True, False, F.LIFECYCLE_TIMEOUT),
    (None, None, (), True, True, F.ASSEMBLER_EVICTED),
])
def test_classify_named_cases(phase: RolloutPhase | None, reason: RolloutReason | None, calls: list,
                              reward_missing: bool, evicted: bool, expected: FailureReason | None) -> None:
    assert classify(phase, reason, calls=calls, reward_missing=reward_missing, evicted=evicted) is expected


def test_what_a_backend_passes_gives_the_lifecycle_reason_itself() -> None:
    for reason in RolloutReason:
        assert classify(RolloutPhase.FAILED, reason) is FailureReason(reason.value)
    assert classify(RolloutPhase.SUCCEEDED) is None


@pytest.mark.parametrize("phase", [RolloutPhase.SCHEDULED, RolloutPhase.RUNNING])
def test_a_phase_that_is_not_terminal_is_refused(phase: RolloutPhase) -> None:
    with pytest.raises(ValueError, match="only a terminal phase"):
        classify(phase)


def test_every_combination_follows_the_documented_order() -> None:
    """All phases x reasons x last call x reward x eviction, checked against the rules one by one."""
    reached = set()
    terminal = [p for p in RolloutPhase if p.is_terminal]
    for phase, reason, calls, reward_missing, evicted in itertools.product(
            [None, *terminal], [None, *RolloutReason], [(), FINE, REFUSED_400, UPSTREAM_5XX], [False, True],
            [False, True]):
        got = classify(phase, reason, calls=calls, reward_missing=reward_missing, evicted=evicted)
        reached.add(got)
        where = (phase, reason, len(calls), reward_missing, evicted, got)
        named = None if phase in (None, RolloutPhase.SUCCEEDED) else (
            FailureReason(reason.value) if reason is not None else
            {RolloutPhase.FAILED: F.OTHER, RolloutPhase.TIMED_OUT: F.DEADLINE_EXCEEDED,
             RolloutPhase.CANCELLED: F.CANCELLED_BY_USER}[phase])
        if named is not None and named.is_infrastructure:
            assert got is named, where  # 1. a backend's infrastructure reason
        elif phase is None:
            assert got is (F.ASSEMBLER_EVICTED if evicted else F.LIFECYCLE_TIMEOUT), where  # 2.
        elif calls is UPSTREAM_5XX:
            assert got is F.UPSTREAM_FAILED, where  # 3.
        elif phase is RolloutPhase.SUCCEEDED:
            assert got is (None if not reward_missing else F.ASSEMBLER_EVICTED if evicted else F.REWARD_TIMEOUT), where
        else:
            assert got is named and named in POLICY_REASONS, where  # 5.
    assert reached == {None, *FailureReason}  # every reason can come out


def test_a_trajectory_cannot_contradict_its_failure_reason() -> None:
    fields = {"trajectory_id": "t", "rollout_id": "r", "task_id": "k", "group_index": 0,
              "merge_stats": MergeStats(calls=0, merged=0, breaks=0), "finalize_reason": FinalizeReason.REWARD_TIMEOUT}
    assert TrajectoryV1(**fields, failure_reason=F.REWARD_TIMEOUT, infrastructure_failure=True).failure_reason is (
        F.REWARD_TIMEOUT)
    with pytest.raises(ValueError, match="contradicts failure_reason 'reward_timeout', which is an infrastructure"):
        TrajectoryV1(**fields, failure_reason=F.REWARD_TIMEOUT)
    with pytest.raises(ValueError, match="which is a policy failure"):
        TrajectoryV1(**fields, failure_reason=F.EXIT_CODE, infrastructure_failure=True)
    assert TrajectoryV1(**fields, infrastructure_failure=True).failure_reason is None  # written before the field
