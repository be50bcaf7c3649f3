"""`openforge kafka up|status|down`, and clients riding out a broker restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from factories import reward
from netutil import free_port_pair

from schemas import RewardV1
from stream.admin import KafkaAdmin
from stream.broker import BrokerError, LocalBroker, ensure_kafka_jars
from stream.consumer import ConsumerSettings, EventConsumer, Received
from stream.producer import EventProducer
from stream.settings import BrokerSettings, KafkaSettings
from stream.topics import REWARDS, TopicRegistry

pytestmark = pytest.mark.kafka


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "openforge", *args], capture_output=True, text=True,
                          timeout=180, check=False, env={**os.environ, **(env or {})})


async def test_kafka_up_status_down_and_a_restart_loses_nothing(tmp_path: Path) -> None:
    port = free_port_pair()
    where = ["--port", str(port), "--data-dir", str(tmp_path / "kafka")]
    up = await asyncio.to_thread(cli, "kafka", "up", *where)
    assert up.returncode == 0, up.stderr
    assert f"is up on 127.0.0.1:{port}" in up.stdout
    try:
        again = await asyncio.to_thread(cli, "kafka", "up", *where)  # idempotent
        assert again.returncode == 0 and "is up" in again.stdout
        status = await asyncio.to_thread(cli, "kafka", "status", *where)
        assert status.returncode == 0 and "running" in status.stdout

        settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", partitions=1, linger_ms=0)
        async with KafkaAdmin(settings) as admin:
            await admin.create_topics()
        before = [reward(f"r-{i}", float(i)) for i in range(5)]
        after = [reward(f"r-{i}", float(10 + i)) for i in range(5)]
        seen: list[Received] = []

        async def handle(received: Received) -> None:
            seen.append(received)

        consumer = EventConsumer([REWARDS], handle, group_id="g-restart", kafka=settings,
                                 settings=ConsumerSettings(commit_interval_s=0.2, session_timeout_ms=6000))
        async with EventProducer(settings) as producer, consumer:
            for e in before:
                await producer.publish(REWARDS, e)
            down = await asyncio.to_thread(cli, "kafka", "down", *where)
            assert down.returncode == 0 and "stopped" in down.stdout
            stopped = await asyncio.to_thread(cli, "kafka", "status", *where)
            assert stopped.returncode == 1 and "not running" in stopped.stdout
            # Sends while the broker is away wait in the client and go out once it is back.
            pending = [await producer.send(REWARDS, e) for e in after]
            restarted = await asyncio.to_thread(cli, "kafka", "up", *where)
            assert restarted.returncode == 0, restarted.stderr
            await asyncio.wait_for(asyncio.gather(*pending), 60)
            deadline = asyncio.get_running_loop().time() + 60
            while len({r.event.event_id for r in seen}) < 10 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
        assert {r.event.event_id for r in seen} == {e.event_id for e in before + after}
    finally:
        await asyncio.to_thread(cli, "kafka", "down", *where)


def test_start_fails_clearly_when_the_port_is_taken(broker: LocalBroker | None, tmp_path: Path) -> None:
    if broker is None:
        pytest.fail("this test needs the session's local broker (run without --kafka)")
    taken = LocalBroker(BrokerSettings(port=broker.settings.port, controller_port=broker.settings.port + 7,
                                       data_dir=str(tmp_path)))
    with pytest.raises(BrokerError, match=f"port {broker.settings.port} .* already in use"):
        taken.start()


def test_broker_formats_storage_with_a_cluster_id_that_starts_with_a_dash(tmp_path, monkeypatch) -> None:
    # A base64url cluster id starts with "-" one time in 64; the storage tool must not read it as a flag.
    import uuid

    from stream.broker import ensure_kafka_jars

    libs = ensure_kafka_jars(BrokerSettings().version)
    dashed = uuid.UUID(bytes=bytes([0xFB]) + bytes(15))  # base64url of 0xFB... starts with "-"
    monkeypatch.setattr(uuid, "uuid4", lambda: dashed)
    broker = LocalBroker(BrokerSettings(port=19999, controller_port=19998, data_dir=str(tmp_path)))
    broker._format(libs, broker._write_config())
    assert "cluster.id=-" in (tmp_path / "kraft-logs" / "meta.properties").read_text()


async def test_kafkas_own_console_consumer_reads_an_event_from_the_fetched_jars(
        kafka_settings: KafkaSettings, topics: object) -> None:
    # docs/kafka.md: records are plain JSON, so Kafka's console consumer reads every topic. Its
    # tools come with the jars `openforge kafka fetch` puts in the cache.
    libs = ensure_kafka_jars(BrokerSettings().version)
    event = reward("r-console", 0.5)
    async with EventProducer(kafka_settings) as producer:
        await producer.publish(REWARDS, event)
    topic = TopicRegistry.from_settings(kafka_settings)[REWARDS].name
    java = shutil.which("java")
    assert java, "Kafka's tools need java on PATH"
    read = await asyncio.to_thread(
        subprocess.run, [java, "-cp", f"{libs}/*", "org.apache.kafka.tools.consumer.ConsoleConsumer",
                         "--bootstrap-server", kafka_settings.bootstrap_servers, "--topic", topic,
                         "--from-beginning", "--max-messages", "1", "--timeout-ms", "60000",
                         "--formatter-property", "print.key=true"],
        capture_output=True, text=True, timeout=120, check=False)
    assert read.returncode == 0, read.stderr[-2000:]
    key, _, value = read.stdout.strip().partition("\t")
    assert key == "r-console"
    assert RewardV1.model_validate_json(value) == event
