"""Name lookups over veRL's registries, with errors that list what exists.

veRL keeps module-level registries (``ADV_ESTIMATOR_REGISTRY``, ``POLICY_LOSS_REGISTRY``). The
learner computes one outcome advantage per trajectory, so only estimators that need nothing but
rewards, the response mask and the group index fit; the others (GAE needs values, ReMax a
baseline rollout, the optimal-token baselines per-token statistics) are refused by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos, rollout_corr_helper

# Arguments the learner can supply to an advantage estimator.
_SUPPLIED = frozenset({"token_level_rewards", "response_mask", "index", "epsilon", "norm_adv_by_std_in_grpo",
                       "config"})


class AlgorithmNameError(ValueError):
    """An estimator or loss name that veRL does not have, or that the learner cannot feed."""


def _required(fn: Callable[..., Any]) -> set[str]:
    return {
        name for name, p in inspect.signature(fn).parameters.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


@cache
def outcome_estimators() -> tuple[str, ...]:
    """VeRL advantage estimators that work from outcome rewards and group ids alone."""
    return tuple(sorted(
        name for name in core_algos.ADV_ESTIMATOR_REGISTRY
        if _required(core_algos.get_adv_estimator_fn(name)) <= _SUPPLIED  # type: ignore[no-untyped-call]
    ))


def advantage_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """VeRL's estimator ``name``.

    Raises:
        AlgorithmNameError: unknown, or needs inputs an outcome-reward learner does not have;
            the message lists the usable names.
    """
    if name not in outcome_estimators():
        known = ", ".join(outcome_estimators())
        why = "is not a veRL advantage estimator" if name not in core_algos.ADV_ESTIMATOR_REGISTRY else (
            "needs inputs beyond outcome rewards and group ids")
        raise AlgorithmNameError(f"advantage estimator {name!r} {why}; usable: {known}")
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = core_algos.get_adv_estimator_fn(name)  # type: ignore[no-untyped-call]
    return fn


def policy_losses() -> tuple[str, ...]:
    """VeRL policy loss names."""
    return tuple(sorted(core_algos.POLICY_LOSS_REGISTRY))


def policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """VeRL's policy loss ``name``.

    Raises:
        AlgorithmNameError: unknown name; the message lists veRL's losses.
    """
    if name not in core_algos.POLICY_LOSS_REGISTRY:
        raise AlgorithmNameError(f"policy loss {name!r} is not a veRL policy loss; known: {', '.join(policy_losses())}")
    fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]] = core_algos.get_policy_loss_fn(name)  # type: ignore[no-untyped-call]
    return fn


def compute_advantages(rewards: Sequence[float], group_ids: Sequence[str], *, estimator: str = "grpo",
                       norm_adv_by_std: bool = True) -> list[float]:
    """One advantage per trajectory, from veRL's estimator over a (trajectories x 1) reward matrix.

    Outcome estimators sum token rewards into one score per row, so a single column holding the
    trajectory's reward gives exactly veRL's group statistics with each trajectory counted once,
    however many samples it was split into. The caller broadcasts the result to its tokens.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    if not rewards:
        return []
    fn = advantage_estimator(estimator)
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {
        "token_level_rewards": torch.tensor(list(rewards), dtype=torch.float32).unsqueeze(-1),
        "response_mask": torch.ones(len(rewards), 1, dtype=torch.float32),
    }
    if "index" in params:
        kwargs["index"] = np.array(list(group_ids), dtype=object)
    if "norm_adv_by_std_in_grpo" in params:
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std
    if "config" in params:
        kwargs["config"] = AlgoConfig(adv_estimator=estimator, norm_adv_by_std_in_grpo=norm_adv_by_std)
    advantages, _ = fn(**kwargs)
    return [float(a) for a in advantages[:, 0].tolist()]


def rollout_correction(
    current_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token",
    threshold: str = "2.0",
    rejection: str | None = None,
    rejection_threshold: str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Importance weights ``pi_current / pi_behaviour`` (truncated) and the rejection mask, by veRL.

    Args:
        current_logprobs: Logprobs under the weights being trained, detached; (rows, tokens).
        behavior_logprobs: Logprobs the engine reported when sampling; same shape.
        mask: 1 for trained tokens.
        mode: ``token``, ``sequence`` or ``none``.
        threshold: Truncation bound (``"2.0"``) or IcePop bounds (``"0.5_2.0"``).
        rejection: veRL rejection-sampling modes, or None.
        rejection_threshold: Their thresholds.

    Returns:
        The weights (None when ``mode`` is ``none``), the mask after rejection, and veRL's metrics.
    """
    proto, new_mask, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=current_logprobs,
        rollout_log_prob=behavior_logprobs,
        response_mask=mask,
        rollout_is=None if mode == "none" else mode,
        rollout_is_threshold=_number_or_text(threshold),
        rollout_rs=rejection,
        rollout_rs_threshold=rejection_threshold,
    )
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    return weights, new_mask, {k: float(v) for k, v in metrics.items()}


def _number_or_text(value: str) -> str | float:
    try:
        return float(value)
    except ValueError:
        return value
