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
