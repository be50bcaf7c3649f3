"""The learner's per-step record: the trajectories, the advantages it trained with, what it left out."""

from __future__ import annotations

import math

from trajectories import trajectory

from learner.algos import compute_advantages
from learner.settings import LearnerSettings
from learner.step_event import build_step


def test_the_step_record_holds_the_advantages_the_step_trained_with() -> None:
    settings = LearnerSettings(model_name="tiny", norm_adv_by_std=False)
    trained = [trajectory("a", i, 3, reward=r, version="4") for i, r in enumerate((0.0, 0.5, 1.0))]
    evicted = trajectory("a", 3, 4, infrastructure_failure=True)
    event = build_step(settings, step=7, version=7, duration_s=1.5, trained=trained,
                       considered=[*trained, evicted], dropped={evicted.trajectory_id: "infrastructure_failure"},
                       metrics={"loss": 0.25, "rollout_corr/kl": 0.001, "grad_norm": math.nan},
                       importance_weights=[0.9, 1.0, math.inf, 1.2])
    expected = compute_advantages([0.0, 0.5, 1.0], ["a", "a", "a"], estimator=settings.advantage_estimator,
                                  norm_adv_by_std=False)
    assert [t.advantage for t in event.trajectories] == expected
    assert [t.reward for t in event.trajectories] == [0.0, 0.5, 1.0]
    assert {t.oldest_version for t in event.trajectories} == {4}
    assert [t.trained_tokens for t in event.trajectories] == [s.trained_tokens for t in trained for s in t.samples]
    assert [(d.rollout_id, d.reason) for d in event.dropped] == [(evicted.rollout_id, "infrastructure_failure")]
    assert event.metrics == {"loss": 0.25, "rollout_corr/kl": 0.001}  # no NaN on the wire
    assert event.importance_weights == [0.9, 1.0, 1.2]
    assert (event.model, event.step, event.version, event.partition_key()) == ("tiny", 7, 7, "tiny")
