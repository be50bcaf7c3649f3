"""PPO updates on the tiny model: veRL's loss aggregation, mini-batches and epochs, and the default step.

The reference for every ``loss_agg_mode`` is veRL's own ``agg_loss`` applied to the whole step (or
mini-batch) at once: one unpadded forward per row, completions padded to the longest, veRL's
rollout correction, and the per-token PPO loss at ratio 1. The learner's step instead splits rows
of different lengths over several token-budget micro-batches, each padded to its own longest row.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from trajectories import VOCAB, groups
from transformers import AutoModelForCausalLM
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.workers import make_worker
from learner.workers.hf import HFPolicyWorker

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PROMPTS = (3, 9, 5, 14, 2, 7, 11, 4)
COMPLETIONS = (5, 17, 9, 3, 12, 20, 7, 14)
ADVANTAGES = (1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 1.7, -1.1)
BUDGET = 64  # padded tokens per micro-batch: these rows make three, of widths 14, 18 and 27


def _rows() -> list[Row]:
    rng = random.Random(44)
    rows = []
    for prompt, completion, advantage in zip(PROMPTS, COMPLETIONS, ADVANTAGES, strict=True):
        mask = [0 if k % 4 == 3 else 1 for k in range(completion)]  # context tokens inside the completion
        rows.append(Row(input_ids=[rng.randrange(VOCAB) for _ in range(prompt + completion)], prompt_len=prompt,
                        loss_mask=mask, behavior_logprobs=[-7.6 - rng.random() if k else 0.0 for k in mask],
                        advantage=advantage))
    return rows


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _verl_gradient(model_dir: Path, rows: list[Row], mode: str, scale_factor: int | None) -> list[torch.Tensor]:
    """The gradient of veRL's ``agg_loss`` over ``rows`` at once (see the module docstring)."""
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    width = max(len(r.loss_mask) for r in rows)
    completions = []
    for row in rows:
        ids = torch.tensor([row.input_ids])
        logits = model(input_ids=ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        completions.append(F.pad(logprobs[row.prompt_len - 1:], (0, width - len(row.loss_mask))))
    logprobs = torch.stack(completions)

    def padded(values: list[list[float]]) -> torch.Tensor:
        return torch.tensor([v + [0.0] * (width - len(v)) for v in values], dtype=torch.float32)

    mask = padded([[float(m) for m in r.loss_mask] for r in rows])
    advantages = padded([[r.advantage] * len(r.loss_mask) for r in rows]) * mask
    correction, mask, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=logprobs.detach(), rollout_log_prob=padded([r.behavior_logprobs for r in rows]),
        response_mask=mask, rollout_is="token", rollout_is_threshold=2.0)
    weights = correction.batch["rollout_is_weights"]
    # veRL's vanilla PPO loss per token at ratio 1 (nothing clipped): -A * ratio * importance weight.
    loss_mat = -advantages * torch.exp(logprobs - logprobs.detach()) * weights
    agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=scale_factor).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.fixture(params=["hf", "fsdp"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _worker(model: Path, engine: str, **settings: Any) -> HFPolicyWorker:
    made = make_worker(LearnerSettings(model_dir=model, engine=engine, **settings), model)  # type: ignore[arg-type]
    assert isinstance(made, HFPolicyWorker)
    return made


def _close(worker: HFPolicyWorker) -> None:
    close = getattr(worker, "close", None)
    if close is not None:
        close()


def _update_gradients(worker: HFPolicyWorker, monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """The gradient each optimizer update of the next step applies, as full tensors."""
    seen: list[list[torch.Tensor]] = []
    real = worker.optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        seen.append([_full(p.grad) for p in worker.model.parameters()])
        return real(*args, **kwargs)

    monkeypatch.setattr(worker.optimizer, "step", step)
    return seen


@pytest.mark.parametrize("mini_batches", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batched_gradient_equals_verl_agg_loss_on_the_whole_mini_batch(
        tiny_model: Path, engine: str, mode: str, mini_batches: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _rows()
    # No clipping: the gradient compared is the loss's own.
    worker = _worker(tiny_model, engine, loss_agg_mode=mode, token_budget=BUDGET, grad_clip=1e6,
                     ppo_mini_batches=mini_batches)
    try:
        seen = _update_gradients(worker, monkeypatch)
        metrics = worker.train_step(TrainBatch(rows))
    finally:
        _close(worker)
    assert metrics["updates"] == mini_batches and len(seen) == mini_batches
    assert metrics["micro_batches"] >= 3
    first = rows[:len(rows) // mini_batches]
    # One mini-batch: veRL's defaults on the whole step (its horizon is the longest completion).
    # Several: each is normalised by its own tokens and rows, with the step's longest completion
    # as the constant of seq-mean-token-sum-norm, as veRL's response length is for every mini-batch.
    reference = _verl_gradient(tiny_model, first, mode, None if mini_batches == 1 else max(COMPLETIONS))
    ours = seen[0]
    difference = sum(float((a - b).pow(2).sum()) for a, b in zip(ours, reference, strict=True)) ** 0.5
    size = sum(float(b.pow(2).sum()) for b in reference) ** 0.5
    assert size > 1e-3
    assert difference < 1e-5 * size, (difference, size)


def _golden_batch(seed: int) -> TrainBatch:
    data = groups(2, 4, prefix=f"s{seed}", prompt_len=20, completion_len=12)
    return TrainBatch([
        Row(input_ids=[*s.prompt_ids, *s.completion_ids], prompt_len=len(s.prompt_ids), loss_mask=list(s.loss_mask),
            behavior_logprobs=list(s.behavior_logprobs), advantage=(i % 4) - 1.5)
        for i, t in enumerate(data) for s in t.samples
    ])


def _weights(worker: HFPolicyWorker) -> torch.Tensor:
    return torch.cat([_full(p).flatten() for p in worker.model.parameters()]).double()


# The committed single-update step on this batch, as it was before mini-batches and epochs existed:
# (loss, grad_norm, entropy) of two steps, the norm of the weight change and its projection on a
# fixed probe. Both engines gave exactly these numbers with padded rows and full-vocabulary logits;
# packed rows and chunked logprobs sum in another order, which moves the projection (a sum of
# 1.4M terms that mostly cancel) by about 1e-5 of the change's norm and nothing else beyond 1e-6.
COMMITTED_STEPS = ((0.03224118798971176, 3.6815309524536133, 8.29195820201527),
                   (-0.06717044115066528, 3.7811567783355713, 8.292244651100852))
COMMITTED_CHANGE = (0.015255800932304948, -0.007335926319020006)


def test_the_default_settings_take_the_committed_step(tiny_model: Path, engine: str) -> None:
    worker = _worker(tiny_model, engine)
    try:
        before = _weights(worker)
        steps = [worker.train_step(_golden_batch(seed)) for seed in range(2)]
        change = _weights(worker) - before
    finally:
        _close(worker)
    for metrics, committed in zip(steps, COMMITTED_STEPS, strict=True):
        assert metrics["updates"] == 1.0 and metrics["actor/pg_clipfrac"] == 0.0
        got = (metrics["loss"], metrics["grad_norm"], metrics["entropy"])
        assert got == pytest.approx(committed, rel=1e-6)
    probe = torch.sin(torch.arange(change.numel(), dtype=torch.float64))
    assert float(change.norm()) == pytest.approx(COMMITTED_CHANGE[0], rel=1e-6)
    assert float((change * probe).sum()) == pytest.approx(COMMITTED_CHANGE[1], abs=5e-5 * COMMITTED_CHANGE[0])


@pytest.fixture
def default_step(tiny_model: Path) -> dict[str, float]:
    worker = _worker(tiny_model, "hf", lr=1e-3, clip_ratio=1e-3)
    return worker.train_step(_golden_batch(0))


@pytest.mark.parametrize(("mini_batches", "epochs"), [(2, 1), (1, 2)])
def test_later_updates_are_clipped_against_the_logprobs_from_before_the_first(
        tiny_model: Path, default_step: dict[str, float], mini_batches: int, epochs: int) -> None:
    worker = _worker(tiny_model, "hf", lr=1e-3, clip_ratio=1e-3, ppo_mini_batches=mini_batches, ppo_epochs=epochs)
    metrics = worker.train_step(_golden_batch(0))
    assert default_step["actor/pg_clipfrac"] == 0.0  # one update: the ratio is 1, nothing to clip
    assert metrics["updates"] == 2.0
    # The second update's ratio is taken against the logprobs from before the first update; had they
    # been recomputed per update it would be 1 again and nothing would be clipped.
    assert metrics["actor/pg_clipfrac"] > 0.05
    assert metrics["actor/ppo_kl"] != 0.0
    if mini_batches == 1:
        # The rollout correction is against the same proximal (pre-update) policy as one update's,
        # and the entropy reported is that policy's, however many updates follow.
        for key in ("is_weight_mean", "is_weight_min", "entropy", "rollout_corr/kl"):
            assert metrics[key] == pytest.approx(default_step[key], rel=1e-6), key


def test_more_mini_batches_than_rows_make_one_update_per_row(tiny_model: Path) -> None:
    worker = _worker(tiny_model, "hf", ppo_mini_batches=50)
    metrics = worker.train_step(TrainBatch(_rows()[:3]))
    assert metrics["updates"] == 3.0 and metrics["nonfinite"] == 0.0


def test_ppo_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_LEARNER_PPO_MINI_BATCHES", "4")
    monkeypatch.setenv("OPENFORGE_LEARNER_PPO_EPOCHS", "2")
    settings = LearnerSettings()
    assert (settings.ppo_mini_batches, settings.ppo_epochs) == (4, 2)
    assert (LearnerSettings.model_fields["ppo_mini_batches"].default,
            LearnerSettings.model_fields["ppo_epochs"].default) == (1, 1)


