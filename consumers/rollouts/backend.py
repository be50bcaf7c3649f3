"""The contract between the launcher and the places rollouts run.

The launcher decides *what* to run (rollout ids, credentials, environment); a backend decides
*how*: one Kubernetes pod per rollout, or one local process group per rollout. Keeping the two
apart lets the embedded demo and a cluster share every line of launching logic, and lets tests
drive each backend through the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from schemas.rollout.v1 import Backend
from schemas.rollout_env import (
    ENV_AGENT_KEYS,
    ENV_ANTHROPIC_BASE_URL,
    ENV_INSTRUCTION,
    ENV_OPENAI_BASE_URL,
    ENV_PROXY_URL,
    ENV_REWARD_URL,
    ENV_ROLLOUT_ID,
    ENV_TASK_ID,
    ENV_VERIFIER_TOKEN,
)
from schemas.task.v1 import TaskV1

__all__ = [
    "ENV_AGENT_KEYS",
    "ENV_ANTHROPIC_BASE_URL",
    "ENV_INSTRUCTION",
    "ENV_OPENAI_BASE_URL",
    "ENV_PROXY_URL",
    "ENV_REWARD_URL",
    "ENV_ROLLOUT_ID",
    "ENV_TASK_ID",
    "ENV_VERIFIER_TOKEN",
    "INSTRUCTION_PLACEHOLDER",
    "RolloutBackend",
    "RolloutSpec",
    "harness_argv",
]

INSTRUCTION_PLACEHOLDER = "{instruction}"
"""An argv element of the harness command equal to this is replaced by the instruction, for
harness CLIs that take the prompt as an argument (``claude -p {instruction}``)."""


def harness_argv(task: TaskV1) -> list[str]:
    """The harness command with :data:`INSTRUCTION_PLACEHOLDER` elements replaced by the instruction."""
    return [task.instruction if arg == INSTRUCTION_PLACEHOLDER else arg for arg in task.harness.launch.command]


@dataclass(frozen=True)
class RolloutSpec:
    """Everything a backend needs to start one rollout, decided by the launcher.

    Attributes:
        rollout_id: Deterministic id (from task id and group index), so a relaunch after a
            crash names the same pod or process and "already exists" means "already launched".
        name: Backend object name derived from ``rollout_id`` (a valid DNS-1123 label).
        task: The task, as submitted.
        group_index: Position in the task's group.
        harness_env: Environment of the harness: base URLs, agent token, ids, plus the task's env.
        verifier_env: Environment of the verifier: ``harness_env`` plus reward URL and verifier token.
        deadline_s: Wall-clock limit of harness and verifier together (the task's timeout).
        labels: Labels to put on the pod (run, task, rollout), also used to find it again.
    """

    rollout_id: str
    name: str
    task: TaskV1
    group_index: int
    harness_env: dict[str, str]
    verifier_env: dict[str, str]
    deadline_s: float
    labels: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class RolloutBackend(Protocol):
    """Where rollouts run. Implementations: Kubernetes pods, local processes.

    Lifecycle events (scheduled, running, succeeded, failed, timed out) are published by the
    backend's watcher side: the pod watcher for Kubernetes, the process supervisor for the
    local backend. The launcher itself only creates rollouts and counts the active ones.
    """

    kind: Backend
    """Which backend this is, copied onto lifecycle events."""

    async def start(self) -> None:
        """Connect (API client, supervisor tasks)."""

    async def stop(self) -> None:
        """Release resources; idempotent.

        Running rollouts are left alone (Kubernetes) or terminated with a ``cancelled``
        lifecycle event and reason ``shutdown`` (local).
        """

    async def launch(self, spec: RolloutSpec) -> bool:
        """Create the rollout. Returns True if created, False if it already existed (not an error)."""

    async def active(self) -> set[str]:
        """Rollout ids that exist and have not reached a terminal phase (for the in-flight cap)."""

    async def existing(self) -> set[str]:
        """Rollout ids that exist in any phase (for reconciliation after a restart)."""
