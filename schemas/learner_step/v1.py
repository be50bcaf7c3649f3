"""Learner steps, version 1: what each optimizer step trained on, on ``openforge.steps.v1``.

Checkpoint events carry a step's metrics, but their topic keeps only the newest checkpoint per
model, and they say nothing of which trajectories a step used. One event per step does: the
trajectories with their rewards and advantages, the ones left out and why, the importance weights
and the mismatch between behaviour and learner logprobs as the step measured them. It is the
record that leads from a point on the reward curve to the rollouts, and back.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from schemas._base import EventBase, FrozenModel
from schemas._common import Identifier

__all__ = ["LearnerStepV1", "StepDrop", "StepTrajectory"]


class StepTrajectory(FrozenModel):
    """One trajectory the step trained on."""

    trajectory_id: Identifier
    """The trajectory."""

    rollout_id: Identifier
    """Its rollout."""

    task_id: Identifier
    """Its task (the group)."""

    group_index: int = Field(ge=0)
    """Its position in the group."""

    reward: float = Field(allow_inf_nan=False)
    """The reward the step used (the learner's ``missing_reward`` where none arrived)."""

    advantage: float = Field(allow_inf_nan=False)
    """The advantage every trained token of the trajectory got."""

    trained_tokens: int = Field(ge=0)
    """Tokens with loss mask 1 over its samples."""

    oldest_version: int | None = Field(default=None, ge=0)
    """Oldest numbered weight version among its tokens; absent when no version was recorded."""


class StepDrop(FrozenModel):
    """A trajectory of the step's groups that was not trained, and why."""

    trajectory_id: Identifier
    """The trajectory."""

    rollout_id: Identifier
    """Its rollout."""

    task_id: Identifier
    """Its task."""

    reason: str = Field(min_length=1, max_length=64)
    """The learner's drop reason (``stale``, ``infrastructure_failure``, ``small_group``, ...)."""


class LearnerStepV1(EventBase):
    """One optimizer step: its inputs and what it measured. Keyed by model name."""

    SCHEMA: ClassVar[str] = "learner_step"
    VERSION: ClassVar[int] = 1

    model: str = Field(min_length=1, max_length=256)
    """Model name as served by the engine; the Kafka key."""

    step: int = Field(ge=1)
    """Optimizer steps taken, this one included."""

    version: int = Field(ge=0)
    """Weight version the step produced (published with the next checkpoint)."""

    duration_s: float = Field(ge=0, allow_inf_nan=False)
    """Wall time of the step's forward, backward and optimizer work."""

    trajectories: list[StepTrajectory] = Field(default_factory=list)
    """Trajectories trained, in the order the step took them."""

    dropped: list[StepDrop] = Field(default_factory=list)
    """Trajectories of the step's groups that were left out."""

    metrics: dict[str, float] = Field(default_factory=dict)
    """The step's metrics as the learner logs them (loss, entropy, grad norm, reward and staleness
    means) and the rollout correction's measures of behaviour against learner logprobs
    (``rollout_corr/kl``, ``rollout_corr/log_ppl_diff``, importance weight statistics). Finite
    values only."""

    importance_weights: list[float] = Field(default_factory=list)
    """Evenly spaced quantiles of the step's per-token importance weights (learner over behaviour
    probability of each trained token); empty without rollout correction."""

    def partition_key(self) -> str:
        """Return the model name."""
        return self.model
