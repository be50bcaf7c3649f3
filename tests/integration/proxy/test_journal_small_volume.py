"""The proxy's journal on a small volume: a real 80 MiB tmpfs, a real broker and engine.

A fault run found the proxy blocked for good on an 80 MiB volume: every call got 503 from the
third second on, while ``/ready`` showed nothing waiting and Kafka had every event, and a restart
did not clear it. The journal kept 64 MiB free and deleted a shipped segment only once a 64 MiB
one filled, which on that volume never happened; a start left the last run's segment in place.
Now the segment size and the free-space floor are shares of the volume, and a start deletes the
last run's segment once it is shipped.

The proxy runs on a tmpfs of its own (``tests/small_volume.py``), twice in a row on the same
one: the first is killed, and the second starts on what it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from netutil import free_port
from proxy_helpers import KEY
from small_volume import on_small_volume

from schemas.credentials import Role, mint_token
from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(600)]

VOLUME_MIB = 80
PADDING = "x" * (1 << 20)  # each call's record holds its request: about 1 MiB


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _alive(pids: list[int]) -> bool:
    return any(Path(f"/proc/{pid}").exists() for pid in pids)


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


async def _ready(client: httpx.AsyncClient, base: str, shell: asyncio.subprocess.Process, log: Path) -> dict[str, Any]:
    """``/ready``'s body once the proxy answers it (whatever it says)."""
    for _ in range(600):
        assert shell.returncode is None, _tail(log)
        with contextlib.suppress(httpx.HTTPError):
            ready: dict[str, Any] = (await client.get(f"{base}/ready")).json()
            return ready
        await asyncio.sleep(0.1)
    raise AssertionError(f"the proxy did not answer /ready in 60 s: {_tail(log)}")


async def _calls(client: httpx.AsyncClient, base: str, seeds: range) -> list[int]:
    token = mint_token(KEY, "r-small", Role.AGENT, 600)
    statuses = []
    for seed in seeds:
        answer = await client.post(f"{base}/rollouts/r-small/v1/chat/completions",
                                   headers={"authorization": f"Bearer {token}"},
                                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 1, "seed": seed, "user": PADDING})
        statuses.append(answer.status_code)
    return statuses


async def _event_seeds(kafka: KafkaSettings, topic: str, expect: int) -> set[int]:
    """The seeds of the distinct call events on ``topic`` (read raw: each is over a MiB)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka.bootstrap_servers, auto_offset_reset="earliest",
                                enable_auto_commit=False, max_partition_fetch_bytes=16 << 20)
    await consumer.start()
    seeds: dict[str, int] = {}
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while len(seeds) < expect and asyncio.get_running_loop().time() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for record in batch:
                    event = orjson.loads(record.value)
                    seeds[event["event_id"]] = event["request"]["sampling"]["seed"]
    finally:
        await consumer.stop()
    return set(seeds.values())


async def test_an_80_mib_volume_takes_calls_for_many_times_its_size_and_a_restart_finds_it_free(
        vllm_url: str, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    port = free_port()
    proxy = [sys.executable, "-m", "openforge", "proxy", "--host", "127.0.0.1", "--port", str(port),
             "--upstream", vllm_url]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode(), "OPENFORGE_PROXY_SPOOL_DIR": str(spool),
           "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "OPENFORGE_KAFKA_PARTITIONS": str(kafka_settings.partitions),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        # The proxy, and once it is killed, another on the same volume.
        shell = await asyncio.create_subprocess_exec(*on_small_volume(VOLUME_MIB, spool, proxy, proxy), env=env,
                                                     stdout=out, stderr=asyncio.subprocess.STDOUT,
                                                     start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            ready = await _ready(client, base, shell, log)
            assert ready["disk_free_bytes"] <= VOLUME_MIB << 20, ready  # the proxy is on the small volume
            # Twice the volume, in calls of a MiB: each answered, with Kafka keeping up.
            first = await _calls(client, base, range(2 * VOLUME_MIB))
            assert first == [200] * len(first), first
            ready = (await client.get(f"{base}/ready")).json()
            assert ready["accepting"] and ready["disk_ok"], ready
            [killed] = _children(shell.pid)
            os.kill(killed, signal.SIGKILL)  # what it journalled and did not ship waits on the volume
            while killed in _children(shell.pid) or not _children(shell.pid):
                await asyncio.sleep(0.1)
            ready = await _ready(client, base, shell, log)
            for _ in range(300):  # what the killed proxy left is shipped, and its segment deleted
                if ready["spooled"] == 0 and ready["disk_free_bytes"] > (VOLUME_MIB - 6) << 20:
                    break
                await asyncio.sleep(0.1)
                ready = (await client.get(f"{base}/ready")).json()
            # A segment is 5 MiB on this volume: no more than one of them is in use.
            assert ready["spooled"] == 0 and ready["disk_free_bytes"] > (VOLUME_MIB - 6) << 20, ready
            assert ready["accepting"], ready
            second = await _calls(client, base, range(2 * VOLUME_MIB, 2 * VOLUME_MIB + 20))
            assert second == [200] * len(second), second
    finally:
        proxies = _children(shell.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)  # the shell, so no other command starts, and the proxy
        await asyncio.wait_for(shell.wait(), 60)
        for _ in range(600):  # the proxy drains and ships before it exits
            if not _alive(proxies):
                break
            await asyncio.sleep(0.1)
        else:
            for pid in proxies:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    answered = 2 * VOLUME_MIB + 20
    assert await _event_seeds(kafka_settings, topics[CALLS].name, answered) == set(range(answered))


async def test_a_volume_too_small_for_the_journal_is_refused_at_start_saying_so(
        vllm_url: str, kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    proxy = [sys.executable, "-m", "openforge", "proxy", "--port", str(free_port()), "--upstream", vllm_url]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode(), "OPENFORGE_PROXY_SPOOL_DIR": str(spool),
           "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "PYTHONPATH": os.pathsep.join(sys.path)}
    started = await asyncio.create_subprocess_exec(*on_small_volume(8, spool, proxy), env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(started.communicate(), 120)
    assert started.returncode == 1, out.decode()
    assert "holds 8.0 MiB; the journal needs at least 16 MiB" in out.decode() and b"Traceback" not in out
