"""Reading what the rollout components published, from the real broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer

from schemas import RolloutEventV1, decode
from stream import ROLLOUTS, KafkaSettings, TopicRegistry, TopicSpec


async def collect(settings: KafkaSettings, registry: TopicRegistry, spec: TopicSpec,
                  until: Callable[[list[Any]], bool], *, timeout_s: float = 60.0) -> list[Any]:
    """Read ``spec`` from the start until ``until(events)`` holds (or the time is up), then a little more."""
    consumer = AIOKafkaConsumer(registry[spec].name, bootstrap_servers=settings.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                isolation_level="read_committed", max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    events: list[Any] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not until(events) and loop.time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                events.extend(decode(r.headers, r.value) for r in batch)
        for batch in (await consumer.getmany(timeout_ms=300)).values():  # duplicates would show up here
            events.extend(decode(r.headers, r.value) for r in batch)
    finally:
        await consumer.stop()
    return events


def terminal_count(n: int) -> Callable[[list[Any]], bool]:
    return lambda events: sum(1 for e in events if isinstance(e, RolloutEventV1) and e.is_terminal) >= n


async def lifecycle(settings: KafkaSettings, registry: TopicRegistry, terminals: int,
                    timeout_s: float = 60.0) -> dict[str, list[RolloutEventV1]]:
    """Lifecycle events per rollout, in order, once ``terminals`` rollouts ended."""
    events = await collect(settings, registry, ROLLOUTS, terminal_count(terminals), timeout_s=timeout_s)
    by_rollout: dict[str, list[RolloutEventV1]] = {}
    for event in events:
        by_rollout.setdefault(event.rollout_id, []).append(event)
    return by_rollout
