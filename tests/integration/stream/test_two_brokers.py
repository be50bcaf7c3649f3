"""Topic creation on a cluster of two brokers, as clusters run (the suite's broker is one node).

``create_topics`` returns once every broker shows each new topic with a leader on every
partition: a client may take its metadata from either. A broker that cannot be reached is passed
over while another answers, and so is one that stops answering, after its own 5 s; when none
can be reached, or none answers by the wait's deadline, the error says so. The test starts its own
pair: a node that is broker and controller, and a second node that is a broker only, joined to
the first's controller.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError
from aiokafka.protocol.metadata import MetadataRequest
from netutil import free_port, free_port_pair

from stream.admin import KafkaAdmin
from stream.broker import BrokerSettings, LocalBroker, ensure_kafka_jars
from stream.settings import KafkaSettings

pytestmark = pytest.mark.kafka


@pytest.fixture
def two_brokers(tmp_path: Path) -> Iterator[tuple[LocalBroker, subprocess.Popen[bytes], str]]:
    port = free_port_pair()
    first = LocalBroker(BrokerSettings(port=port, controller_port=port + 1, data_dir=str(tmp_path / "first")))
    first.start()
    second: subprocess.Popen[bytes] | None = None
    try:
        second_port = free_port()
        data = tmp_path / "second"
        data.mkdir()
        # The first node's settings, as a broker only: its own id, listener and folder.
        own = {"process.roles": "broker", "node.id": "2", "listeners": f"PLAINTEXT://127.0.0.1:{second_port}",
               "advertised.listeners": f"PLAINTEXT://127.0.0.1:{second_port}", "log.dirs": str(data / "logs")}
        lines = (first.data_dir / "server.properties").read_text().splitlines()
        config = data / "server.properties"
        config.write_text("\n".join([line for line in lines if line.split("=", 1)[0] not in own]
                                    + [f"{key}={value}" for key, value in own.items()]) + "\n")
        meta = (first.data_dir / "kraft-logs" / "meta.properties").read_text()
        cluster_id = next(line.split("=", 1)[1] for line in meta.splitlines() if line.startswith("cluster.id="))
        libs = ensure_kafka_jars(first.settings.version, first.settings.cache_dir)
        log4j = f"-Dlog4j2.configurationFile={first.data_dir / 'log4j2.properties'}"
        formatted = subprocess.run(["java", log4j, "-cp", f"{libs}/*", "kafka.tools.StorageTool", "format",
                                    f"--cluster-id={cluster_id}", "-c", str(config)],
                                   capture_output=True, text=True, check=False)
        assert formatted.returncode == 0, formatted.stdout + formatted.stderr
        with (data / "kafka.log").open("ab") as log:
            second = subprocess.Popen(["java", "-Xmx256m", log4j, "-cp", f"{libs}/*", "kafka.Kafka", str(config)],
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        yield first, second, f"127.0.0.1:{second_port}"
    finally:
        if second is not None:
            second.kill()
            second.wait()
        first.stop()


async def _both_up(bootstrap: str, second: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    """Wait until the cluster's metadata lists both brokers (the second registers as it starts)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len((await admin.describe_cluster())["brokers"]) < 2:
            exited, late = second.poll() is not None, asyncio.get_running_loop().time() >= deadline
            if exited or late:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])  # noqa: ASYNC240 - failing anyway
                raise AssertionError(f"the second broker {'exited' if exited else 'never registered'}:\n{tail}")
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def test_create_waits_for_every_broker_and_passes_over_one_gone(two_brokers, monkeypatch) -> None:
    first, second, second_address = two_brokers
    await _both_up(first.bootstrap, second, first.data_dir.parent / "second" / "kafka.log")
    settings = KafkaSettings(bootstrap_servers=first.bootstrap, topic_prefix="two.", partitions=4)
    async with KafkaAdmin(settings) as admin:
        names = [result.name for result in await admin.create_topics()]
        # Asked of the broker-only node, right after the call returned: every partition led.
        client = AIOKafkaClient(bootstrap_servers=second_address)
        await client.bootstrap()
        try:
            shown = (await client.send(2, MetadataRequest(names))).to_object()["topics"]
        finally:
            await client.close()
        assert {meta["topic"] for meta in shown} == set(names)
        leaders = {p["leader"] for meta in shown for p in meta["partitions"]}
        assert all(meta["error_code"] == 0 for meta in shown) and leaders == {1, 2}, shown

        # A broker that stops answering (paused, as a hung process or a dropped network looks
        # to a client) is passed over once its own bound runs out, not after the client's 40 s
        # request timeout: the brokers are asked at once, each on a connection of its own (the
        # admin client opens its connections one at a time, so a paused broker's would hold the
        # other's), for at most 5 s, here 1 s: the controller fences a broker silent for 9 s, and
        # its partitions, led by nobody then, would rightly keep the wait from returning.
        first_pid = first.status().pid
        assert first_pid is not None
        monkeypatch.setattr("stream.admin._VISIBLE_ASK_S", 1.0)
        second.send_signal(signal.SIGSTOP)
        async with asyncio.timeout(5):
            await admin.await_visible(names)
        # When none answers in time the wait polls on to its own deadline, then says so.
        os.kill(first_pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError, match=r"no broker answered a metadata request within 1 s"):
                async with asyncio.timeout(15):
                    await admin.await_visible(names, timeout_s=2.0)
        finally:
            os.kill(first_pid, signal.SIGCONT)

        second.kill()
        second.wait()
        # Passed over, not raised: the first still answers (what it shows of the second's
        # partitions depends on whether the controller has fenced the second yet).
        conns: dict[int, Any] = {}
        try:
            assert set(await admin._not_usable_everywhere(names, conns) or ()) <= set(names)
            first.kill()
            with pytest.raises(KafkaError):
                await admin._not_usable_everywhere(names, conns)
        finally:
            for conn in conns.values():
                conn.close()
