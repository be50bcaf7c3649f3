"""veRL's algorithms, resolved by name: advantage estimators, policy losses, rollout correction.

The learner calls veRL's own functions (``verl.trainer.ppo.core_algos`` and
``verl.trainer.ppo.rollout_corr_helper``) rather than copies of them, so its numbers are veRL's.
"""

from learner.algos.registry import (
    AlgorithmNameError,
    advantage_estimator,
    compute_advantages,
    outcome_estimators,
    policy_loss,
    policy_losses,
    rollout_correction,
)

__all__ = [
    "AlgorithmNameError",
    "advantage_estimator",
    "compute_advantages",
    "outcome_estimators",
    "policy_loss",
    "policy_losses",
    "rollout_correction",
]
