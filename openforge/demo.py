"""`openforge demo`: what OpenForge can show on one machine today.

The learning loop (proxy, launcher, assembler, learner, publisher) is not built
yet. Until it is, the demo exercises the streaming foundation every part will
stand on: a real Kafka broker, the topic registry, typed events with exact token
ids, a consumer group that commits only finished work, and the topic tooling.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from datetime import UTC, datetime

import click

from schemas import EventBase, ModelCallV1, RewardV1, RolloutEventV1
from schemas.call.v1 import ApiProtocol, CallChoice, CallStatus, CallTimings, NormalizedRequest
from schemas.rollout.v1 import Backend, RolloutPhase
from stream import (
    CALLS,
    REWARDS,
    ROLLOUTS,
    BrokerSettings,
    EventConsumer,
    EventProducer,
    KafkaAdmin,
    KafkaSettings,
    LocalBroker,
    Received,
)
from stream.tooling import Range, format_record, read_topic


def _rollout(task: str, index: int, rng: random.Random) -> tuple[list[EventBase], str]:
    rollout_id = f"{task}-r{index}-{uuid.uuid4().hex[:6]}"
    events: list[EventBase] = [RolloutEventV1(rollout_id=rollout_id, task_id=task, group_index=index,
                                           group_size=4, phase=RolloutPhase.RUNNING, backend=Backend.LOCAL)]
    prompt: list[int] = [rng.randrange(4096) for _ in range(40)]
    for turn in range(3):
        completion = [rng.randrange(4096) for _ in range(12)]
        events.append(ModelCallV1(
            rollout_id=rollout_id, task_id=task, call_id=f"{rollout_id}-c{turn}",
            protocol=ApiProtocol.OPENAI_CHAT, model="tiny",
            request=NormalizedRequest(messages=[{"role": "user", "content": f"turn {turn}"}]),
            prompt_token_ids=prompt,
            choices=[CallChoice(index=0, completion_token_ids=completion,
                                logprobs=[-rng.random() for _ in completion], finish_reason="stop")],
            timings=CallTimings(started_at=datetime.now(UTC), total_s=0.02), status=CallStatus.OK,
        ))
        prompt = prompt + completion + [rng.randrange(4096) for _ in range(8)]  # next turn extends it
    events.append(RolloutEventV1(rollout_id=rollout_id, task_id=task, group_index=index, group_size=4,
                                 phase=RolloutPhase.SUCCEEDED, backend=Backend.LOCAL))
    events.append(RewardV1(rollout_id=rollout_id, task_id=task, value=round(rng.random(), 2),
                           verifier_id="demo-verifier"))
    return events, rollout_id


async def _run(settings: KafkaSettings) -> None:
    rng = random.Random(0)  # noqa: S311 - demo data, not secrets
    click.echo("==> creating the registry topics")
    async with KafkaAdmin(settings) as admin:
        for result in await admin.create_topics():
            click.echo(f"    {'created' if result.created else 'exists '} {result.name}")
    click.echo("==> publishing 8 rollouts of 2 tasks: lifecycle, 3 model calls each, a reward")
    home = {"rollout": ROLLOUTS, "model_call": CALLS, "reward": REWARDS}
    sent = 0
    last_rollout = ""
    async with EventProducer(settings) as producer:
        for task in ("count-letters", "sum-digits"):
            for index in range(4):
                events, last_rollout = _rollout(task, index, rng)
                for event in events:
                    await producer.send(home[type(event).SCHEMA], event)
                    sent += 1
        await producer.flush()
    click.echo(f"    {sent} events acknowledged by the broker (acks=all, idempotent, zstd)")
    click.echo("==> a consumer group reads them back and commits what it handled")
    counts: dict[str, int] = {}
    rewards: dict[str, list[float]] = {}

    async def handle(received: Received) -> None:
        counts[type(received.event).SCHEMA] = counts.get(type(received.event).SCHEMA, 0) + 1
        if isinstance(received.event, RewardV1):
            rewards.setdefault(received.event.task_id or "?", []).append(received.event.value)

    group = f"demo-{uuid.uuid4().hex[:6]}"
    async with EventConsumer([ROLLOUTS, CALLS, REWARDS], handle, group_id=group, kafka=settings):
        deadline = time.monotonic() + 60
        while sum(counts.values()) < sent and time.monotonic() < deadline:  # noqa: ASYNC110 - progress poll
            await asyncio.sleep(0.1)
    for schema, n in sorted(counts.items()):
        click.echo(f"    {schema:12} {n:4d}")
    for task, values in sorted(rewards.items()):
        click.echo(f"    mean reward of {task}: {sum(values) / len(values):.2f} over {len(values)} rollouts")
    click.echo(f"==> one call, as `OPENFORGE_KAFKA_TOPIC_PREFIX={settings.topic_prefix} "
               f"openforge topics tail calls --key {last_rollout}` shows it")
    async for record in read_topic(settings, settings.topic_prefix + CALLS.base_name, Range(last=20)):
        if record.key == last_rollout.encode():
            click.echo(format_record(record))
            break


def run_demo(keep_broker: bool) -> None:
    """Start (or reuse) the local broker, run the streaming demo, stop what it started."""
    broker = LocalBroker(BrokerSettings())
    already = broker.status().running
    click.echo("OpenForge demo. The learning loop is not built yet; this shows the streaming "
               "foundation it will run on.")
    click.echo(f"==> Kafka {broker.settings.version} on {broker.bootstrap}"
               + (" (already running)" if already else " (starting; the first run fetches its jars)"))
    broker.start()
    try:
        # A prefix of its own per run, so what the demo counts is what this run published.
        prefix = f"demo-{uuid.uuid4().hex[:6]}."
        asyncio.run(_run(KafkaSettings(bootstrap_servers=broker.bootstrap, topic_prefix=prefix)))
    finally:
        if not already and not keep_broker:
            click.echo("==> stopping Kafka")
            broker.stop()
    click.echo("done. Keep a broker with `openforge kafka up`, then try `openforge topics describe`.")
