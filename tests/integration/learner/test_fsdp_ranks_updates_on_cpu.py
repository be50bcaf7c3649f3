"""Several PPO updates per step, and a skipped one, on two ``fsdp`` ranks under torchrun (CPU, gloo).

This file is also the ranks' program: torchrun runs it as a script. Each rank takes a step of
three mini-batches times two epochs on rows that leave rank 1 with nothing to train in the last
mini-batch (it runs zero-weighted passes, since every forward and backward is collective). Then a
NaN is injected into rank 1's loss alone: both ranks must skip, or rank 0 would step while rank 1
did not and their shards of the weights would disagree.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings

# One torchrun launch (torch and veRL imported on two ranks) and a one-process reference.
pytestmark = pytest.mark.timeout(300)

# As in test_fsdp_ranks_on_cpu.py, two ranks and one process differ only by the order of float sums,
# which AdamW magnifies in a few near-zero gradients (measured after the step's six updates: at most
# 1.1e-5, 24 of 1.4M weights above 1e-6, a mean of 3e-6 times the mean distance the weights moved).
MAX_TOLERANCE = 5e-5
MEAN_TOLERANCE = 1e-4  # of the mean distance moved


def _settings(model: Path) -> LearnerSettings:
    return LearnerSettings(model_dir=model, engine="fsdp", lr=1e-3, token_budget=64, ppo_mini_batches=3,
                           ppo_epochs=2)


def _batch() -> TrainBatch:
    # Five rows make mini-batches of 2, 2 and 1 rows: in the last one rank 1 has no row.
    rng = random.Random(7)
    rows = []
    for i, (prompt, completion) in enumerate([(4, 9), (11, 5), (3, 16), (8, 8), (6, 13)]):
        rows.append(Row(input_ids=[rng.randrange(4096) for _ in range(prompt + completion)], prompt_len=prompt,
                        loss_mask=[1] * completion, behavior_logprobs=[-8.0 - rng.random() for _ in range(completion)],
                        advantage=(-1.0) ** i * (0.5 + i / 4)))
    return TrainBatch(rows)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _rank_main(model: Path, out: Path) -> None:
    from learner.workers.fsdp import FSDPPolicyWorker

    worker = FSDPPolicyWorker(_settings(model), model)
    report: dict[str, Any] = {"steps": [worker.train_step(_batch())]}
    worker.save_serving(out / "weights")
    shards = [_local(p) for p in worker.model.parameters()]
    moments = [_local(s["exp_avg"]) for s in (worker.optimizer.state[p] for p in worker.model.parameters())]
    if worker.rank == 1:
        real = worker._loss_fn
        calls = 0

        def poisoned(**kwargs: Any) -> Any:
            nonlocal calls
            loss, metrics = real(**kwargs)
            calls += 1
            return (loss * float("nan") if calls == 1 else loss), metrics

        worker._loss_fn = poisoned  # type: ignore[method-assign]
    # One mini-batch and epoch for this step: a single update, poisoned on rank 1 only.
    worker.settings = worker.settings.model_copy(update={"ppo_mini_batches": 1, "ppo_epochs": 1})
    report["poisoned"] = worker.train_step(_batch())
    report["unchanged"] = all(torch.equal(a, _local(p)) for a, p in zip(shards, worker.model.parameters(), strict=True))
    report["moments_unchanged"] = all(
        torch.equal(a, _local(worker.optimizer.state[p]["exp_avg"]))
        for a, p in zip(moments, worker.model.parameters(), strict=True))
    (out / f"rank{worker.rank}.json").write_text(json.dumps(report))
    worker.close()


def test_two_ranks_take_the_one_process_updates_and_skip_a_nonfinite_update_together(
        tiny_model: Path, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          __file__, str(tiny_model), str(tmp_path)], env=env, capture_output=True, timeout=240,
                         check=False)
    assert run.returncode == 0, run.stdout.decode()[-3000:] + run.stderr.decode()[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        for step in report["steps"]:
            assert step["updates"] == 6.0 and step["nonfinite"] == 0.0 and math.isfinite(step["loss"])
        assert report["poisoned"]["nonfinite"] == 1.0 and report["poisoned"]["updates"] == 0.0
        assert math.isnan(report["poisoned"]["grad_norm"])
        assert report["unchanged"] and report["moments_unchanged"]
    # The clipping acted on both ranks' shares of the later updates.
    assert all(r["steps"][0]["actor/pg_clipfrac"] > 0 for r in reports)

    from safetensors.torch import load_file

    from learner.workers.fsdp import FSDPPolicyWorker

    single = FSDPPolicyWorker(_settings(tiny_model), tiny_model)
    try:
        single.train_step(_batch())
        single.save_serving(tmp_path / "single")
    finally:
        single.close()
    ranks, one = load_file(str(tmp_path / "weights" / "model.safetensors")), load_file(
        str(tmp_path / "single" / "model.safetensors"))
    initial = load_file(str(tiny_model / "model.safetensors"))
    differences = torch.cat([(ranks[k] - one[k]).abs().flatten() for k in one])
    moved = torch.cat([(one[k] - initial[k]).abs().flatten() for k in one])
    assert float(moved.max()) > 20 * MAX_TOLERANCE  # the step moved weights far more than the tolerance
    assert float(differences.max()) < MAX_TOLERANCE
    assert float(differences.mean()) < MEAN_TOLERANCE * float(moved.mean())


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), Path(sys.argv[2]))
