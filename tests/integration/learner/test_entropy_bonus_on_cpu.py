"""The entropy bonus (veRL's ``entropy_coeff``) on the tiny model: its size in the loss, and its direction."""

from __future__ import annotations

from pathlib import Path

import pytest
from trajectories import groups

from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.workers.hf import HFPolicyWorker


def _batch(advantage: float | None) -> TrainBatch:
    data = groups(2, 4, prefix="ent", prompt_len=20, completion_len=12)
    return TrainBatch([
        Row(input_ids=[*s.prompt_ids, *s.completion_ids], prompt_len=len(s.prompt_ids), loss_mask=list(s.loss_mask),
            behavior_logprobs=list(s.behavior_logprobs),
            advantage=((i % 4) - 1.5) if advantage is None else advantage)
        for i, t in enumerate(data) for s in t.samples
    ])


def _worker(model: Path, coeff: float, lr: float = 1e-3) -> HFPolicyWorker:
    return HFPolicyWorker(LearnerSettings(model_dir=model, lr=lr, entropy_coeff=coeff, token_budget=96), model)


def test_the_bonus_is_the_token_mean_entropy_times_the_coefficient(tiny_model: Path) -> None:
    batch = _batch(None)
    plain = _worker(tiny_model, 0.0).train_step(batch)
    bonus = _worker(tiny_model, 0.05).train_step(batch)
    # Same weights before the step: the same policy loss and entropy, and the bonus subtracted.
    assert bonus["entropy"] == pytest.approx(plain["entropy"], rel=1e-6)
    assert bonus["loss"] == pytest.approx(plain["loss"] - 0.05 * plain["entropy"], rel=1e-5, abs=1e-6)


def test_with_zero_advantages_only_the_bonus_moves_the_policy_and_it_raises_entropy(tiny_model: Path) -> None:
    batch = _batch(0.0)
    plain = _worker(tiny_model, 0.0, lr=1e-2)
    assert plain.train_step(batch)["grad_norm"] == 0.0  # no advantage, no policy gradient
    worker = _worker(tiny_model, 0.1, lr=1e-2)
    before = worker.train_step(batch)["entropy"]
    for _ in range(3):
        after = worker.train_step(batch)["entropy"]
    assert after > before + 1e-3


def test_below_its_target_entropy_the_worker_raises_the_bonus_each_step(tiny_model: Path) -> None:
    settings = LearnerSettings(model_dir=tiny_model, lr=1e-3, token_budget=96, entropy_coeff=0.0,
                               entropy_target=100.0, entropy_coeff_delta=0.01)  # unreachable target
    worker = HFPolicyWorker(settings, tiny_model)
    batch = _batch(None)
    used = [worker.train_step(batch)["entropy_coeff"] for _ in range(3)]
    assert used == pytest.approx([0.0, 0.01, 0.02])
    assert worker.entropy_control.coeff == pytest.approx(0.03)
    assert "entropy_coeff" not in _worker(tiny_model, 0.0).train_step(batch)  # no bonus, no metric
