"""A topic the cluster's ACLs do not let the proxy write: events wait on disk, and the log says what to grant.

Managed and shared clusters authorise every client per topic. An ACL missing for one topic (a
topic added in a new release, a prefix mistyped) is the operator's to fix; until then the
journal keeps the events, as it does while a topic is missing, rather than the shipper setting
every one aside on the dead-letter topic. The test starts its own broker with Kafka's
``StandardAuthorizer``: its plaintext listener (the readiness probe, the test's own admin) is a
super user, its SASL listener logs the shipper in as ``User:shipper``, and ACLs are granted
with Kafka's own Admin client (``tests/java/GrantAcls.java``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from netutil import free_port, free_port_pair
from proxy_helpers import proxy_in_front_of, stored, until

from producers.journal import Journal
from producers.shipper import Shipper, connect_producer
from schemas.credentials import Role
from stream import CALLS, DEAD_LETTERS, REWARDS, ROLLOUTS, EventProducer, KafkaSettings, TopicRegistry, TopicSpec
from stream.admin import KafkaAdmin
from stream.broker import BrokerSettings, LocalBroker, ensure_kafka_jars

pytestmark = pytest.mark.kafka

USER = "shipper"
PROXY = "proxy"
"""The principal of the least-privilege test, granted only what docs/kafka.md lists for the proxy."""
STRANGER = "stranger"
"""A user no test grants anything (ACLs are the principal's across every topic prefix)."""
PASSWORD = "acl-" + uuid.uuid4().hex[:8]
GRANT_ACLS = Path(__file__).parents[2] / "java" / "GrantAcls.java"


class _AuthorizingBroker(LocalBroker):
    """The suite's single-node broker with an authorizer and a SASL/PLAIN listener (``shipper``, ``stranger``)."""

    def __init__(self, settings: BrokerSettings, sasl_port: int) -> None:
        super().__init__(settings)
        self.sasl_port = sasl_port

    def _write_config(self) -> Path:
        config = super()._write_config()
        port, controller = self.settings.port, self.settings.controller_port
        plain = (f'org.apache.kafka.common.security.plain.PlainLoginModule required user_{USER}="{PASSWORD}" '
                 f'user_{STRANGER}="{PASSWORD}" user_{PROXY}="{PASSWORD}";')
        extra = {  # later keys win in a properties file
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},"
                         f"SASL://127.0.0.1:{self.sasl_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},SASL://127.0.0.1:{self.sasl_port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL:SASL_PLAINTEXT",
            "listener.name.sasl.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl.plain.sasl.jaas.config": plain,
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:ANONYMOUS",  # the plaintext listeners: probe, controller, the test's admin
        }
        with config.open("a") as out:
            out.writelines(f"{key}={value}\n" for key, value in extra.items())
        return config

    def grant(self, topic: str, *operations: str, user: str = USER) -> None:
        """Allow ``User:<user>`` ``operations`` on ``topic``."""
        libs = ensure_kafka_jars(self.settings.version, self.settings.cache_dir)
        done = subprocess.run(["java", "-cp", f"{libs}/*", str(GRANT_ACLS), self.bootstrap, f"User:{user}", topic,
                               ",".join(operations)], capture_output=True, text=True, check=False, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def authorizing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_AuthorizingBroker]:
    port = free_port_pair()
    broker = _AuthorizingBroker(BrokerSettings(port=port, controller_port=port + 1,
                                               data_dir=str(tmp_path_factory.mktemp("acl-kafka"))), free_port())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def _made(broker: _AuthorizingBroker, user: str = USER) -> tuple[KafkaSettings, KafkaSettings, TopicRegistry]:
    """The admin's settings (super user), ``user``'s, and the registry, its topics made by the admin."""
    prefix = f"acl{uuid.uuid4().hex[:8]}."
    admin_settings = KafkaSettings(bootstrap_servers=broker.bootstrap, topic_prefix=prefix, partitions=1,
                                   linger_ms=0)
    shipper_settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{broker.sasl_port}", topic_prefix=prefix,
                                     partitions=1, linger_ms=0, security_protocol="SASL_PLAINTEXT",
                                     sasl_mechanism="PLAIN", sasl_username=user, sasl_password=PASSWORD)
    registry = TopicRegistry.from_settings(admin_settings)
    async with KafkaAdmin(admin_settings, registry) as admin:
        await admin.create_topics([registry[REWARDS], registry[DEAD_LETTERS]])
    return admin_settings, shipper_settings, registry


@contextlib.asynccontextmanager
async def _shipping(kafka: KafkaSettings, registry: TopicRegistry, journal: Journal) -> AsyncIterator[Shipper]:
    """A shipper running over ``journal`` as ``kafka``'s user; stopped, and the journal closed, after."""
    shipper = Shipper(lambda: EventProducer(kafka, registry=registry), journal, registry, ack_timeout_s=10.0,
                      linger_s=0.01, idle_wait_s=0.05)
    runner = asyncio.create_task(shipper.run())
    try:
        yield shipper
    finally:
        shipper.stop_when_done()
        await asyncio.wait_for(runner, 30)
        await shipper.close()
        journal.close()


def _said(caplog: pytest.LogCaptureFixture, *parts: str) -> bool:
    return any(r.levelno >= logging.ERROR and all(p in r.getMessage() for p in parts) for r in caplog.records)


@pytest.mark.parametrize("rewards_acl", [("Describe",), ()], ids=["describe-only", "none"])
async def test_events_for_a_topic_the_client_may_not_write_wait_in_the_journal_until_it_is_granted(
        authorizing: _AuthorizingBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        rewards_acl: tuple[str, ...]) -> None:
    admin, kafka, registry = await _made(authorizing)
    rewards, letters = registry[REWARDS].name, registry[DEAD_LETTERS].name
    # The dead-letter topic is writable (and so the idempotent producer may start): a shipper
    # that took the refusal for the record's fault would set every event aside there.
    authorizing.grant(letters, "Write", "Describe")
    if rewards_acl:  # the topic is visible, and the broker refuses the produce request itself
        authorizing.grant(rewards, *rewards_acl)

    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    async with _shipping(kafka, registry, journal) as shipper:
        with caplog.at_level(logging.INFO):
            last = -1
            for i in range(5):
                last = journal.append(rewards, f"r-{i}".encode(), bytes([i]) * 200, ())
            shipper.wake()
            assert await until(lambda: _said(caplog, f"does not let User:{USER} write to topic {rewards}",
                                               "kafka-acls.sh", "--operation Write", "wait in"), 30.0), \
                [r.getMessage() for r in caplog.records]
            assert shipper.shipped < 0 and shipper.refused == 0
            # Readiness's "kafka" stays false through the tries that follow, not true while each one lasts.
            assert not await until(lambda: shipper.kafka_ok, 4.0, every_s=0.001), "kafka_ok turned true while the topic refused"
            assert len(journal) == 5
            assert await stored(admin, registry, letters) == 0

            authorizing.grant(rewards, "Write", "Describe")
            assert await until(lambda: shipper.shipped >= last, 40.0), "granted, the waiting events were not sent"
    assert await stored(admin, registry, rewards) == 5
    assert await stored(admin, registry, letters) == 0
    assert shipper.refused == 0


async def test_a_client_the_cluster_lets_write_nowhere_is_told_what_to_grant(
        authorizing: _AuthorizingBroker, caplog: pytest.LogCaptureFixture) -> None:
    _, kafka, registry = await _made(authorizing, STRANGER)
    with caplog.at_level(logging.INFO):
        # An idempotent producer asks for its id at its start; a principal that may write nowhere is refused there.
        producer = await connect_producer(lambda: EventProducer(kafka, registry=registry), 20.0,
                                          "events wait on disk")
    assert producer is None
    assert _said(caplog, f"does not let User:{STRANGER} use an idempotent producer", "kafka-acls.sh",
                 "IdempotentWrite --cluster", "events wait on disk"), \
        [r.getMessage() for r in caplog.records]


async def test_records_for_allowed_topics_are_not_sent_again_at_every_try_while_one_topic_is_forbidden(
        authorizing: _AuthorizingBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A batch that mixes topics: Kafka stores the allowed ones and refuses the forbidden one's."""
    admin, kafka, registry = await _made(authorizing)
    rewards, rollouts = registry[REWARDS].name, registry[ROLLOUTS].name
    async with KafkaAdmin(admin, registry) as made:
        await made.create_topics([registry[ROLLOUTS]])
    authorizing.grant(rollouts, "Write", "Describe")
    authorizing.grant(rewards, "Describe")

    journal = Journal(tmp_path, 64 << 20)
    journal.open()
    for i, topic in enumerate((rollouts, rewards, rollouts, rollouts)):
        journal.append(topic, f"k-{i}".encode(), bytes([i]) * 100, ())
    async with _shipping(kafka, registry, journal) as shipper:
        with caplog.at_level(logging.INFO):
            # Three tries after the first (0.5, 1 and 2 s apart).
            assert await until(lambda: shipper.publish_errors >= 4, 30.0)
            # The first try stored the three rollouts records; after it, only the head went again.
            assert await stored(admin, registry, rollouts) <= 4
            authorizing.grant(rewards, "Write")
            assert await until(lambda: shipper.shipped >= 3, 40.0)
    assert await stored(admin, registry, rewards) == 1
    assert 3 <= await stored(admin, registry, rollouts) <= 6  # each at most once again


async def test_write_on_the_calls_rewards_and_dead_letter_topics_is_all_a_proxy_needs(
        authorizing: _AuthorizingBroker, vllm_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The least a proxy's principal must be granted, as docs/kafka.md lists it, is enough for a call and a reward.

    WRITE implies DESCRIBE, and from Kafka 3.0 WRITE on any topic implies the idempotent
    producer's IdempotentWrite on the cluster: no group, no READ, no cluster grant.
    """
    admin, kafka, registry = await _made(authorizing, PROXY)
    async with KafkaAdmin(admin, registry) as made:
        await made.create_topics()
    for spec in (CALLS, REWARDS, DEAD_LETTERS):
        authorizing.grant(registry[spec].name, "Write", user=PROXY)
    with caplog.at_level(logging.INFO):
        async with proxy_in_front_of(vllm_url, kafka, registry, tmp_path) as proxy, httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{proxy.base('r-acl')}/v1/chat/completions",
                                       headers={"Authorization": f"Bearer {proxy.token('r-acl')}"},
                                       json={"model": "m", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hello"}]})
            assert answer.status_code == 200, answer.text
            reward = await client.post(f"{proxy.base('r-acl')}/reward", json={"value": 1.0},
                                       headers={"Authorization": f"Bearer {proxy.token('r-acl', Role.VERIFIER)}"})
            assert reward.status_code == 202 and reward.json()["stored"] == "kafka", reward.text
            assert await _until_stored(admin, registry, CALLS, 1) and await _until_stored(admin, registry, REWARDS, 1)
    assert not [r.getMessage() for r in caplog.records if "does not let" in r.getMessage()]
    assert await stored(admin, registry, registry[DEAD_LETTERS].name) == 0


async def _until_stored(kafka: KafkaSettings, registry: TopicRegistry, spec: TopicSpec, count: int) -> bool:
    deadline = asyncio.get_running_loop().time() + 30
    while asyncio.get_running_loop().time() < deadline:
        if await stored(kafka, registry, registry[spec].name) >= count:
            return True
        await asyncio.sleep(0.2)
    return False
