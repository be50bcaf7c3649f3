"""Rollout lifecycle, version 1: published to ``openforge.rollouts.v1`` by launcher and watcher."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Self

from pydantic import Field, model_validator

from schemas._base import EventBase
from schemas._common import Identifier

__all__ = ["Backend", "RolloutEventV1", "RolloutPhase", "RolloutReason"]


class RolloutPhase(StrEnum):
    """Where a rollout is in its life. The last four are terminal."""

    SCHEDULED = "scheduled"
    """The launcher created the pod or process."""
    RUNNING = "running"
    """The harness started."""
    SUCCEEDED = "succeeded"
    """Harness and verifier finished; a reward is expected."""
    FAILED = "failed"
    """The rollout ended without a usable result."""
    TIMED_OUT = "timed_out"
    """The task deadline passed before the rollout finished."""
    CANCELLED = "cancelled"
    """The rollout was stopped on purpose (task withdrawn, shutdown)."""

    @property
    def is_terminal(self) -> bool:
        """Whether no further phase can follow this one."""
        return self in _TERMINAL_PHASES


_TERMINAL_PHASES = frozenset(
    {RolloutPhase.SUCCEEDED, RolloutPhase.FAILED, RolloutPhase.TIMED_OUT, RolloutPhase.CANCELLED}
)


class RolloutReason(StrEnum):
    """Why a rollout reached its phase, as far as the backend can tell.

    Which of these are the policy's failures and which the infrastructure's is decided in one
    place, :mod:`schemas.failures`.
    """

    EXIT_CODE = "exit_code"
    """The harness or verifier exited with a non-zero code (see the exit code fields)."""
    OOM_KILLED = "oom_killed"
    """A container or process was killed for exceeding its memory limit."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The task deadline passed."""
    HARNESS_TIMEOUT = "harness_timeout"
    """The harness itself gave up (its own time limit) before finishing."""
    VERIFIER_FAILED = "verifier_failed"
    """The verifier crashed or timed out, so no reward can be trusted."""
    EVICTED = "evicted"
    """The node evicted or preempted the pod."""
    NODE_LOST = "node_lost"
    """The pod's node went away (lost, shut down, or its pods deleted by the node controller)."""
    IMAGE_PULL = "image_pull"
    """An image could not be pulled."""
    UNSCHEDULABLE = "unschedulable"
    """No node could take the pod (resources, taints, quota)."""
    CANCELLED_BY_USER = "cancelled_by_user"
    """Someone cancelled the task or rollout."""
    SHUTDOWN = "shutdown"
    """The launcher shut down and stopped its rollouts."""
    OTHER = "other"
    """Anything else; ``message`` says what."""


class Backend(StrEnum):
    """Where rollouts run."""

    KUBERNETES = "kubernetes"
    """One pod per rollout, created by the launcher."""
    LOCAL = "local"
    """One local process per rollout (the embedded demo)."""


class RolloutEventV1(EventBase):
    """A change in a rollout's lifecycle.

    The ``scheduled`` event carries the task's group context (group size, harness name), because
    the assembler reads this topic and not the tasks topic.
    """

    SCHEMA: ClassVar[str] = "rollout"
    VERSION: ClassVar[int] = 1

    rollout_id: Identifier
    """The rollout; the Kafka key."""

    task_id: Identifier
    """Task the rollout belongs to."""

    run_id: Identifier | None = None
    """Experiment run, copied from the task."""

    group_index: int = Field(ge=0)
    """Position of this rollout within its task's group (0 .. group_size-1)."""

    group_size: int | None = Field(default=None, ge=1)
    """Rollouts in the group, copied from the task (set at least on ``scheduled``)."""

    harness: str | None = Field(default=None, min_length=1)
    """Harness name, copied from the task (set at least on ``scheduled``)."""

    timeout_s: float | None = Field(default=None, gt=0)
    """The task's time limit of one rollout in seconds, copied from the task on ``scheduled``; the
    learner derives how long a group waits for its stragglers from it."""

    phase: RolloutPhase
    """The phase the rollout entered."""

    reason: RolloutReason | None = None
    """Why, for phases other than ``scheduled``, ``running`` and ``succeeded``."""

    harness_exit_code: int | None = None
    """Exit code of the harness, once it exited."""

    verifier_exit_code: int | None = None
    """Exit code of the verifier, once it ran."""

    infrastructure_failure: bool = False
    """The rollout failed for reasons unrelated to the policy (eviction, image pull, a crashed
    verifier, ...), as :func:`schemas.failures.classify` judges ``reason``. The learner leaves such
    rollouts out of group statistics rather than counting them as a zero reward."""

    message: str | None = None
    """Human-readable detail (container status message, last log line, exception)."""

    backend: Backend
    """Where the rollout runs."""

    pod_name: str | None = None
    """Kubernetes pod name, for the ``kubernetes`` backend."""

    namespace: str | None = None
    """Kubernetes namespace of the pod, for the ``kubernetes`` backend."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.infrastructure_failure and self.phase not in (
            RolloutPhase.FAILED,
            RolloutPhase.TIMED_OUT,
            RolloutPhase.CANCELLED,
        ):
            raise ValueError(
                f"infrastructure_failure applies only to failed, timed_out or cancelled "
                f"rollouts, not to phase {self.phase.value!r}"
            )
        if self.group_size is not None and self.group_index >= self.group_size:
            raise ValueError(f"group_index {self.group_index} is outside a group of size {self.group_size}")
        return self

    @property
    def is_terminal(self) -> bool:
        """Whether this event ends the rollout's lifecycle."""
        return self.phase.is_terminal

    def partition_key(self) -> str:
        """Return ``rollout_id``."""
        return self.rollout_id
