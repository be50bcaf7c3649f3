"""The ``fsdp`` worker against the ``hf`` worker, on CPU: real torch FSDP2 (gloo, float32) on the tiny model.

Nothing is faked: the model is built on the meta device, sharded with ``fully_shard`` on a
one-process gloo group and filled from the safetensors shard by shard; gradients are clipped with
veRL's ``fsdp2_clip_grad_norm_``; serving weights are gathered tensor by tensor and the training
state is a torch distributed checkpoint. Only the device is the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trajectories import groups

from consumers.checkpoint_files import read_layout
from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.sources import ListTrajectorySource
from learner.trainer import Learner
from learner.workers import make_worker
from learner.workers.fsdp import FSDPPolicyWorker
from learner.workers.hf import HFPolicyWorker
from learner.workers.weights import TRAINING_STATE_DIR

COMPARED = ("loss", "grad_norm", "entropy", "pg_clipfrac", "is_weight_mean", "micro_batches")


def _batch(seed: int) -> TrainBatch:
    data = groups(2, 4, prefix=f"s{seed}", prompt_len=20, completion_len=12)
    return TrainBatch([
        Row(input_ids=[*s.prompt_ids, *s.completion_ids], prompt_len=len(s.prompt_ids), loss_mask=list(s.loss_mask),
            behavior_logprobs=list(s.behavior_logprobs), advantage=(i % 4) - 1.5)
        for i, t in enumerate(data) for s in t.samples
    ])


def _settings(model: Path, engine: str) -> LearnerSettings:
    # A budget smaller than the batch: several micro-batches accumulate into one step.
    return LearnerSettings(model_dir=model, engine=engine, lr=1e-3, token_budget=96)  # type: ignore[arg-type]


@pytest.fixture
def workers(tiny_model: Path) -> Iterator[tuple[HFPolicyWorker, FSDPPolicyWorker]]:
    hf = HFPolicyWorker(_settings(tiny_model, "hf"), tiny_model)
    fsdp = make_worker(_settings(tiny_model, "fsdp"), tiny_model)
    assert isinstance(fsdp, FSDPPolicyWorker)
    try:
        yield hf, fsdp
    finally:
        fsdp.close()


def _assert_same_step(a: dict[str, float], b: dict[str, float]) -> None:
    assert a["micro_batches"] > 1
    for key in COMPARED:
        if key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_fsdp_worker_is_sharded_and_takes_the_hf_workers_step(
        workers: tuple[HFPolicyWorker, FSDPPolicyWorker], tmp_path: Path) -> None:
    hf, fsdp = workers
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(fsdp.model, FSDPModule)
    assert sum(isinstance(m, FSDPModule) for m in fsdp.model.modules()) > 2  # layers sharded one by one
    for seed in range(2):
        batch = _batch(seed)
        _assert_same_step(hf.train_step(batch), fsdp.train_step(batch))
    hf.save_serving(tmp_path / "hf")
    fsdp.save_serving(tmp_path / "fsdp")
    # Two AdamW steps at lr 1e-3 moved the weights by ~2e-3; the engines agree far below that.
    assert _max_weight_diff(tmp_path / "hf", tmp_path / "fsdp") < 1e-6


def test_fsdp_checkpoint_has_the_reference_layout_and_loads_in_transformers(
        workers: tuple[HFPolicyWorker, FSDPPolicyWorker], tiny_model: Path, tmp_path: Path) -> None:
    hf, fsdp = workers
    fsdp.train_step(_batch(0))
    fsdp.save_serving(tmp_path / "fsdp")
    hf.save_serving(tmp_path / "hf")
    reference = read_layout(tiny_model)
    assert read_layout(tmp_path / "fsdp", reference) == read_layout(tmp_path / "hf", reference)
    assert {p.name for p in (tmp_path / "fsdp").iterdir()} == {p.name for p in (tmp_path / "hf").iterdir()}
    # What an engine loads and nothing else: no optimizer state, no learner state.
    assert {p.name for p in (tmp_path / "fsdp").iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert not (tmp_path / "fsdp" / TRAINING_STATE_DIR).exists()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp", dtype=torch.float32)
    trained = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    initial = load_file(str(tiny_model / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded.state_dict()[name], trained[name])
    assert not torch.equal(trained[name], initial[name])  # the step changed the weights


def test_fsdp_resumes_from_its_own_and_from_hf_training_state(
        workers: tuple[HFPolicyWorker, FSDPPolicyWorker], tmp_path: Path) -> None:
    hf, fsdp = workers
    first = _batch(0)
    hf.train_step(first)
    fsdp.train_step(first)
    hf.save_state(tmp_path / "hf")
    fsdp.save_state(tmp_path / "fsdp")
    second = _batch(1)
    reference = HFPolicyWorker(hf.settings, tmp_path / "hf").train_step(second)
    # Master weights and AdamW's moments travel either way: a resumed step equals an uninterrupted one.
    for folder in ("fsdp", "hf"):
        resumed = FSDPPolicyWorker(fsdp.settings, tmp_path / folder)
        _assert_same_step(reference, resumed.train_step(second))
        resumed.close()


async def test_learner_runs_steps_and_checkpoints_with_the_fsdp_engine(tiny_model: Path, tmp_path: Path) -> None:
    settings = LearnerSettings(model_dir=tiny_model, engine="fsdp", checkpoint_dir=tmp_path, lr=1e-4,
                               groups_per_step=2, checkpoint_every=2, max_steps=2, batch_wait_s=1.0)
    learner = Learner(settings, source=ListTrajectorySource(groups(4, 4)))
    async with learner:
        await learner.wait()
    assert learner.stats.steps == 2
    assert math.isfinite(learner.stats.last_metrics["loss"])
    (folder,) = learner.stats.checkpoints
    assert isinstance(folder, Path) and read_layout(folder, read_layout(tiny_model))


def test_unsupported_device_is_refused_with_the_reason(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="fsdp engine runs on cpu or cuda, not 'meta'"):
        FSDPPolicyWorker(_settings(tiny_model, "fsdp").model_copy(update={"device": "meta"}), tiny_model)
