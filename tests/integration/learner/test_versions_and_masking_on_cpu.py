"""The trainer's version, staleness and skip rules, with the real ``hf`` worker on the tiny model.

Versions count publishes (one per checkpoint), stale tokens are masked rather than whole
trajectories dropped, and a step the worker skips (non-finite loss or gradient) advances nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from trajectories import trajectory

import learner.trainer as trainer_module
from learner.checkpoint import checkpoint_folder
from learner.protocol import TrainBatch
from learner.settings import LearnerSettings
from learner.sources import ListTrajectorySource
from learner.trainer import Learner
from learner.workers import PolicyWorker, make_worker
from schemas import TrajectoryV1


def _settings(tiny_model: Path, tmp_path: Path, **kw: Any) -> LearnerSettings:
    base: dict[str, Any] = dict(model_dir=tiny_model, checkpoint_dir=tmp_path / "ckpt", lr=3e-4, groups_per_step=1,
                                checkpoint_every=1, batch_wait_s=0.1, token_budget=512)
    return LearnerSettings(**{**base, **kw})


def _group(task: str, version: str, size: int = 2) -> list[TrajectoryV1]:
    return [trajectory(task, i, size, reward=float(i), version=version) for i in range(size)]


def _split(t: TrajectoryV1, old: str, new: str) -> TrajectoryV1:
    """``t`` with the first half of its completion sampled by ``old`` and the rest by ``new``."""
    sample = t.samples[0].model_dump()
    half = len(t.samples[0].completion_ids) // 2
    sample["weight_versions"] = [{"version": old, "start": 0, "end": half},
                                 {"version": new, "start": half, "end": len(t.samples[0].completion_ids)}]
    return TrajectoryV1.model_validate({**t.model_dump(), "samples": [sample]})


async def _run(learner: Learner) -> None:
    async with learner:
        await asyncio.wait_for(learner.wait(), 120)


async def test_versions_count_publishes_and_stale_tokens_are_masked_not_their_trajectory(
        tiny_model: Path, tmp_path: Path) -> None:
    # Two steps of version-0 data publish versions 1 and 2 (a checkpoint every step). Then, with a
    # bound of 1, a trajectory half sampled by version 0 (age 2) and half by 2 keeps its fresh half,
    # one sampled wholly by version 0 is dropped, and its group still trains (two usable members).
    mixed = [_split(trajectory("m", 0, 3, reward=1.0, version="0"), "0", "2"),
             trajectory("m", 1, 3, reward=0.0, version="0"),
             trajectory("m", 2, 3, reward=0.5, version="1")]
    data = _group("a", "0") + _group("b", "0") + mixed
    learner = Learner(_settings(tiny_model, tmp_path, max_staleness=1), source=ListTrajectorySource(data))
    await _run(learner)

    assert learner.stats.steps == 3 and learner.version == 3
    assert [Path(str(c)).name for c in learner.stats.checkpoints] == [
        checkpoint_folder(tmp_path / "ckpt", v).name for v in (1, 2, 3)]
    assert learner.stats.dropped == {"stale": 1}
    half = sum(mixed[0].samples[0].loss_mask.to_bytes()[:8])
    assert learner.stats.stale_tokens == half > 0
    last = learner.stats.last_metrics
    assert last["trajectories"] == 2.0 and last["stale_tokens"] == half
    assert last["staleness_max"] == 1.0  # the oldest token still trained: version 1 under version 2


class NonFiniteOnceStandInWorker:
    """The real ``hf`` worker, except that one chosen step reports a non-finite loss and is skipped.

    A stand-in for the worker's own guard: it answers exactly what the worker answers when the loss
    or gradient is not finite (``nonfinite`` 1.0, the optimizer untouched) without training.
    """

    def __init__(self, real: PolicyWorker, skip_call: int) -> None:
        self._real = real
        self._skip_call = skip_call
        self.calls = 0

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.calls += 1
        if self.calls == self._skip_call:
            return {"loss": math.nan, "grad_norm": math.nan, "nonfinite": 1.0}
        return self._real.train_step(batch)

    def save(self, folder: Path) -> None:
        self._real.save(folder)

    def importance_weights(self) -> Sequence[float]:
        return self._real.importance_weights()


async def test_a_skipped_step_bumps_no_version_writes_no_checkpoint_and_drops_its_trajectories(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    made: list[NonFiniteOnceStandInWorker] = []

    def worker(settings: LearnerSettings, model_dir: Path) -> PolicyWorker:
        made.append(NonFiniteOnceStandInWorker(make_worker(settings, model_dir), skip_call=2))
        return made[0]

    monkeypatch.setattr(trainer_module, "make_worker", worker)
    data = _group("a", "0") + _group("b", "0") + _group("c", "0")
    learner = Learner(_settings(tiny_model, tmp_path), source=ListTrajectorySource(data))
    await _run(learner)

    assert made[0].calls == 3
    assert learner.stats.steps == 2 and learner.stats.skipped_steps == 1
    assert learner.version == 2 and learner.step == 2
    # One folder per real step: versions 1 and 2, none from the skipped one.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        checkpoint_folder(tmp_path / "ckpt", v).name for v in (1, 2)]
    assert learner.stats.dropped == {"nonfinite_step": 2}
    assert math.isfinite(learner.stats.last_metrics["loss"])
    assert any("step skipped" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
