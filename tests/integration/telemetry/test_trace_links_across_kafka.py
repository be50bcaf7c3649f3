"""One trace from a model call to the training step that used it, across real Kafka hops.

The real proxy (in front of the real vLLM CPU server) handles calls of two rollouts; their events
carry the call span's context in Kafka headers. The real assembler joins them into trajectories
inside a span linked to those call spans, and publishes each trajectory with that span's context in
its headers; the real learner trains one step on them inside a span linked to the assembler spans.
Spans are read with the SDK's in-memory exporter.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from assembler_factories import lifecycle, reward
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from spans import memory_exporter

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from learner.settings import LearnerSettings
from learner.trainer import Learner
from openforge.engine import make_tiny_model
from schemas.rollout.v1 import RolloutPhase
from stream.broker import cache_root
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import REWARDS, ROLLOUTS

pytestmark = pytest.mark.kafka

ROLLOUTS_OF_TASK = ("r-link-0", "r-link-1")
CALLS_PER_ROLLOUT = 2


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return memory_exporter()


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")


def _links(span: ReadableSpan) -> set[tuple[int, int]]:
    return {(link.context.trace_id, link.context.span_id) for link in span.links}


async def test_a_call_span_links_to_the_assembler_span_and_the_learner_step(
        spans: InMemorySpanExporter, proxy, kafka_settings: KafkaSettings, tiny_model: Path,
        tmp_path: Path) -> None:
    spans.clear()
    # 1 calls through the real proxy: each is a server span whose context rides in the event's headers.
    async with httpx.AsyncClient(timeout=60) as http:
        for rollout_id in ROLLOUTS_OF_TASK:
            for turn in range(CALLS_PER_ROLLOUT):
                answer = await http.post(
                    f"{proxy.base(rollout_id)}/v1/chat/completions",
                    headers={"authorization": f"Bearer {proxy.token(rollout_id)}"},
                    json={"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}],
                          "max_tokens": 4, "temperature": 1.0})
                assert answer.status_code == 200, answer.text
    # 2 the rest of each rollout's story, as the launcher and the verifier would tell it.
    async with EventProducer(kafka_settings) as producer:
        for index, rollout_id in enumerate(ROLLOUTS_OF_TASK):
            for phase in (RolloutPhase.SCHEDULED, RolloutPhase.SUCCEEDED):
                await producer.send(ROLLOUTS, lifecycle(rollout_id, phase, task_id="task-link", group_index=index,
                                                        group_size=len(ROLLOUTS_OF_TASK)))
            await producer.send(REWARDS, reward(rollout_id, float(index)))
        await producer.flush()

    assembler = AssemblerService(AssemblerSettings.model_validate({
        "group_id": f"{kafka_settings.topic_prefix}assembler", "grace_s": 0.2, "commit_interval_s": 0.2,
        "poll_timeout_ms": 100, "session_timeout_ms": 6000, "reward_timeout_s": 5.0}), kafka_settings)
    learner = Learner(LearnerSettings(model_dir=tiny_model, checkpoint_dir=tmp_path / "ckpt", groups_per_step=1,
                                      min_group_size=2, batch_wait_s=0.2, token_budget=512, max_steps=1,
                                      checkpoint_every=100), kafka_settings)
    async with assembler, learner:
        await asyncio.wait_for(learner.wait(), 90)
    assert learner.stats.steps == 1 and learner.stats.trained_trajectories == len(ROLLOUTS_OF_TASK)

    finished = spans.get_finished_spans()
    calls = [s for s in finished if (s.attributes or {}).get("openforge.call_id")]
    assembled = [s for s in finished if s.name == "assemble trajectory"]
    steps = [s for s in finished if s.name == "learner step"]
    assert len(calls) == len(ROLLOUTS_OF_TASK) * CALLS_PER_ROLLOUT, [s.name for s in finished]
    assert len(assembled) == len(ROLLOUTS_OF_TASK) and len(steps) == 1

    # Each trajectory span links to exactly the call spans of its own rollout ...
    for span in assembled:
        rollout_id = (span.attributes or {})["openforge.rollout_id"]
        own = {(c.context.trace_id, c.context.span_id) for c in calls
               if (c.attributes or {}).get("openforge.rollout_id") == rollout_id}
        assert len(own) == CALLS_PER_ROLLOUT
        assert _links(span) == own, (rollout_id, _links(span), own)
    assert set().union(*(_links(s) for s in assembled)) == {(c.context.trace_id, c.context.span_id) for c in calls}
    # ... and the step links to every trajectory span, so every call's trace leads to the step.
    assert _links(steps[0]) == {(s.context.trace_id, s.context.span_id) for s in assembled}
    step_trace = steps[0].context.trace_id
    assert step_trace not in {c.context.trace_id for c in calls}  # linked, not merged into one call's trace
