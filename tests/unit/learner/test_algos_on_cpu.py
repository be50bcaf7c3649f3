"""The learner's numbers are veRL's: advantages, importance weights and losses on the same tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos, rollout_corr_helper

from learner.algos import (
    AlgorithmNameError,
    advantage_estimator,
    compute_advantages,
    outcome_estimators,
    policy_loss,
    rollout_correction,
)


def _tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    current = -torch.rand(6, 12, generator=g) * 4
    behavior = current + torch.randn(6, 12, generator=g) * 0.8
    mask = (torch.rand(6, 12, generator=g) > 0.2).float()
    return current, behavior, mask


def test_truncated_token_weights_match_verl_and_the_formula() -> None:
    current, behavior, mask = _tensors()
    ours, new_mask, metrics = rollout_correction(current, behavior, mask)  # defaults: token TIS at 2.0
    theirs, _ = rollout_corr_helper.compute_rollout_correction_weights(
        log_ratio=current - behavior, response_mask=mask, rollout_is="token", rollout_is_threshold=2.0)
    assert ours is not None
    torch.testing.assert_close(ours, theirs)
    expected = torch.clamp(torch.exp(current - behavior), max=2.0) * mask
    torch.testing.assert_close(ours * mask, expected)
    assert float(ours.max()) <= 2.0 and float((ours * mask).max()) == pytest.approx(2.0)  # truncation was active
    torch.testing.assert_close(new_mask, mask)
    assert 0 < metrics["rollout_corr/rollout_is_eff_sample_size"] <= 1


def test_sequence_weights_and_icepop_match_verl() -> None:
    current, behavior, mask = _tensors(1)
    ours, _, _ = rollout_correction(current, behavior, mask, mode="sequence", threshold="5.0")
    theirs, _ = rollout_corr_helper.compute_rollout_correction_weights(
        log_ratio=current - behavior, response_mask=mask, rollout_is="sequence", rollout_is_threshold=5.0)
    torch.testing.assert_close(ours, theirs)
    ours, _, _ = rollout_correction(current, behavior, mask, threshold="0.5_2.0")
    theirs, _ = rollout_corr_helper.compute_rollout_correction_weights(
        log_ratio=current - behavior, response_mask=mask, rollout_is="token", rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(ours, theirs)


def test_no_correction_gives_no_weights() -> None:
    current, behavior, mask = _tensors()
    weights, _, _ = rollout_correction(current, behavior, mask, mode="none")
    assert weights is None


def test_grpo_advantages_match_verl_and_the_formula() -> None:
    rewards = [1.0, 0.0, 0.5, 0.25, 0.9, 0.1, 0.3]
    ids = ["a", "a", "a", "a", "b", "b", "b"]
    ours = compute_advantages(rewards, ids)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=torch.tensor(rewards).unsqueeze(-1), response_mask=torch.ones(7, 1),
        index=np.array(ids, dtype=object))
    assert ours == pytest.approx(theirs[:, 0].tolist())
    a = torch.tensor(rewards[:4])
    assert ours[:4] == pytest.approx(((a - a.mean()) / (a.std() + 1e-6)).tolist(), rel=1e-5)


def test_other_estimators_by_name() -> None:
    rewards, ids = [1.0, 0.0, 0.5], ["a", "a", "a"]
    rloo = compute_advantages(rewards, ids, estimator="rloo")
    assert rloo == pytest.approx([1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5])
    dr = compute_advantages(rewards, ids, norm_adv_by_std=False)
    assert dr == pytest.approx([0.5, -0.5, 0.0])


def test_unknown_or_unusable_names_list_what_exists() -> None:
    with pytest.raises(AlgorithmNameError, match="usable: .*grpo"):
        advantage_estimator("nope")
    with pytest.raises(AlgorithmNameError, match="needs inputs beyond outcome rewards"):
        advantage_estimator("gae")
    assert "gae" not in outcome_estimators() and "rloo" in outcome_estimators()
    with pytest.raises(AlgorithmNameError, match="known: .*vanilla"):
        policy_loss("nope")
    assert policy_loss("vanilla") is core_algos.get_policy_loss_fn("vanilla")


def test_rewards_and_ids_must_align() -> None:
    with pytest.raises(ValueError, match="2 rewards but 1 group ids"):
        compute_advantages([1.0, 0.0], ["a"])
