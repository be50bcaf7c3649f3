"""The failure taxonomy: why a rollout gave no scored result, and whether the policy is to blame.

One module for the rollout backends (local processes, the pod watcher) and the assembler, so every
part judges a failure the same way. A failure is either the **policy's** (the agent ran and did
badly: it exited non-zero on its own, or ran past the task's deadline) or the **infrastructure's**
(anything else: the pod was evicted, the verifier crashed, the engine answered 5xx, the reward never
came). Infrastructure outcomes never enter a group's statistics: counting them as a zero reward
would teach the policy about the cluster, not the task.

Backends put the reason on the lifecycle event and set ``infrastructure_failure`` from
:func:`classify`; the assembler calls :func:`classify` again with what only it can see (the calls,
the reward, its own timeouts) and puts the verdict on the trajectory as ``failure_reason``.
No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from schemas.call.v1 import CallStatus, ModelCallV1
from schemas.rollout.v1 import RolloutPhase, RolloutReason

__all__ = [
    "POLICY_REASONS",
    "REQUEST_REFUSED_CODES",
    "FailureReason",
    "classify",
    "ended_by_upstream",
    "failed_upstream",
]


class FailureReason(StrEnum):
    """Every reason a rollout can end without a scored result.

    The first group are lifecycle reasons (:class:`~schemas.rollout.v1.RolloutReason`, same
    values), decided by a backend; the last four are decided by the assembler.
    """

    EXIT_CODE = "exit_code"
    """The harness exited non-zero with no infrastructure cause (policy)."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The task's deadline passed while the harness or verifier ran: the agent spent the time (policy)."""
    HARNESS_TIMEOUT = "harness_timeout"
    """The harness gave up at its own time limit (policy)."""
    OOM_KILLED = "oom_killed"
    """A container or process of the rollout was killed at its memory limit."""
    VERIFIER_FAILED = "verifier_failed"
    """The verifier could not start, crashed, was killed or passed its own timeout."""
    EVICTED = "evicted"
    """Kubernetes evicted or preempted the pod."""
    NODE_LOST = "node_lost"
    """The pod's node went away (lost, shut down, or its pods deleted by the node controller)."""
    IMAGE_PULL = "image_pull"
    """An image of the pod could not be pulled."""
    UNSCHEDULABLE = "unschedulable"
    """No node could take the pod."""
    CANCELLED_BY_USER = "cancelled_by_user"
    """Someone cancelled the task or rollout."""
    SHUTDOWN = "shutdown"
    """The launcher shut down (or died) while the rollout ran."""
    OTHER = "other"
    """The backend could not run the rollout, or the rollout ended with no cause the backend could name."""
    UPSTREAM_FAILED = "upstream_failed"
    """The rollout's last model call failed at the proxy or the engine (see :func:`failed_upstream`),
    so the harness stopped for want of an answer, not for what the model said."""
    REWARD_TIMEOUT = "reward_timeout"
    """The rollout succeeded but no reward arrived within the assembler's wait."""
    LIFECYCLE_TIMEOUT = "lifecycle_timeout"
    """No terminal lifecycle event arrived within the assembler's wait."""
    ASSEMBLER_EVICTED = "assembler_evicted"
    """The assembler closed the rollout before its outcome was known, to bound its memory."""

    @property
    def is_infrastructure(self) -> bool:
        """Whether the infrastructure, not the policy, is to blame (every reason outside :data:`POLICY_REASONS`)."""
        return self not in POLICY_REASONS


POLICY_REASONS = frozenset({FailureReason.EXIT_CODE, FailureReason.DEADLINE_EXCEEDED, FailureReason.HARNESS_TIMEOUT})
"""The reasons that count against the policy. Every other reason is infrastructure, so a cause
nobody could name (``other``) or a reason added later never reads as the agent's failure."""

REQUEST_REFUSED_CODES = frozenset({400, 413, 422})
"""Engine answers that refuse the request itself (a context too long, a malformed conversation):
the policy built that request, so such a failure is not the infrastructure's."""

_INFRASTRUCTURE_CALLS = frozenset({
    CallStatus.UPSTREAM_UNREACHABLE, CallStatus.UPSTREAM_TIMEOUT, CallStatus.INTERNAL_ERROR})

_DEFAULT_FOR_PHASE = {
    RolloutPhase.FAILED: FailureReason.OTHER,
    RolloutPhase.TIMED_OUT: FailureReason.DEADLINE_EXCEEDED,
    RolloutPhase.CANCELLED: FailureReason.CANCELLED_BY_USER,
}


def failed_upstream(call: ModelCallV1) -> bool:
    """Whether the proxy or the engine, not the request or the harness, failed this call.

    Counted: ``upstream_unreachable``, ``upstream_timeout``, ``internal_error`` (the proxy itself
    failed), and ``upstream_error`` unless the engine's status is one of
    :data:`REQUEST_REFUSED_CODES` (5xx, 429, an aborted or unreadable answer all count). Not
    counted: ``ok``, ``client_disconnected`` (the harness went away) and ``invalid_request`` (the
    proxy refused what the harness sent).
    """
    if call.status in _INFRASTRUCTURE_CALLS:
        return True
    return call.status is CallStatus.UPSTREAM_ERROR and call.upstream_status_code not in REQUEST_REFUSED_CODES


def ended_by_upstream(calls: Sequence[ModelCallV1]) -> bool:
    """Whether the rollout's last call (latest ``started_at``; arrival order on ties) failed upstream.

    Only the last call decides: a harness that got a 5xx, retried and went on was not stopped by it.
    """
    if not calls:
        return False
    last = max(range(len(calls)), key=lambda i: (calls[i].timings.started_at, i))
    return failed_upstream(calls[last])


def classify(phase: RolloutPhase | None, reason: RolloutReason | None = None, *,
             calls: Sequence[ModelCallV1] = (), reward_missing: bool = False,
             evicted: bool = False) -> FailureReason | None:
    """Why a rollout gave no scored result, or None when the verifier's score stands.

    A backend passes the terminal phase and reason it is about to publish; the assembler adds
    the rollout's calls and what it knows of the reward. In order:

    1. A terminal lifecycle reason that is infrastructure wins (it names the cause most precisely).
    2. No terminal event: ``assembler_evicted`` if the assembler closed it early, else
       ``lifecycle_timeout``.
    3. The last call failed upstream (:func:`ended_by_upstream`): ``upstream_failed``, whatever the
       harness's exit code or the verifier's score, since the harness stopped without an answer.
    4. ``succeeded``: None when scored, else ``assembler_evicted`` or ``reward_timeout``.
    5. Otherwise the lifecycle reason, a policy one (an event without a reason gets its phase's
       default: ``other`` for failed, ``deadline_exceeded`` for timed out, ``cancelled_by_user``
       for cancelled).

    Args:
        phase: The rollout's terminal phase; None when no terminal event arrived (assembler only).
        reason: The terminal event's reason.
        calls: The rollout's model calls, any status (assembler only).
        reward_missing: A ``succeeded`` rollout is being closed without a reward (assembler only).
        evicted: The assembler is closing the rollout early to bound its memory.

    Raises:
        ValueError: ``phase`` is not terminal.
    """
    if phase is not None and not phase.is_terminal:
        raise ValueError(f"only a terminal phase can be classified, not {phase.value!r}")
    lifecycle = None
    if phase is not None and phase is not RolloutPhase.SUCCEEDED:
        lifecycle = FailureReason(reason.value) if reason is not None else _DEFAULT_FOR_PHASE[phase]
        if lifecycle.is_infrastructure:
            return lifecycle
    if phase is None:
        return FailureReason.ASSEMBLER_EVICTED if evicted else FailureReason.LIFECYCLE_TIMEOUT
    if ended_by_upstream(calls):
        return FailureReason.UPSTREAM_FAILED
    if phase is RolloutPhase.SUCCEEDED:
        if not reward_missing:
            return None
        return FailureReason.ASSEMBLER_EVICTED if evicted else FailureReason.REWARD_TIMEOUT
    return lifecycle
