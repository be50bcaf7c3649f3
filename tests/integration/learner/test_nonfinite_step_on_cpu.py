"""A non-finite loss or gradient skips the update on both engines, and the next step trains normally.

The non-finite value is injected by wrapping the worker's policy loss for one call (a NaN times the
loss, which makes the gradients NaN too, or an infinite constant added to it, which leaves them
finite and is caught by the loss alone); everything else is the real step on the tiny model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from trajectories import groups

from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.workers import make_worker
from learner.workers.hf import HFPolicyWorker

INJECTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "nan": lambda loss: loss * float("nan"),
    "inf": lambda loss: loss + float("inf"),
}


def _batch(seed: int) -> TrainBatch:
    data = groups(2, 4, prefix=f"nf{seed}", prompt_len=20, completion_len=12)
    return TrainBatch([
        Row(input_ids=[*s.prompt_ids, *s.completion_ids], prompt_len=len(s.prompt_ids), loss_mask=list(s.loss_mask),
            behavior_logprobs=list(s.behavior_logprobs), advantage=(i % 4) - 1.5)
        for i, t in enumerate(data) for s in t.samples
    ])


@pytest.fixture(params=["hf", "fsdp"])
def worker(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[HFPolicyWorker]:
    settings = LearnerSettings(model_dir=tiny_model, engine=request.param, lr=1e-3, token_budget=96)
    made = make_worker(settings, tiny_model)
    assert isinstance(made, HFPolicyWorker)
    try:
        yield made
    finally:
        close = getattr(made, "close", None)
        if close is not None:
            close()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _snapshot(worker: HFPolicyWorker) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = [_local(p) for p in worker.model.parameters()]
    state = [{k: _local(v) for k, v in worker.optimizer.state[p].items()} for p in worker.model.parameters()]
    return params, state


def _assert_identical(a: tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]],
                      b: tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]) -> None:
    for before, after in zip(a[0], b[0], strict=True):
        assert torch.equal(before, after)
    for before_state, after_state in zip(a[1], b[1], strict=True):
        assert before_state.keys() == after_state.keys() and before_state  # AdamW has moments after step 1
        for key in before_state:
            assert torch.equal(before_state[key], after_state[key]), key


def _inject_once(worker: HFPolicyWorker, monkeypatch: pytest.MonkeyPatch, injection: str, *,
                 at_call: int = 0) -> None:
    real = worker._loss_fn
    calls = 0

    def loss_fn(**kwargs: Any) -> Any:
        nonlocal calls
        loss, metrics = real(**kwargs)
        calls += 1
        return (INJECTIONS[injection](loss) if calls == at_call + 1 else loss), metrics

    monkeypatch.setattr(worker, "_loss_fn", loss_fn)


@pytest.mark.parametrize("injection", sorted(INJECTIONS))
def test_a_nonfinite_loss_leaves_weights_and_optimizer_bit_identical_and_the_next_step_trains(
        worker: HFPolicyWorker, injection: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = worker.train_step(_batch(0))
    assert first["nonfinite"] == 0.0 and first["updates"] == 1.0
    before = _snapshot(worker)

    with monkeypatch.context() as patch:
        _inject_once(worker, patch, injection)
        skipped = worker.train_step(_batch(1))
    assert skipped["micro_batches"] > 1  # one poisoned micro-batch among several spoils the sum
    assert skipped["nonfinite"] == 1.0 and skipped["updates"] == 0.0 and skipped["nonfinite_updates"] == 1.0
    assert not math.isfinite(skipped["loss"])
    assert "grad_norm" in skipped  # kept even when it is NaN
    if injection == "nan":
        assert math.isnan(skipped["grad_norm"])
    else:
        assert math.isfinite(skipped["grad_norm"])  # caught by the loss alone
    _assert_identical(before, _snapshot(worker))
    assert all(p.grad is None for p in worker.model.parameters())

    after = worker.train_step(_batch(1))
    assert after["nonfinite"] == 0.0 and after["updates"] == 1.0
    assert math.isfinite(after["loss"]) and math.isfinite(after["grad_norm"])
    assert not torch.equal(before[0][0], _local(next(iter(worker.model.parameters()))))


def test_a_nonfinite_update_among_several_skips_only_that_update(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = LearnerSettings(model_dir=tiny_model, lr=1e-3, ppo_mini_batches=2)
    worker = HFPolicyWorker(settings, tiny_model)
    # One micro-batch per update (the default budget holds each half): the second call is the second update.
    _inject_once(worker, monkeypatch, "nan", at_call=1)
    metrics = worker.train_step(_batch(0))
    assert metrics["updates"] == 1.0 and metrics["nonfinite_updates"] == 1.0
    assert metrics["nonfinite"] == 0.0  # the weights moved: the step counts as taken
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["grad_norm"])  # means over the updates
