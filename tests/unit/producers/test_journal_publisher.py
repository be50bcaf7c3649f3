"""The journalling publisher's failure paths that need no broker: damage found while shipping, bounds, what is said."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaConnectionError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)

from producers.journal import Journal, JournalCorruptError, JournalLockedError
from producers.shipper import JournalPublisher, Shipper
from stream import REWARDS, EventProducer, KafkaSettings, NotAuthorizedError, TopicRegistry
from stream.topics import unauthorized_topics

# Nothing listens here: the publisher must keep working from its journal alone.
UNREACHABLE = KafkaSettings(bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)


def _publisher(journal: Journal) -> JournalPublisher:
    registry = TopicRegistry.from_settings(UNREACHABLE)
    return JournalPublisher(lambda: EventProducer(UNREACHABLE, registry=registry), journal, registry,
                            ack_timeout_s=0.5, fsync_interval_s=0, linger_s=0)


def _corrupt_last_byte(folder: Path) -> Path:
    """Flip bits in the oldest written segment: the disk returns something else than was written."""
    segment = sorted(p for p in folder.glob("*.log") if p.stat().st_size)[0]
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF
    segment.write_bytes(bytes(data))
    return segment


async def test_damage_found_while_shipping_stops_intake_and_keeps_the_files(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    publisher = _publisher(journal)
    await publisher.start()
    try:
        assert publisher.accepting
        journal.append("t.calls", b"r-1", b"a value of some length", ())
        segment = _corrupt_last_byte(tmp_path)
        publisher.wake()
        for _ in range(100):
            if publisher.failed:
                break
            await asyncio.sleep(0.02)
        assert publisher.failed and not publisher.accepting  # the proxy answers 503, not ready
    finally:
        await publisher.stop()
    assert segment.exists()  # left for an operator


async def test_without_kafka_events_stay_in_the_journal_across_stop(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    publisher = _publisher(journal)
    await publisher.start()
    try:
        for i in range(3):
            journal.append("t.calls", f"r-{i}".encode(), b"v", ())
        publisher.wake()
        await asyncio.sleep(0.3)
        assert publisher.backlog == 3 and not publisher.kafka_ok
    finally:
        await publisher.stop()
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert len(again) == 3 and [r.key for r in again.read(10, 1 << 20)] == [b"r-0", b"r-1", b"r-2"]
    again.close()


async def test_a_damaged_older_segment_stops_the_start_naming_the_file(tmp_path: Path) -> None:
    first = Journal(tmp_path, 1 << 20)
    first.open()
    first.append("t.calls", b"r-1", b"value", ())
    first.close()
    second = Journal(tmp_path, 1 << 20)  # a second start: the first segment is now an older one
    second.open()
    second.append("t.calls", b"r-2", b"value", ())
    second.close()
    segment = _corrupt_last_byte(tmp_path)
    publisher = _publisher(Journal(tmp_path, 1 << 20))
    with pytest.raises(JournalCorruptError, match=segment.name):
        await publisher.start()


async def test_a_second_proxy_on_the_same_folder_is_refused_at_once(tmp_path: Path) -> None:
    first = _publisher(Journal(tmp_path, 1 << 20))
    await first.start()
    try:
        second = _publisher(Journal(tmp_path, 1 << 20))
        with pytest.raises(JournalLockedError, match="spool folder of its own"):
            await asyncio.wait_for(second.start(), 10)
    finally:
        await first.stop()


async def test_a_producer_that_cannot_be_made_is_reported_not_retried_in_silence(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A factory that raises (settings a client refuses, say) is a failure to name, not an unreachable Kafka."""
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    registry = TopicRegistry.from_settings(UNREACHABLE)

    def broken() -> EventProducer:
        raise ValueError("no such compression: brotli")

    shipper = Shipper(broken, journal, registry, ack_timeout_s=0.5, idle_wait_s=0.05)
    journal.append(registry[REWARDS].name, b"k", b"v", ())
    runner = asyncio.create_task(shipper.run())
    try:
        for _ in range(100):
            if shipper.publish_errors:
                break
            await asyncio.sleep(0.02)
        assert any("no such compression: brotli" in r.getMessage() and r.levelname == "WARNING"
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert len(journal) == 1
    finally:
        shipper.stop_when_done()
        await asyncio.wait_for(runner, 10)
        journal.close()


@pytest.mark.parametrize(("settings", "who", "granted"), [
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "trainer",
      "sasl_password": "p-secret"}, "User:trainer", "--allow-principal User:trainer"),
    ({"security_protocol": "SSL", "ssl_certfile": "/etc/hosts", "ssl_keyfile": "/etc/hosts"},
     "the principal of the certificate /etc/hosts (User:CN=...)", "--allow-principal User:<principal>"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "proxy-client",
      "sasl_password": "p-secret", "sasl_oauth_token_url": "https://idp.example/token"},
     "the principal of OAuth client 'proxy-client' (its token's subject)", "--allow-principal User:<principal>"),
    ({}, "User:ANONYMOUS", "--allow-principal User:ANONYMOUS"),
])
def test_the_not_authorized_error_names_the_principal_and_the_acl_to_grant(
        settings: dict[str, object], who: str, granted: str) -> None:
    kafka = KafkaSettings(bootstrap_servers="b-1.example:9096", **settings)  # type: ignore[arg-type]
    message = str(NotAuthorizedError.of(["p.calls", "p.dlq"], kafka))
    assert f"does not let {who} write to topics p.calls, p.dlq" in message
    assert granted in message and "--operation Write --operation Describe --topic p.calls --topic p.dlq" in message
    assert "p-secret" not in message
    for refused_producer in (NotAuthorizedError.of([], kafka), NotAuthorizedError.of(["p.calls"], kafka,
                                                                                     cluster=True)):
        assert f"does not let {who} use an idempotent producer" in str(refused_producer)
        assert "IdempotentWrite --cluster" in str(refused_producer)


def test_authorization_failures_are_told_apart_from_other_errors() -> None:
    assert unauthorized_topics(TopicAuthorizationFailedError("a.calls"), ["x"]) == ["a.calls"]
    assert unauthorized_topics(TopicAuthorizationFailedError({"b", "a"}), ["x"]) == ["a", "b"]
    assert unauthorized_topics(TopicAuthorizationFailedError(), ["y", "x", "y"]) == ["x", "y"]
    assert unauthorized_topics(ClusterAuthorizationFailedError(), ["x"]) == ["x"]
    assert unauthorized_topics(KafkaConnectionError("gone"), ["x"]) is None
    assert unauthorized_topics(MessageSizeTooLargeError(), ["x"]) is None
