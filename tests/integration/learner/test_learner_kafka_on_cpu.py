"""The learner against the real broker: trains, publishes, saves training states with offsets, survives a kill."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trajectories import groups

from learner.checkpoint import STATE_FILE, latest_checkpoint, serving_versions, state_folder, training_states
from learner.settings import LearnerSettings
from learner.trainer import Learner
from schemas import CheckpointV1, DeadLetterV1, decode
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.tooling import read_topic
from stream.topics import CHECKPOINTS, DEAD_LETTERS, TRAJECTORIES, TopicRegistry

pytestmark = pytest.mark.kafka


async def _events(kafka: KafkaSettings, topic: str) -> list[object]:
    return [decode(r.headers, r.value) async for r in read_topic(kafka, topic)]


async def _publish(kafka: KafkaSettings, trajectories: list) -> None:
    async with EventProducer(kafka) as producer:
        for t in trajectories:
            await producer.send(TRAJECTORIES, t)
        await producer.flush()


def _settings(tiny_model: Path, tmp_path: Path, **kw: object) -> LearnerSettings:
    base: dict[str, object] = dict(model_dir=tiny_model, checkpoint_dir=tmp_path / "ckpt", lr=3e-4,
                                   groups_per_step=1, checkpoint_every=2, batch_wait_s=0.5, token_budget=512)
    base.update(kw)
    return LearnerSettings(**base)  # type: ignore[arg-type]


async def test_learner_trains_from_kafka_and_publishes_checkpoints_with_offsets(
        topics: TopicRegistry, kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    data = groups(4, 4, prefix="a")
    await _publish(kafka_settings, data)
    # Bad input: raw bytes that are no event. It is dead-lettered, counted as consumed, and the run goes on.
    async with EventProducer(kafka_settings) as producer:
        await (await producer.send_raw(topics[TRAJECTORIES].name, b"not an event", key=b"a-0"))

    learner = Learner(_settings(tiny_model, tmp_path, max_steps=4), kafka_settings)
    async with learner:
        await asyncio.wait_for(learner.wait(), 100)
    assert learner.stats.steps == 4 and learner.stats.trained_trajectories == 16
    assert math.isfinite(learner.stats.last_metrics["loss"])
    assert 0 < learner.stats.last_metrics["is_weight_mean"] <= 2.0

    published = [e for e in await _events(kafka_settings, topics[CHECKPOINTS].name) if isinstance(e, CheckpointV1)]
    assert [c.version for c in published] == [1, 2]  # versions count publishes: 2 steps each
    last = published[-1]
    assert sum(o.offset for o in last.consumed_offsets) == 17  # 16 trajectories + the dead-lettered record
    assert all(o.topic == topics[TRAJECTORIES].name for o in last.consumed_offsets)
    folder = Path(last.uri)
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    assert not (folder / STATE_FILE).exists()  # serving weights carry nothing but what an engine loads
    assert math.isfinite(last.metrics["loss"])
    # The default policy: a training state every 10 steps and when the learner stops.
    assert sorted(training_states(tmp_path / "ckpt")) == [4]
    state = json.loads((state_folder(tmp_path / "ckpt", 4) / STATE_FILE).read_text())
    assert len(state["trained_ids"]) == 16 and state["version"] == 2
    letters = [e for e in await _events(kafka_settings, topics[DEAD_LETTERS].name) if isinstance(e, DeadLetterV1)]
    assert len(letters) == 1 and letters[0].value == b"not an event"

    # A restart resumes after the last checkpoint: nothing left to train, the model loads from it.
    again = Learner(_settings(tiny_model, tmp_path, max_steps=1, model_dir=None), kafka_settings)
    async with again:
        await asyncio.sleep(3)
        assert again.version == 2 and again.stats.steps == 0
    assert (await latest_checkpoint(kafka_settings, topics, "tiny")) == last


async def test_stale_and_infrastructure_failures_are_dropped_and_counted(
        topics: TopicRegistry, kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    from trajectories import trajectory

    fresh = groups(1, 3, prefix="f", version="0")
    mixed = [trajectory("m", 0, 3, reward=1.0), trajectory("m", 1, 3, reward=0.0),
             trajectory("m", 2, 3, infrastructure_failure=True)]
    await _publish(kafka_settings, fresh + mixed)
    settings = _settings(tiny_model, tmp_path, max_staleness=1, checkpoint_every=1)
    learner = Learner(settings.model_copy(update={"max_steps": 2}), kafka_settings)
    async with learner:
        await asyncio.wait_for(learner.wait(), 100)
    assert learner.stats.steps == 2
    assert learner.stats.dropped == {"infrastructure_failure": 1}
    assert learner.stats.last_metrics["trajectories"] in (2.0, 3.0)  # the failure left out of the statistics

    # Sampled by version 0; the resumed learner is at version 2 with a bound of 1: too old to train.
    await _publish(kafka_settings, groups(1, 3, prefix="s", version="0"))
    again = Learner(settings, kafka_settings)
    async with again:
        for _ in range(200):
            if again.stats.dropped:
                break
            await asyncio.sleep(0.1)
    assert again.version == 2 and again.stats.steps == 0
    assert again.stats.dropped == {"stale": 3}
    latest = await latest_checkpoint(kafka_settings, topics, "tiny")
    assert latest is not None and latest.version == 2
    # Drops change no weights, so no new checkpoint: a restart reads the stale group again and drops it again.
    assert sum(o.offset for o in latest.consumed_offsets) == 6


async def test_alike_groups_are_left_out_and_a_step_of_only_them_is_not_taken(
        topics: TopicRegistry, kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    from trajectories import trajectory

    # Every rollout of group "a" scored the same: zero advantages, nothing but the entropy bonus to
    # train on. It comes first; with the filter it is dropped, no step is taken, and the first step
    # trains group "m", whose rewards differ. Without the filter group "a" would make that step.
    alike = [trajectory("a", i, 3, reward=1.0) for i in range(3)]
    mixed = [trajectory("m", i, 3, reward=i / 2) for i in range(3)]
    await _publish(kafka_settings, alike + mixed)
    settings = _settings(tiny_model, tmp_path, filter_alike_groups=True, entropy_coeff=0.01, max_steps=1)
    learner = Learner(settings, kafka_settings)
    async with learner:
        await asyncio.wait_for(learner.wait(), 100)
    assert learner.stats.steps == 1
    assert learner.stats.dropped == {"alike_group": 3}
    assert learner.stats.trained_trajectories == 3
    assert learner.stats.last_metrics["reward_mean"] == 0.5  # group "m" alone


async def test_stuck_groups_get_the_bonus_and_solved_ones_are_left_out(
        topics: TopicRegistry, kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    from trajectories import trajectory

    # "a" all scored the best reward (solved: dropped, no step), "s" all scored the same below it
    # (stuck: a step of the bonus alone, on its tokens), "m" differs (a step of policy loss only:
    # its rows are out of the bonus's scope).
    solved = [trajectory("a", i, 3, reward=1.0) for i in range(3)]
    stuck = [trajectory("s", i, 3, reward=0.5) for i in range(3)]
    mixed = [trajectory("m", i, 3, reward=i / 2) for i in range(3)]
    await _publish(kafka_settings, solved + stuck + mixed)
    settings = _settings(tiny_model, tmp_path, filter_alike_groups=True, entropy_coeff=0.01, max_steps=2,
                         max_reward=1.0, entropy_bonus_scope="stuck", checkpoint_every=1)
    learner = Learner(settings, kafka_settings)
    async with learner:
        await asyncio.wait_for(learner.wait(), 100)
    assert learner.stats.steps == 2
    assert learner.stats.dropped == {"alike_group": 3}
    assert learner.stats.trained_trajectories == 6
    # The groups' order across partitions is the broker's; each step is one group.
    steps = sorted((learner.stats.first_metrics, learner.stats.last_metrics), key=lambda v: v["stuck_trajectories"])
    assert [v["stuck_trajectories"] for v in steps] == [0.0, 3.0]
    assert steps[1]["grad_norm"] > 0  # the bonus alone moved the policy


def test_a_stuck_scope_needs_the_best_reward_and_the_filter(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_reward"):
        _settings(tiny_model, tmp_path, filter_alike_groups=True, entropy_bonus_scope="stuck")
    with pytest.raises(ValueError, match="filter_alike_groups"):
        _settings(tiny_model, tmp_path, max_reward=1.0, entropy_bonus_scope="stuck")


def _run_learner(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "openforge", "learner"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def test_killed_learner_restarts_without_losing_or_repeating_a_trajectory(
        topics: TopicRegistry, kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    # A version every 2 steps, a training state every 4: killed after v3 (step 6), the restart
    # resumes from the state of step 4, trains steps 5 and 6 again from the same trajectories and
    # goes on publishing v4, so no version number names two different weights.
    data = groups(8, 4, prefix="k")
    await _publish(kafka_settings, data)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix, "OPENFORGE_KAFKA_PARTITIONS": "2",
           "OPENFORGE_LEARNER_MODEL_DIR": str(tiny_model), "OPENFORGE_LEARNER_CHECKPOINT_DIR": str(ckpt),
           "OPENFORGE_LEARNER_GROUPS_PER_STEP": "1", "OPENFORGE_LEARNER_CHECKPOINT_EVERY": "2",
           "OPENFORGE_LEARNER_STATE_EVERY": "4", "OPENFORGE_LEARNER_STATE_KEEP_LAST": "100",
           "OPENFORGE_LEARNER_LR": "3e-4", "OPENFORGE_LEARNER_BATCH_WAIT_S": "0.5",
           "OPENFORGE_LEARNER_MAX_STALENESS": "100"}  # all data was sampled by version 0
    log = tmp_path / "learner.log"

    first = _run_learner(env, log)
    deadline = time.monotonic() + 90
    while not serving_versions(ckpt).get(3):  # between two training states: kill it mid-run
        assert first.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        await asyncio.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = max(training_states(ckpt))

    second = _run_learner(env, log)
    try:
        while True:
            latest = await latest_checkpoint(kafka_settings, topics, "tiny")
            if latest is not None and sum(o.offset for o in latest.consumed_offsets) == len(data):
                break
            assert second.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
            await asyncio.sleep(0.5)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]

    published = [e for e in await _events(kafka_settings, topics[CHECKPOINTS].name) if isinstance(e, CheckpointV1)]
    versions = [c.version for c in published]
    assert versions == sorted(set(versions)), versions  # the restart continued the lineage
    assert killed_at < 8, "the first run finished before it was killed; the test proved nothing"
    assert len(versions) > 4, "the restart did not train the lost steps again"
    trained: list[str] = []
    for folder in training_states(ckpt).values():
        trained += json.loads((folder / STATE_FILE).read_text())["trained_ids"]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert sorted(trained) == sorted(t.trajectory_id for t in data), "a trajectory was lost"
