"""The ``fsdp`` learner as two ranks under torchrun, on CPU (gloo), against the real broker.

Rank 0 alone reads the trajectories and publishes checkpoints; rank 1 holds half of the model and
follows rank 0's orders. Checked here: every checkpoint event is published once and its folder
written once, each rank writes its shards of the training state, the weights equal a one-process
run's on the same batches, SIGTERM to torchrun drains (a final publish and training state) and
ends every process in bounded time, and a restart resumes from the newest training state, stays up while idle past the collective timeout (rank 0's
keep-alives) and ends cleanly by itself (``max_steps``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trajectories import groups

from learner.checkpoint import STATE_FILE, serving_folder, serving_versions, state_folder, training_states
from learner.settings import LearnerSettings
from learner.sources import ListTrajectorySource
from learner.trainer import Learner
from schemas import CheckpointV1, TrajectoryV1, decode
from stream.admin import KafkaAdmin
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.tooling import read_topic
from stream.topics import CHECKPOINTS, TRAJECTORIES, TopicRegistry

# Two torchrun launches (each imports torch and veRL on two ranks) and a reference run: more than the default.
pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

GROUPS_PER_STEP = 2
# Same settings for both runs; a large lr so the comparison's tolerance is far below what a step moves.
SETTINGS = {"LR": "1e-3", "GROUPS_PER_STEP": str(GROUPS_PER_STEP), "CHECKPOINT_EVERY": "2", "STATE_EVERY": "2",
            "MAX_STALENESS": "100", "BATCH_WAIT_S": "60", "TOKEN_BUDGET": "96"}
# Weights of two ranks and of one process differ only by the order of float sums (gradient
# reduction, clipping norm). Three AdamW steps at lr 1e-3 move every weight by up to 3e-3; AdamW
# divides each gradient by its own running magnitude, so a rounding difference in a gradient
# near zero can become a visible one in a few weights (measured: a few dozen of 1.4M differ by
# more than 1e-6, at most by 5.1e-5 after the fourth step) while the mean difference stays at
# rounding level (~2e-9). The bound stays 40 times below what the steps move.
MAX_TOLERANCE = 1e-4
MEAN_TOLERANCE = 1e-8


async def _checkpoints(kafka: KafkaSettings, registry: TopicRegistry) -> list[CheckpointV1]:
    events = [decode(r.headers, r.value) async for r in read_topic(kafka, registry[CHECKPOINTS].name)]
    return [e for e in events if isinstance(e, CheckpointV1)]


async def _publish(kafka: KafkaSettings, trajectories: list[TrajectoryV1]) -> None:
    async with EventProducer(kafka) as producer:
        for t in trajectories:
            await producer.send(TRAJECTORIES, t)
        await producer.flush()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _torchrun(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 "-m", "openforge", "learner"], env=env, stdout=out, stderr=subprocess.STDOUT)


def _end(proc: subprocess.Popen[bytes], workers: list[int]) -> None:
    """Leave nothing running whatever failed (torchrun starts its workers in sessions of their own)."""
    for pid in [proc.pid, *workers]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _reference(tiny_model: Path, folder: Path, data: list[TrajectoryV1], steps: int) -> Path:
    """One process (world size 1), same engine, seed and batches; a checkpoint after every step."""
    settings = LearnerSettings(model_dir=tiny_model, engine="fsdp", checkpoint_dir=folder, checkpoint_every=1,
                               serving_keep_last=10,
                               **{k.lower(): v for k, v in SETTINGS.items() if k != "CHECKPOINT_EVERY"})  # type: ignore[arg-type]

    async def run() -> None:
        learner = Learner(settings, source=ListTrajectorySource(data))
        async with learner:
            await learner.wait()
        assert learner.stats.steps == steps

    asyncio.run(run())
    return folder


def _diff(a: Path, b: Path) -> tuple[float, float]:
    """Largest and mean absolute difference of two checkpoints' weights."""
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    diffs = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    return float(diffs.max()), float(diffs.mean())


def _assert_same_weights(ranks: Path, one: Path, initial: Path, label: str) -> None:
    moved, _ = _diff(ranks, initial)
    largest, mean = _diff(ranks, one)
    print(f"{label}: two ranks vs one process max |dw| {largest:.2e}, mean {mean:.2e}; steps moved up to {moved:.2e}")
    assert moved > 1e-3
    assert largest < MAX_TOLERANCE and mean < MEAN_TOLERANCE, (label, largest, mean)


async def test_two_ranks_publish_once_match_one_process_drain_on_sigterm_and_resume(
        kafka_settings: KafkaSettings, tiny_model: Path, tmp_path: Path) -> None:
    # One partition, so both runs see the trajectories, and form the batches, in the same order.
    kafka = kafka_settings.model_copy(update={"partitions": 1})
    registry = TopicRegistry.from_settings(kafka)
    async with KafkaAdmin(kafka, registry) as admin:
        await admin.create_topics()
    first, later = groups(6, 4, prefix="r"), groups(2, 4, prefix="q")
    await _publish(kafka, first)
    reference = await asyncio.to_thread(_reference, tiny_model, tmp_path / "one", first + later, 4)

    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka.topic_prefix, "OPENFORGE_KAFKA_PARTITIONS": "1",
           "OPENFORGE_LEARNER_ENGINE": "fsdp", "OPENFORGE_LEARNER_DEVICE": "cpu",
           "OPENFORGE_LEARNER_MODEL_DIR": str(tiny_model), "OPENFORGE_LEARNER_CHECKPOINT_DIR": str(ckpt),
           **{f"OPENFORGE_LEARNER_{k}": v for k, v in SETTINGS.items()}}
    log = tmp_path / "torchrun.log"

    # Three steps: a checkpoint after the second, the third left for the drain on SIGTERM to save.
    run = _torchrun(env, log)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "step 3:" not in log.read_text():
            assert run.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            await asyncio.sleep(0.2)
        workers = _children(run.pid)
        assert len(workers) == 2, f"torchrun has children {workers}, not the two ranks"
        text = log.read_text()
        assert "rank 0 of 2 joined (gloo); reading Kafka and publishing" in text, text[-4000:]
        assert "rank 1 of 2 joined (gloo); following rank 0" in text, text[-4000:]
        sent = time.monotonic()
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        while any(_alive(w) for w in workers):
            assert time.monotonic() - sent < 60, f"ranks {workers} outlived torchrun"
            await asyncio.sleep(0.1)
        drained_in = time.monotonic() - sent
    finally:
        _end(run, workers)
    # torchrun kills what is left 30 s after its SIGTERM; well under that, the ranks left by themselves.
    print(f"SIGTERM to torchrun: every rank gone after {drained_in:.2f}s")
    assert drained_in < 20, f"the ranks took {drained_in:.1f}s to leave after SIGTERM\n{log.read_text()[-4000:]}"

    published = await _checkpoints(kafka, registry)
    assert [c.version for c in published] == [1, 2], "one event per save, none from rank 1"
    assert sorted(serving_versions(ckpt)) == [1, 2]
    assert sorted(training_states(ckpt)) == [2, 3]  # every 2 steps, and the drain's
    # Both ranks wrote their shards of each training state.
    assert len(list((state_folder(ckpt, 3) / "distcp").glob("*.distcp"))) == 2
    assert sum(o.offset for o in published[-1].consumed_offsets) == len(first)
    trained = [i for step in (2, 3) for i in json.loads((state_folder(ckpt, step) / STATE_FILE).read_text())["trained_ids"]]
    assert sorted(trained) == sorted(t.trajectory_id for t in first)

    from transformers import AutoModelForCausalLM

    saved = Path(published[-1].uri)
    loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded.state_dict()[name], load_file(str(saved / "model.safetensors"))[name])
    _assert_same_weights(saved, serving_folder(reference, 3), tiny_model, "after 3 steps")

    # Restart: rank 0 resumes from the training state of step 3, both ranks load it. Nothing is there to train for
    # longer than the collective timeout, which rank 0's keep-alives bridge; then one step on new
    # groups, max_steps ends rank 0's loop and its stop order ends rank 1's: torchrun exits 0.
    resume_env = {k: v for k, v in env.items() if k != "OPENFORGE_LEARNER_MODEL_DIR"}  # only the checkpoint to load
    again = _torchrun({**resume_env, "OPENFORGE_LEARNER_MAX_STEPS": "1", "OPENFORGE_LEARNER_RANK_TIMEOUT_S": "5"}, log)
    try:
        deadline = time.monotonic() + 120
        while f"all 2 ranks loaded {state_folder(ckpt, 3)}" not in log.read_text():
            assert again.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            await asyncio.sleep(0.2)
        assert f"resuming tiny from {state_folder(ckpt, 3)} (step 3; next version v3)" in log.read_text()
        await asyncio.sleep(7)
        assert again.poll() is None, f"an idle rank timed out\n{log.read_text()[-4000:]}"
        await _publish(kafka, later)
        assert again.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        _end(again, [])
    published = await _checkpoints(kafka, registry)
    assert [c.version for c in published] == [1, 2, 3]
    resumed = json.loads((state_folder(ckpt, 4) / STATE_FILE).read_text())["trained_ids"]
    assert sorted(resumed) == sorted(t.trajectory_id for t in later)
    _assert_same_weights(Path(published[-1].uri), serving_folder(reference, 4), tiny_model, "resumed, step 4")
