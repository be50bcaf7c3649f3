"""Synthetic trajectories over the tiny model's vocabulary (4096 ids), for learner tests and benchmarks."""

from __future__ import annotations

import random
import uuid

from schemas import TrajectoryV1
from schemas.trajectory.v1 import FinalizeReason, MergeStats, TrajectorySample

VOCAB = 4096


def trajectory(task_id: str, group_index: int, group_size: int | None = 4, *, reward: float | None = 1.0,
               version: str | None = "0", prompt_len: int = 24, completion_len: int = 16, seed: int = 0,
               infrastructure_failure: bool = False, samples: int = 1) -> TrajectoryV1:
    rng = random.Random(f"{task_id}/{group_index}/{seed}")
    made = []
    for _ in range(samples):
        mask = [1] * completion_len
        mask[completion_len // 2] = 0  # a context token in the middle, as merged calls have
        made.append(TrajectorySample(
            prompt_ids=[rng.randrange(VOCAB) for _ in range(prompt_len)],
            completion_ids=[rng.randrange(VOCAB) for _ in range(completion_len)],
            loss_mask=mask,
            behavior_logprobs=[0.0 if k == 0 else -8.0 - rng.random() for k in mask],
            weight_versions=[] if version is None else [{"version": version, "start": 0, "end": completion_len}],
            call_ids=[f"c-{uuid.uuid4().hex[:8]}"],
        ))
    return TrajectoryV1(
        trajectory_id=f"tr-{task_id}-{group_index}-{uuid.uuid4().hex[:6]}",
        rollout_id=f"r-{task_id}-{group_index}",
        task_id=task_id, group_index=group_index, group_size=group_size,
        reward=None if infrastructure_failure else reward,
        infrastructure_failure=infrastructure_failure,
        samples=[] if infrastructure_failure else made,
        merge_stats=MergeStats(calls=samples, merged=0, breaks=max(0, samples - 1)),
        finalize_reason=FinalizeReason.NO_REWARD_EXPECTED if infrastructure_failure else FinalizeReason.COMPLETED,
    )


def groups(n_groups: int, group_size: int = 4, *, prefix: str = "task", **kw: object) -> list[TrajectoryV1]:
    """``n_groups`` complete groups with rewards 0..1 spread inside each group."""
    return [trajectory(f"{prefix}-{g}", i, group_size, reward=i / max(1, group_size - 1), **kw)  # type: ignore[arg-type]
            for g in range(n_groups) for i in range(group_size)]
