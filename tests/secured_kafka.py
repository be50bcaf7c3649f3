"""What the tests against secured brokers share: topics made, records read back, a refused start,
the command line's refusal, a call shipped by the proxy's worker.

Every step goes through ``KafkaSettings.client_kwargs()``, the one place security settings
become aiokafka's arguments, so a test passes only if that place gets them right.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord
from aiokafka.errors import KafkaError
from proxy_helpers import proxy_in_front_of

from schemas import ModelCallV1, decode
from stream import CALLS, EventProducer, KafkaSettings, TopicRegistry
from stream.admin import KafkaAdmin


async def created(kafka: KafkaSettings) -> TopicRegistry:
    """The calls topic made under ``kafka``'s prefix (the admin client's own connections included)."""
    registry = TopicRegistry.from_settings(kafka)
    admin = KafkaAdmin(kafka, registry)
    await admin.start()
    try:
        await admin.create_topics([registry[CALLS]])
    finally:
        await admin.stop()
    return registry


async def read(kafka: KafkaSettings, topic: str, expect: int, timeout_s: float = 30.0
               ) -> list[ConsumerRecord[bytes, bytes]]:
    """Up to ``expect`` records of ``topic`` from the start, by a consumer of its own."""
    consumer = AIOKafkaConsumer(topic, **kafka.client_kwargs(), auto_offset_reset="earliest",
                                enable_auto_commit=False, max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(records) < expect and asyncio.get_running_loop().time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def round_trip(kafka: KafkaSettings, payload: bytes) -> None:
    """Create the topics, send one event and read it back: every client kind crosses the secured listener."""
    registry = await created(kafka)
    producer = EventProducer(kafka, registry=registry)
    await producer.start()
    try:
        await (await producer.send_raw(registry[CALLS].name, payload, key=b"rollout-1"))
    finally:
        await producer.stop()
    assert [r.value for r in await read(kafka, registry[CALLS].name, expect=1)] == [payload]


async def refused_start(kafka: KafkaSettings) -> None:
    """A producer under ``kafka`` fails to start (within a minute) with a Kafka error."""
    producer = EventProducer(kafka, registry=TopicRegistry.from_settings(kafka))
    with pytest.raises(KafkaError):
        async with asyncio.timeout(60):
            await producer.start()
    await producer.stop()


async def cli_names_the_refusal(env: dict[str, str], reason: str, secret: str, *, right_secret: str) -> None:
    """``openforge topics list`` under ``env`` fails with ``reason`` in its own error line, never
    quoting ``secret``; with ``right_secret`` in OPENFORGE_KAFKA_SASL_PASSWORD it lists the topics."""
    env = {**os.environ, **env, "OPENFORGE_KAFKA_SASL_PASSWORD": secret}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "openforge", "topics", "list"], env=env,
                                   capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    # aiokafka's own log line may name the refusal too; the command's error line must, by itself.
    error = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and "Unable to bootstrap" in error[0], done.stderr
    assert reason in error[0], done.stderr
    assert secret not in done.stderr + done.stdout

    env["OPENFORGE_KAFKA_SASL_PASSWORD"] = right_secret
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "openforge", "topics", "list", "--all"],
                                   env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


async def shipped_call(kafka: KafkaSettings, vllm_url: str, tmp_path: Path, rollout: str) -> ModelCallV1:
    """One chat call through a proxy publishing under ``kafka``; its event as read back from the topic."""
    registry = await created(kafka)
    async with proxy_in_front_of(vllm_url, kafka, registry, tmp_path) as proxy:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{proxy.base(rollout)}/v1/chat/completions",
                                       headers={"Authorization": f"Bearer {proxy.token(rollout)}"},
                                       json={"model": "m", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hello"}]})
        assert answer.status_code == 200, answer.text
        records = await read(kafka, registry[CALLS].name, expect=1)
    assert len(records) == 1
    event = decode(list(records[0].headers), records[0].value)
    assert isinstance(event, ModelCallV1)
    assert event.rollout_id == rollout and event.prompt_token_ids and event.choices[0].completion_token_ids
    return event
