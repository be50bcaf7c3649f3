"""A bfloat16 model end to end: real vLLM (CPU build) serving bfloat16 loads the learner's default
serving weights, verifies them byte for byte and answers from them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import conftest as publishing
import pytest
from netutil import free_port

from consumers.checkpoint_files import read_layout
from consumers.publisher import CheckpointPublisher
from openforge.engine import LocalEngine, install_vllm, make_tiny_model
from stream.broker import cache_root
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS, TopicRegistry

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    """A bfloat16 model (the tiny one, as the learner writes it in bfloat16) served in bfloat16."""
    from learner.settings import LearnerSettings
    from learner.workers.hf import HFPolicyWorker

    python = install_vllm()
    tiny = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
    model = tmp_path_factory.mktemp("bf16") / "model"
    HFPolicyWorker(LearnerSettings(model_dir=tiny, serving_dtype="bfloat16"), tiny).save_serving(model)
    engine = LocalEngine(model, free_port(), python, tmp_path_factory.mktemp("replica") / "replica.log",
                         dtype="bfloat16")
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


async def test_a_bf16_engine_loads_verifies_and_answers_from_the_learners_default_serving_weights(
    kafka_settings: KafkaSettings, topics: TopicRegistry, bf16_engine: LocalEngine, tmp_path: Path,
) -> None:
    from learner.checkpoint import serving_folder, write_checkpoint_folder
    from learner.protocol import Row, TrainBatch
    from learner.settings import LearnerSettings
    from learner.workers.hf import HFPolicyWorker

    model_dir, url = bf16_engine.model_dir, bf16_engine.url
    # The default a user gets: serving weights in the dtype the model's config names (bfloat16),
    # float32 master weights in training.
    worker = HFPolicyWorker(LearnerSettings(model_dir=model_dir, lr=3e-2), model_dir)
    ids = [(7 * i) % 200 + 3 for i in range(48)]
    worker.train_step(TrainBatch([Row(input_ids=ids, prompt_len=16, loss_mask=[1] * 32,
                                      behavior_logprobs=[-5.0] * 32, advantage=1.0)]))
    folder = write_checkpoint_folder(serving_folder(tmp_path, 1), worker.save_serving, manifest=True)
    assert {info.dtype for info in read_layout(folder).values()} == {"BF16"}
    assert read_layout(folder) == read_layout(model_dir), "the served model's layout, in its dtype"

    name = str(model_dir)
    async with CheckpointPublisher(publishing.publisher_settings(kafka_settings, [bf16_engine]), registry=topics), \
            EventProducer(kafka_settings, registry=topics) as producer:
        before = await publishing.greedy_answer(url, name)
        initial_gap = await publishing.logprob_gap(url, name, model_dir)
        await producer.publish(CHECKPOINTS, publishing.checkpoint_event([bf16_engine], 1, folder))
        events = await publishing.applied_events(kafka_settings, topics, lambda ev: publishing.applied_ok(ev, url, 1))
        assert await publishing.engine_state(url) == ("1", False)
        # The replica's own digests of what it holds equal the learner's manifest: the bytes are the
        # learner's bfloat16 weights, not a cast of something else.
        assert all((e.verified_parameters or 0) >= 9 for e in events if e.version == 1 and e.ok)
        after = await publishing.greedy_answer(url, name)
        assert after[1] != before[1], "the step must change the logprobs"
        # Computing in bfloat16 differs from transformers' float32 forward by rounding only, as much
        # as it did for the weights the engine started from.
        gap = await publishing.logprob_gap(url, name, folder)
        assert gap < max(0.05, 2 * initial_gap), (gap, initial_gap)
