"""Two real vLLM (CPU build) replicas of the tiny model, shared by the module, checkpoint folders, and
the publisher, engine and topic helpers the publisher tests share."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from netutil import free_port

from consumers.checkpoint_files import write_scaled_copy
from consumers.publisher import PublisherSettings
from openforge.engine import LocalEngine, install_vllm, make_tiny_model
from schemas import CheckpointAppliedV1, CheckpointV1
from stream.broker import cache_root
from stream.settings import KafkaSettings
from stream.tooling import read_topic
from stream.topics import CHECKPOINTS, TopicRegistry


@dataclass
class Checkpoints:
    """Folders the tests publish: the served weights again, two changed copies, and broken ones."""

    base: Path
    same: Path
    scaled: Path
    scaled_more: Path
    truncated: Path


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalEngine]]:
    """Two replicas started side by side (30-70 s on a busy machine); restartable by the tests."""
    python = install_vllm()
    model = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
    logs = tmp_path_factory.mktemp("replicas")
    pair = [LocalEngine(model, free_port(), python, logs / f"replica{i}.log") for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(engine.start) for engine in pair]:
                future.result()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@pytest.fixture(scope="module")
def checkpoints(engines: list[LocalEngine], tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    base = engines[0].model_dir
    root = tmp_path_factory.mktemp("checkpoints")
    write_scaled_copy(base, root / "same", 1.0)
    truncated = write_scaled_copy(base, root / "truncated", 1.0)
    file = truncated / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return Checkpoints(base=base, same=root / "same", scaled=write_scaled_copy(base, root / "scaled", 3.0, tensor_suffix="lm_head.weight"),
                       scaled_more=write_scaled_copy(base, root / "scaled_more", 5.0), truncated=truncated)


_VERSIONS = itertools.count(1)


@pytest.fixture
def versions() -> itertools.count[int]:
    """Weight versions that keep growing across the module's tests (the replicas keep theirs)."""
    return _VERSIONS


def publisher_settings(kafka: KafkaSettings, engines: list[LocalEngine], **updates: object) -> PublisherSettings:
    """A publisher of ``engines`` in a group of its own, with retries and checks short enough for a test."""
    return PublisherSettings(
        replicas=[e.url for e in engines], model=str(engines[0].model_dir), group_id=f"pub-{uuid.uuid4().hex[:8]}",
        retry_backoff_s=0.2, retry_backoff_max_s=1.0, check_interval_s=0.5, request_timeout_s=20,
        reference_weights=engines[0].model_dir, kafka=kafka, **updates,
    )


def checkpoint_event(engines: list[LocalEngine], version: int, folder: Path, model: str | None = None) -> CheckpointV1:
    """The learner's event for ``folder``: of the replicas' model unless ``model`` names another."""
    return CheckpointV1(model=model or str(engines[0].model_dir), version=version, uri=str(folder), step=version)


async def greedy_answer(url: str, model: str) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of a short greedy answer: they change when the weights do."""
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Say something about checkpoints."}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "return_token_ids": True})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], [item["logprob"] for item in choice["logprobs"]["content"]]


async def logprob_gap(url: str, model: str, folder: Path) -> float:
    """Largest difference between the engine's logprobs and transformers' on the checkpoint folder.

    Answers that merely change are not enough: an engine that reloads some tensors and keeps stale
    copies of others also changes its answers (vLLM's CPU build kept a tied output layer stale).
    """
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


async def engine_state(url: str) -> tuple[str, bool]:
    """The replica's weight version and whether it is paused."""
    async with httpx.AsyncClient(timeout=20) as client:
        version = (await client.get(url + "/weight_info")).json()["weight_version"]
        paused = (await client.get(url + "/is_paused")).json()["is_paused"]
        return str(version), bool(paused)


async def applied_events(kafka: KafkaSettings, registry: TopicRegistry,
                         done: Callable[[list[CheckpointAppliedV1]], bool],
                         timeout_s: float = 60.0) -> list[CheckpointAppliedV1]:
    """Every applied event on the checkpoints topic (all partitions), reread until ``done`` holds (or fail)."""
    deadline = time.monotonic() + timeout_s
    events: list[CheckpointAppliedV1] = []
    while True:
        events = [event async for raw in read_topic(kafka, registry[CHECKPOINTS].name)
                  if isinstance(event := raw.decode(), CheckpointAppliedV1)]
        if done(events):
            return events
        if time.monotonic() > deadline:
            pytest.fail(f"applied events did not reach the expected state in {timeout_s}s: "
                        f"{[(e.replica, e.version, e.ok, e.error) for e in events]}")
        await asyncio.sleep(0.3)


def applied_ok(events: list[CheckpointAppliedV1], replica: str, version: int) -> bool:
    """Whether ``replica`` reported ``version`` applied."""
    return any(e.replica == replica and e.version == version and e.ok for e in events)
