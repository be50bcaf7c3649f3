"""AdamW's settings on the tiny model: epsilon's effect on bonus-only steps, and settings winning on resume."""

from __future__ import annotations

from pathlib import Path

import torch
from trajectories import groups

from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.workers.hf import HFPolicyWorker


def _zero_advantage_batch(*, entropy_bonus: bool = True) -> TrainBatch:
    data = groups(2, 4, prefix="eps", prompt_len=20, completion_len=12)
    return TrainBatch([
        Row(input_ids=[*s.prompt_ids, *s.completion_ids], prompt_len=len(s.prompt_ids), loss_mask=list(s.loss_mask),
            behavior_logprobs=list(s.behavior_logprobs), advantage=0.0, entropy_bonus=entropy_bonus)
        for t in data for s in t.samples
    ])


def _weight_change(model: Path, eps: float) -> float:
    """How far three bonus-only steps move the weights (L2 over all parameters)."""
    worker = HFPolicyWorker(LearnerSettings(model_dir=model, lr=1e-2, entropy_coeff=0.1, adam_eps=eps,
                                            token_budget=96), model)
    before = [p.detach().clone() for p in worker.model.parameters()]
    batch = _zero_advantage_batch()
    for _ in range(3):
        worker.train_step(batch)
    return float(sum(((p.detach() - b) ** 2).sum() for p, b in zip(worker.model.parameters(), before, strict=True))
                 ** 0.5)


def test_a_larger_epsilon_keeps_bonus_only_steps_small(tiny_model: Path) -> None:
    # With nothing but the bonus to follow, torch's default epsilon moves every parameter the bonus
    # touches by about the learning rate, however small its gradient; an epsilon above those
    # gradients scales the steps down with them.
    default, damped = _weight_change(tiny_model, 1e-8), _weight_change(tiny_model, 1e-3)
    assert default > 0.1
    assert damped < default / 10


def test_the_bonus_acts_only_on_rows_marked_for_it(tiny_model: Path) -> None:
    # Zero advantages everywhere: the bonus is the only gradient. Rows marked out of its scope (the
    # learner's entropy_bonus_scope="stuck" marks every row but those of stuck groups) move nothing.
    def change(batch: TrainBatch) -> float:
        worker = HFPolicyWorker(LearnerSettings(model_dir=tiny_model, lr=1e-2, entropy_coeff=0.1, token_budget=96),
                                tiny_model)
        before = [p.detach().clone() for p in worker.model.parameters()]
        metrics = worker.train_step(batch)
        assert metrics["entropy_coeff"] == 0.1
        return float(sum(((p.detach() - b) ** 2).sum() for p, b in zip(worker.model.parameters(), before,
                                                                        strict=True)) ** 0.5)

    assert change(_zero_advantage_batch(entropy_bonus=True)) > 0.1
    assert change(_zero_advantage_batch(entropy_bonus=False)) == 0.0


def test_a_resumed_worker_takes_this_runs_optimizer_settings(tiny_model: Path, tmp_path: Path) -> None:
    first = HFPolicyWorker(LearnerSettings(model_dir=tiny_model, lr=1e-3, adam_eps=1e-8, token_budget=96), tiny_model)
    first.train_step(_zero_advantage_batch())
    first.save_state(tmp_path / "ckpt")
    settings = LearnerSettings(model_dir=tmp_path / "ckpt", lr=5e-4, adam_eps=1e-5, weight_decay=0.01, token_budget=96)
    resumed = HFPolicyWorker(settings, tmp_path / "ckpt")
    assert resumed.optimizer.state  # the moments came back ...
    group = resumed.optimizer.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"]) == (5e-4, 1e-5, 0.01)  # ... with this run's settings


def test_learning_rate_zero_steps_and_leaves_every_weight_as_it_was(tiny_model: Path) -> None:
    # The demo's control run: the same steps, advantages and entropy bonus as a learning run, with
    # weight decay too, and not one weight moves.
    worker = HFPolicyWorker(LearnerSettings(model_dir=tiny_model, lr=0.0, entropy_coeff=0.1, weight_decay=0.01,
                                            token_budget=96), tiny_model)
    before = [p.detach().clone() for p in worker.model.parameters()]
    data = groups(2, 4, prefix="lr0", prompt_len=20, completion_len=12)
    batch = TrainBatch([
        Row(input_ids=[*s.prompt_ids, *s.completion_ids], prompt_len=len(s.prompt_ids), loss_mask=list(s.loss_mask),
            behavior_logprobs=list(s.behavior_logprobs), advantage=1.0 if i % 2 else -1.0, entropy_bonus=True)
        for i, t in enumerate(data) for s in t.samples
    ])
    for _ in range(3):
        metrics = worker.train_step(batch)
        assert metrics["grad_norm"] > 0  # there was something to learn
    assert all(torch.equal(p.detach(), b) for p, b in zip(worker.model.parameters(), before, strict=True))
