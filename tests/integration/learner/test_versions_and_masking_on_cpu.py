"""The trainer's version, staleness and skip rules, with the real ``hf`` worker on the tiny model.

Versions count publishes (one per checkpoint), stale tokens are masked rather than whole
trajectories dropped, and a step the worker skips (non-finite loss or gradient) advances nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from trajectories import trajectory

from learner.checkpoint import serving_folder, serving_versions
from learner.protocol import TrainBatch
from learner.settings import LearnerSettings
from learner.sources import ListTrajectorySource
from learner.trainer import Learner
from learner.workers import PolicyWorker, make_worker
from schemas import TrajectoryV1
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import TRAJECTORIES, TopicRegistry


def _settings(tiny_model: Path, tmp_path: Path, **kw: Any) -> LearnerSettings:
    base: dict[str, Any] = dict(model_dir=tiny_model, checkpoint_dir=tmp_path / "ckpt", lr=3e-4, groups_per_step=1,
                                checkpoint_every=1, batch_wait_s=0.1, token_budget=512)
    return LearnerSettings(**{**base, **kw})


def _group(task: str, version: str | None, size: int = 2) -> list[TrajectoryV1]:
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
    assert [Path(str(c)) for c in learner.stats.checkpoints] == [
        serving_folder(tmp_path / "ckpt", v) for v in (1, 2, 3)]
    assert learner.stats.dropped == {"stale": 1}
    half = sum(mixed[0].samples[0].loss_mask.to_bytes()[:8])
    assert learner.stats.stale_tokens == half > 0
    last = learner.stats.last_metrics
    assert last["trajectories"] == 2.0 and last["stale_tokens"] == half
    assert last["staleness_max"] == 1.0  # the oldest token still trained: version 1 under version 2


async def test_trajectories_without_versions_that_went_stale_say_why(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # One step publishes version 1; with a bound of 0, trajectories whose engine reported no
    # version count as version 0 and are dropped, and the error names the cause once.
    data = _group("a", "0") + _group("b", None) + _group("c", None)
    learner = Learner(_settings(tiny_model, tmp_path, max_staleness=0), source=ListTrajectorySource(data))
    await _run(learner)

    assert learner.stats.steps == 1 and learner.stats.dropped == {"stale": 4}
    said = [r for r in caplog.records if "carries no weight version" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "ERROR"
    assert "--enable-scale-out" in said[0].getMessage()


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

    def save_serving(self, folder: Path) -> None:
        self._real.save_serving(folder)

    def save_state(self, folder: Path) -> None:
        self._real.save_state(folder)

    def importance_weights(self) -> Sequence[float]:
        return self._real.importance_weights()


async def test_a_skipped_step_bumps_no_version_writes_no_checkpoint_and_drops_its_trajectories(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    made: list[NonFiniteOnceStandInWorker] = []

    def worker(settings: LearnerSettings, model_dir: Path) -> PolicyWorker:
        made.append(NonFiniteOnceStandInWorker(make_worker(settings, model_dir), skip_call=2))
        return made[0]

    data = _group("a", "0") + _group("b", "0") + _group("c", "0")
    learner = Learner(_settings(tiny_model, tmp_path), source=ListTrajectorySource(data), worker=worker)
    await _run(learner)

    assert made[0].calls == 3
    assert learner.stats.steps == 2 and learner.stats.skipped_steps == 1
    assert learner.version == 2 and learner.step == 2
    # One folder per real step: versions 1 and 2, none from the skipped one.
    assert sorted(serving_versions(tmp_path / "ckpt")) == [1, 2]
    assert learner.stats.dropped == {"nonfinite_step": 2}
    assert math.isfinite(learner.stats.last_metrics["loss"])
    assert any("step skipped" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


class Clock:
    """The learner's clock, moved by the test: minutes pass without waiting for them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s * 10)):
        if condition():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.kafka
async def test_members_minutes_apart_stay_one_group_and_a_late_one_never_starts_another(
        topics: TopicRegistry, kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    def member(task: str, index: int, timeout_s: float) -> TrajectoryV1:
        return trajectory(task, index, 3, reward=float(index)).model_copy(update={"timeout_s": timeout_s})

    clock = Clock()
    settings = _settings(tiny_model, tmp_path, checkpoint_every=100, group_grace_s=30.0, batch_wait_s=1.0)
    async with EventProducer(kafka_settings) as producer, Learner(settings, kafka_settings, clock=clock) as learner:
        async def arrive(t: TrajectoryV1, groups_after: int) -> None:
            read = learner.stats.trained_trajectories + sum(learner.stats.dropped.values())
            await producer.send(TRAJECTORIES, t)
            await producer.flush()
            await _until(lambda: learner.open_groups == groups_after or
                         learner.stats.trained_trajectories + sum(learner.stats.dropped.values()) > read,
                         f"the learner to take {t.trajectory_id}")

        # A task with a 10-minute timeout: members 4 and 9 minutes after the first stay in its group.
        await arrive(member("slow", 0, 600.0), 1)
        clock.now += 240
        await arrive(member("slow", 1, 600.0), 1)
        clock.now += 300
        await asyncio.sleep(0.5)  # the loop looks at deadlines several times a second
        assert learner.open_groups == 1 and learner.stats.steps == 0
        await arrive(member("slow", 2, 600.0), 0)
        await _until(lambda: learner.stats.steps == 1, "the complete group's step")
        assert learner.stats.last_metrics["trajectories"] == 3 and learner.stats.short_groups == {}

        # A task with a 1-minute timeout: past first arrival + 60 s + 30 s grace its group is released
        # short (one usable member: dropped by min_group_size), and a member arriving later is late.
        await arrive(member("quick", 0, 60.0), 1)
        clock.now += 89
        await asyncio.sleep(0.5)
        assert learner.open_groups == 1
        clock.now += 1
        await _until(lambda: learner.open_groups == 0, "the deadline")
        await _until(lambda: learner.stats.short_groups == {"dropped": 1}, "the short group's outcome")
        await arrive(member("quick", 1, 60.0), 0)
        await _until(lambda: learner.stats.dropped.get("late_member") == 1, "the late member's drop")
        assert learner.open_groups == 0 and learner.stats.dropped == {"small_group": 1, "late_member": 1}
        assert learner.stats.steps == 1
