"""A real proxy (uvicorn on a free port) in front of the real vLLM, publishing to the real broker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from aiokafka import AIOKafkaConsumer
from inloop_server import InLoopServer
from netutil import free_port

from proxy.app import build_app
from proxy.server import server_config
from proxy.settings import ProxySettings
from schemas import ModelCallV1, RewardV1, decode
from schemas.call.linear import WholeCalls
from schemas.credentials import Role, mint_token
from stream import CALLS, REWARDS, KafkaSettings, TopicRegistry

KEY = b"test-signing-key-0123456789"


@dataclass
class RunningProxy:
    url: str
    settings: ProxySettings
    registry: TopicRegistry

    def token(self, rollout_id: str, role: Role = Role.AGENT, ttl_s: float = 600, task_id: str | None = None) -> str:
        return mint_token(KEY, rollout_id, role, ttl_s, task_id=task_id)

    def base(self, rollout_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}"


async def serve(settings: ProxySettings) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    server = InLoopServer(server_config(build_app(settings), settings, host="127.0.0.1", lifespan="on"))
    task = asyncio.create_task(server.serve())
    async with httpx.AsyncClient() as client:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"http://127.0.0.1:{settings.port}/health")).status_code == 200:
                    return server, task
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
    raise RuntimeError("proxy did not start")


async def shutdown(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def proxy_in_front_of(engine_url: str, kafka: KafkaSettings, topics: TopicRegistry,
                            tmp_path: Path, **updates: object) -> AsyncIterator[RunningProxy]:
    """A proxy in front of any engine (the scripted one, say), for one test; ``updates`` change its settings."""
    settings = ProxySettings(port=free_port(), upstreams=[engine_url], credential_key=KEY.decode(),
                             spool_dir=tmp_path / "spool", kafka=kafka, publish_timeout_s=5.0
                             ).model_copy(update=updates)
    server, task = await serve(settings)
    try:
        yield RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    finally:
        await shutdown(server, task)


@pytest.fixture
def proxy_settings_factory(vllm_url: str, kafka_settings: KafkaSettings, tmp_path: Path
                           ) -> Callable[..., ProxySettings]:
    def make(**updates: object) -> ProxySettings:
        base = ProxySettings(port=free_port(), upstreams=[vllm_url], credential_key=KEY.decode(),
                             spool_dir=tmp_path / "spool", kafka=kafka_settings, publish_timeout_s=3.0)
        return base.model_copy(update=updates)
    return make


@pytest.fixture
async def proxy(proxy_settings_factory: Callable[..., ProxySettings], topics: TopicRegistry
                ) -> AsyncIterator[RunningProxy]:
    settings = proxy_settings_factory()
    server, task = await serve(settings)
    try:
        yield RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    finally:
        await shutdown(server, task)


async def read_events(settings: KafkaSettings, registry: TopicRegistry, spec=CALLS, *, expect: int,
                      timeout_s: float = 20.0, whole: bool = True) -> list:
    """The events of ``spec``'s topic; calls ``whole`` (prompts stored by reference rebuilt) unless told."""
    consumer = AIOKafkaConsumer(registry[spec].name, bootstrap_servers=settings.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    events: list = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(events) < expect and loop.time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                events.extend(decode(r.headers, r.value) for r in batch)
        # Anything beyond what was expected would be a duplicate: look briefly.
        for batch in (await consumer.getmany(timeout_ms=300)).values():
            events.extend(decode(r.headers, r.value) for r in batch)
    finally:
        await consumer.stop()
    if not whole:
        return events
    calls = WholeCalls()
    return [calls.whole(e) if isinstance(e, ModelCallV1) else e for e in events]


async def calls_of(proxy: RunningProxy, expect: int) -> list[ModelCallV1]:
    events = await read_events(proxy.settings.kafka, proxy.registry, CALLS, expect=expect)
    assert all(isinstance(e, ModelCallV1) for e in events)
    return sorted(events, key=lambda e: e.timings.started_at)


async def rewards_of(proxy: RunningProxy, expect: int) -> list[RewardV1]:
    return await read_events(proxy.settings.kafka, proxy.registry, REWARDS, expect=expect)


async def until(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> bool:
    """Whether ``condition`` came true within ``timeout_s`` (checked every ``every_s``).

    Also asks whether a state that must not arise ever did, in a short window: look often.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if condition():
            return True
        await asyncio.sleep(every_s)
    return False


async def stored(kafka: KafkaSettings, registry: TopicRegistry, topic: str) -> int:
    """How many records ``topic`` holds (the sum of its partitions' end offsets)."""
    from stream.admin import KafkaAdmin

    async with KafkaAdmin(kafka, registry) as admin:
        return sum((await admin.end_offsets(await admin.partitions(topic))).values())
