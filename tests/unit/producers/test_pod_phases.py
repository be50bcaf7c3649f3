"""Phase derivation from pod status, without a server (the integration tests cover the API)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from producers.pod_watcher import PodWatcherSettings, derive_phases
from schemas.rollout.v1 import RolloutPhase, RolloutReason

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SETTINGS = PodWatcherSettings(unschedulable_timeout_s=60, image_pull_timeout_s=30)


def pod(phase: str = "Pending", *, age_s: float = 0, harness: dict | None = None, verifier: dict | None = None,
        reason: str | None = None, conditions: list | None = None) -> dict:
    status: dict = {"phase": phase, "conditions": conditions or []}
    if harness is not None:
        status["initContainerStatuses"] = [{"name": "harness", "state": harness}]
    if verifier is not None:
        status["containerStatuses"] = [{"name": "verifier", "state": verifier}]
    if reason:
        status["reason"] = reason
    created = (NOW - timedelta(seconds=age_s)).isoformat().replace("+00:00", "Z")
    return {"metadata": {"name": "p", "uid": "u", "creationTimestamp": created}, "status": status}


def phases(p: dict) -> list[RolloutPhase]:
    return [o.phase for o in derive_phases(p, NOW, SETTINGS)]


def test_pending_pod_is_only_scheduled() -> None:
    assert phases(pod()) == [RolloutPhase.SCHEDULED]


def test_running_harness_counts_as_running() -> None:
    assert phases(pod(harness={"running": {}})) == [RolloutPhase.SCHEDULED, RolloutPhase.RUNNING]


def test_a_pod_seen_only_when_finished_yields_every_phase_it_passed() -> None:
    done = derive_phases(pod("Succeeded", harness={"terminated": {"exitCode": 0}},
                             verifier={"terminated": {"exitCode": 0}}), NOW, SETTINGS)
    assert [o.phase for o in done] == [RolloutPhase.SCHEDULED, RolloutPhase.RUNNING, RolloutPhase.SUCCEEDED]
    assert (done[-1].harness_exit_code, done[-1].verifier_exit_code) == (0, 0)


def test_failure_reasons() -> None:
    def last(p: dict) -> tuple:
        o = derive_phases(p, NOW, SETTINGS)[-1]
        return o.phase, o.reason, o.infrastructure_failure

    assert last(pod("Failed", harness={"terminated": {"exitCode": 4}})) == (
        RolloutPhase.FAILED, RolloutReason.EXIT_CODE, False)
    assert last(pod("Failed", harness={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})) == (
        RolloutPhase.FAILED, RolloutReason.OOM_KILLED, True)  # the pod's memory limit, as for the verifier
    assert last(pod("Failed", harness={"terminated": {"exitCode": 0}},
                    verifier={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})) == (
        RolloutPhase.FAILED, RolloutReason.OOM_KILLED, True)
    assert last(pod("Failed", harness={"terminated": {"exitCode": 0}}, verifier={"terminated": {"exitCode": 1}})) == (
        RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED, True)
    assert last(pod("Failed", reason="DeadlineExceeded")) == (
        RolloutPhase.TIMED_OUT, RolloutReason.DEADLINE_EXCEEDED, False)
    assert last(pod("Failed", reason="Evicted")) == (RolloutPhase.FAILED, RolloutReason.EVICTED, True)
    assert last(pod("Failed", conditions=[{"type": "DisruptionTarget", "status": "True"}])) == (
        RolloutPhase.FAILED, RolloutReason.EVICTED, True)
    assert last(pod("Failed", reason="Preempting")) == (RolloutPhase.FAILED, RolloutReason.EVICTED, True)
    for reason in ("NodeLost", "NodeShutdown", "Terminated"):
        assert last(pod("Failed", reason=reason)) == (RolloutPhase.FAILED, RolloutReason.NODE_LOST, True)
    for reason, expected in [("DeletionByTaintManager", RolloutReason.NODE_LOST),
                             ("DeletionByPodGC", RolloutReason.NODE_LOST),
                             ("EvictionByEvictionAPI", RolloutReason.EVICTED),
                             ("PreemptionByScheduler", RolloutReason.EVICTED),
                             ("TerminationByKubelet", RolloutReason.EVICTED)]:
        disrupted = [{"type": "DisruptionTarget", "status": "True", "reason": reason}]
        assert last(pod("Failed", conditions=disrupted, harness={"terminated": {"exitCode": 137}})) == (
            RolloutPhase.FAILED, expected, True)
    assert last(pod("Failed")) == (RolloutPhase.FAILED, RolloutReason.OTHER, True)


def test_image_pull_fails_after_its_timeout_or_at_once_when_unrecoverable() -> None:
    backoff = {"waiting": {"reason": "ImagePullBackOff"}}
    assert phases(pod(age_s=10, harness=backoff)) == [RolloutPhase.SCHEDULED]
    late = derive_phases(pod(age_s=31, harness=backoff), NOW, SETTINGS)[-1]
    assert (late.phase, late.reason, late.infrastructure_failure, late.delete_pod) == (
        RolloutPhase.FAILED, RolloutReason.IMAGE_PULL, True, True)
    invalid = derive_phases(pod(age_s=0, harness={"waiting": {"reason": "InvalidImageName"}}), NOW, SETTINGS)[-1]
    assert invalid.reason == RolloutReason.IMAGE_PULL


def test_unschedulable_fails_only_past_its_timeout() -> None:
    cond = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no nodes"}]
    assert phases(pod(age_s=59, conditions=cond)) == [RolloutPhase.SCHEDULED]
    late = derive_phases(pod(age_s=61, conditions=cond), NOW, SETTINGS)
    assert [o.phase for o in late] == [RolloutPhase.SCHEDULED, RolloutPhase.FAILED]
    assert late[-1].reason == RolloutReason.UNSCHEDULABLE and late[-1].delete_pod
    assert "no nodes" in (late[-1].message or "")
