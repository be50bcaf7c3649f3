"""The whole loop, as real processes, keeps training at the learner's own settings.

Once with the learner's defaults, once with the learner settings the Helm chart renders: for at
least 30 learner steps weight versions keep advancing, every one reaches the engine, and the
data trained stays within the staleness bound. Nothing the test sets changes how the learner
trains or bounds staleness; only tiny answers and small groups keep it fast.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from loop import Loop, running_loop, tasks

from learner.settings import LearnerSettings
from schemas import CheckpointAppliedV1, CheckpointV1, LearnerProgressV1, TrajectoryV1
from stream import (
    CHECKPOINTS,
    TASKS,
    TRAJECTORIES,
    EventConsumer,
    EventProducer,
    KafkaSettings,
    Received,
    TopicRegistry,
)

pytestmark = pytest.mark.kafka

STEPS = 30
STALL_S = 300.0
"""No learner step for this long while tasks wait is a stall (a step needs a few seconds here)."""
CHART_TEST_HELPERS = str(Path(__file__).resolve().parents[2] / "helm")  # render the chart as its tests do
# Learner settings that say where, not how: the model, its name and folders, the device and engine
# of the chart's GPU nodes. Everything else the chart renders for the learner is kept.
DEPLOYMENT_ONLY = {"OPENFORGE_LEARNER_MODEL_DIR", "OPENFORGE_LEARNER_MODEL_NAME", "OPENFORGE_LEARNER_CHECKPOINT_DIR",
                   "OPENFORGE_LEARNER_DEVICE", "OPENFORGE_LEARNER_ENGINE"}


@dataclass
class Seen:
    checkpoints: list[CheckpointV1] = field(default_factory=list)
    applied: list[int] = field(default_factory=list)
    progress: list[LearnerProgressV1] = field(default_factory=list)
    sampled_by: list[int] = field(default_factory=list)
    """Newest weight version of each trajectory's tokens."""

    async def handle(self, received: Received) -> None:
        event = received.event
        if isinstance(event, CheckpointV1):
            self.checkpoints.append(event)
        elif isinstance(event, CheckpointAppliedV1) and event.ok:
            self.applied.append(event.version)
        elif isinstance(event, LearnerProgressV1):
            self.progress.append(event)
        elif isinstance(event, TrajectoryV1):
            versions = [int(r.version) for s in event.samples for r in s.weight_versions if r.version.isdecimal()]
            self.sampled_by.append(max(versions, default=0))

    def steps(self) -> int:
        return max([c.step for c in self.checkpoints] + [p.step for p in self.progress], default=0)


async def _train_for(loop: Loop, kafka: KafkaSettings, steps: int, deadline_s: float) -> Seen:
    seen = Seen()
    run_id = f"loop-{uuid.uuid4().hex[:6]}"
    async with EventConsumer([CHECKPOINTS, TRAJECTORIES], seen.handle, group_id=f"{run_id}-watch", kafka=kafka):
        async with EventProducer(kafka) as producer:
            for task in tasks(400, group_size=2, run_id=run_id):
                await producer.send(TASKS, task)
            await producer.flush()
        deadline = time.monotonic() + deadline_s
        last, since = 0, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < STALL_S:
            loop.check()
            if seen.steps() >= steps and any(c.step >= steps for c in seen.checkpoints):
                break
            if seen.steps() > last:
                last, since = seen.steps(), time.monotonic()
            await asyncio.sleep(1.0)
        assert seen.steps() >= steps, (
            f"the learner stopped at step {seen.steps()} ({time.monotonic() - since:.0f}s without a step); "
            f"versions published {[c.version for c in seen.checkpoints]}\n{loop.log('learner')[-3000:]}")
    return seen


def _judge(seen: Seen, settings: LearnerSettings) -> None:
    versions = [c.version for c in seen.checkpoints]
    # Versions count publishes: one per checkpoint, every checkpoint_every steps.
    assert versions == list(range(1, len(versions) + 1)), versions
    assert [c.step for c in seen.checkpoints] == [settings.checkpoint_every * v for v in versions]
    assert len(versions) >= STEPS // settings.checkpoint_every
    assert max(seen.applied, default=0) >= 2, f"the engine never served the new weights: {seen.applied}"
    assert max(seen.sampled_by, default=0) >= 2, "no rollout was sampled by weights the learner published"
    for checkpoint in seen.checkpoints:
        assert checkpoint.metrics["staleness_max"] <= settings.max_staleness, checkpoint.metrics
        assert checkpoint.metrics["trajectories"] > 0
    # Nothing was too old to train, not even a token: the launcher paced what the learner could take.
    totals = seen.checkpoints[-1].metrics
    assert totals["stale_tokens_total"] == 0 and "dropped_stale" not in totals, totals


@pytest.mark.timeout(1800)
async def test_the_loop_keeps_training_with_the_learners_defaults(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    with running_loop(kafka_settings, tmp_path, learner_env={}) as loop:
        seen = await _train_for(loop, kafka_settings, STEPS, deadline_s=1200)
    _judge(seen, LearnerSettings())


@pytest.mark.timeout(1800)
async def test_the_loop_keeps_training_with_the_settings_the_chart_renders(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    sys.path.insert(0, CHART_TEST_HELPERS)
    from helm_chart import Helm, env_of, install_helm, one

    objects = Helm(install_helm()).render(None, tmp_path / "values")
    chart_env = {k: v for k, v in env_of(one(objects, "Deployment", "-learner")).items()
                 if k.startswith("OPENFORGE_LEARNER_") and k not in DEPLOYMENT_ONLY}
    assert "OPENFORGE_LEARNER_MAX_STALENESS" in chart_env, chart_env
    with running_loop(kafka_settings, tmp_path, learner_env=chart_env) as loop:
        seen = await _train_for(loop, kafka_settings, STEPS, deadline_s=1200)
    settings = LearnerSettings.model_validate({k.removeprefix("OPENFORGE_LEARNER_").lower(): v
                                               for k, v in chart_env.items()})
    _judge(seen, settings)
