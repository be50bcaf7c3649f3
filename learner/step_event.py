"""The learner's per-step record (:class:`~schemas.LearnerStepV1`): what a step trained on and measured.

The trainer calls :func:`publish_step` once at the end of each optimizer step. The record is for
people (the flight recorder's learner-step view, the harness report): failing to publish it is
logged and counted, never allowed to stop training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence

from learner.settings import LearnerSettings
from schemas import LearnerStepV1, StepDrop, StepTrajectory, TrajectoryV1
from stream.producer import EventProducer
from stream.topics import STEPS

__all__ = ["build_step", "publish_step"]

logger = logging.getLogger(__name__)


def _oldest_version(trajectory: TrajectoryV1) -> int | None:
    numbers = [r.version_number for s in trajectory.samples for r in s.weight_versions]
    known = [n for n in numbers if n is not None and n >= 0]
    return min(known) if known else None


def build_step(settings: LearnerSettings, *, step: int, version: int, duration_s: float,
               trained: Sequence[TrajectoryV1], considered: Iterable[TrajectoryV1],
               dropped: Mapping[str, str], metrics: Mapping[str, float],
               importance_weights: Sequence[float]) -> LearnerStepV1:
    """The step's record.

    Args:
        settings: The learner's settings (model name; how rewards and advantages are computed).
        step: Steps taken, this one included.
        version: The weight version the step produced.
        duration_s: Wall time of the step.
        trained: The trajectories the step trained on, in the trainer's order.
        considered: Every trajectory of the step's groups (trained or not).
        dropped: Drop reason by trajectory id, for those the trainer left out.
        metrics: The step's metrics (worker and trainer); non-finite values are left out.
        importance_weights: The worker's quantile sample of the step's importance weights.
    """
    from learner.algos import compute_advantages

    # The same rewards and estimator as the trainer's batch, so the advantages are those it trained with.
    rewards = [settings.missing_reward if t.reward is None else t.reward for t in trained]
    advantages = compute_advantages(rewards, [t.task_id for t in trained], estimator=settings.advantage_estimator,
                                    norm_adv_by_std=settings.norm_adv_by_std) if trained else []
    used = {t.trajectory_id for t in trained}
    return LearnerStepV1(
        model=settings.model_name, step=step, version=version, duration_s=max(duration_s, 0.0),
        trajectories=[StepTrajectory(
            trajectory_id=t.trajectory_id, rollout_id=t.rollout_id, task_id=t.task_id, group_index=t.group_index,
            reward=reward, advantage=advantage if math.isfinite(advantage) else 0.0,
            trained_tokens=sum(s.trained_tokens for s in t.samples), oldest_version=_oldest_version(t),
        ) for t, reward, advantage in zip(trained, rewards, advantages, strict=True)],
        dropped=[StepDrop(trajectory_id=t.trajectory_id, rollout_id=t.rollout_id, task_id=t.task_id,
                          reason=dropped.get(t.trajectory_id, "unknown"))
                 for t in considered if t.trajectory_id not in used],
        metrics={k: float(v) for k, v in metrics.items() if math.isfinite(v)},
        importance_weights=[float(w) for w in importance_weights if math.isfinite(w)],
    )


async def publish_step(producer: EventProducer | None, settings: LearnerSettings, *, step: int, version: int,
                       duration_s: float, trained: Sequence[TrajectoryV1], considered: Iterable[TrajectoryV1],
                       dropped: Mapping[str, str], metrics: Mapping[str, float],
                       importance_weights: Sequence[float]) -> None:
    """Publish the step's record on ``openforge.steps.v1``; without a producer (benchmarks) do nothing."""
    if producer is None:
        return
    try:
        event = build_step(settings, step=step, version=version, duration_s=duration_s, trained=trained,
                           considered=considered, dropped=dropped, metrics=metrics,
                           importance_weights=importance_weights)
        await producer.publish(STEPS, event)
    except Exception:  # a monitoring record: training goes on without it
        logger.exception("step %d: publishing its record on the steps topic failed", step)
