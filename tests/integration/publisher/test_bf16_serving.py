"""A bfloat16 model end to end: real vLLM (CPU build) serving bfloat16 loads the learner's default
serving weights, verifies them byte for byte and answers from them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from netutil import free_port
from test_publisher import _applied, _checkpoint, _engine_state, _greedy, _ok

from consumers.checkpoint_files import read_layout
from consumers.publisher import CheckpointPublisher, PublisherSettings
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


async def _logprob_gap(url: str, model: str, folder: Path) -> float:
    """Largest difference between the engine's logprobs of its greedy answer and transformers' on ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Say something about checkpoints."}],
            "max_tokens": 6, "temperature": 0, "logprobs": True, "return_token_ids": True})
    body = response.json()
    prompt, completion = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    engine = [item["logprob"] for item in body["choices"][0]["logprobs"]["content"]]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt + completion])).logits[0, :-1], dim=-1)
    expected = [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(completion)]
    return max(abs(a - b) for a, b in zip(engine, expected, strict=True))


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
    settings = PublisherSettings(replicas=[url], model=name, group_id=f"pub-{uuid.uuid4().hex[:8]}",
                                 retry_backoff_s=0.2, retry_backoff_max_s=1.0, check_interval_s=0.5,
                                 request_timeout_s=20, reference_weights=model_dir, kafka=kafka_settings)
    async with CheckpointPublisher(settings, registry=topics), \
            EventProducer(kafka_settings, registry=topics) as producer:
        before = await _greedy(url, name)
        initial_gap = await _logprob_gap(url, name, model_dir)
        await producer.publish(CHECKPOINTS, _checkpoint([bf16_engine], 1, folder))
        events = await _applied(kafka_settings, topics, lambda ev: _ok(ev, url, 1))
        assert await _engine_state(url) == ("1", False)
        # The replica's own digests of what it holds equal the learner's manifest: the bytes are the
        # learner's bfloat16 weights, not a cast of something else.
        assert all((e.verified_parameters or 0) >= 9 for e in events if e.version == 1 and e.ok)
        after = await _greedy(url, name)
        assert after[1] != before[1], "the step must change the logprobs"
        # Computing in bfloat16 differs from transformers' float32 forward by rounding only, as much
        # as it did for the weights the engine started from.
        gap = await _logprob_gap(url, name, folder)
        assert gap < max(0.05, 2 * initial_gap), (gap, initial_gap)
