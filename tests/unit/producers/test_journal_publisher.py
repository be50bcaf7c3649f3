"""The journalling publisher's failure paths that need no broker: damage found while shipping, bounds, what is said."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaConnectionError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)

from producers.journal import Journal, JournalCorruptError, JournalLockedError
from producers.journal_tail import lock_shipping
from producers.ship_worker import WorkerSpec
from producers.shipper import JournalPublisher, Shipper
from stream import REWARDS, EventProducer, KafkaSettings, NotAuthorizedError, TopicRegistry
from stream.topics import unauthorized_topics

# Nothing listens here: the publisher must keep working from its journal alone.
UNREACHABLE = KafkaSettings(bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)


@pytest.fixture(params=["inline", "process"])
def shipper(request: pytest.FixtureRequest) -> str:
    """Where the journal is shipped from: the publisher's event loop, or a worker process."""
    mode: str = request.param
    return mode


def _journal(folder: Path, shipper: str) -> Journal:
    return Journal(folder, 1 << 20, shipped_elsewhere=shipper == "process")


def _publisher(journal: Journal) -> JournalPublisher:
    registry = TopicRegistry.from_settings(UNREACHABLE)
    worker = WorkerSpec(UNREACHABLE.model_dump(mode="json"), ack_timeout_s=0.5, linger_s=0) \
        if journal.shipped_elsewhere else None
    return JournalPublisher(lambda: EventProducer(UNREACHABLE, registry=registry), journal, registry,
                            ack_timeout_s=0.5, fsync_interval_s=0, linger_s=0, worker=worker)


def _corrupt_last_byte(folder: Path) -> Path:
    """Flip bits in the oldest written segment: the disk returns something else than was written."""
    segment = sorted(p for p in folder.glob("*.log") if p.stat().st_size)[0]
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF
    segment.write_bytes(bytes(data))
    return segment


async def test_damage_found_while_shipping_stops_intake_and_keeps_the_files(tmp_path: Path, shipper: str) -> None:
    journal = _journal(tmp_path, shipper)
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


async def test_without_kafka_events_stay_in_the_journal_across_stop(tmp_path: Path, shipper: str) -> None:
    journal = _journal(tmp_path, shipper)
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


async def test_a_second_proxy_on_the_same_folder_is_refused_at_once(tmp_path: Path, shipper: str) -> None:
    """With a shipping worker, the first proxy's worker holds the shipper's lock for as long as it
    runs: a second proxy waited a minute for it, then failed with a message about the worker."""
    first = _publisher(_journal(tmp_path, shipper))
    await first.start()
    try:
        second = _publisher(_journal(tmp_path, shipper))
        with pytest.raises(JournalLockedError, match="spool folder of its own"):
            await asyncio.wait_for(second.start(), 10)
    finally:
        await first.stop()


async def test_an_inline_shipper_waits_for_a_worker_of_an_earlier_proxy_still_draining(tmp_path: Path) -> None:
    """A proxy in process mode was stopped and its shipping worker still drains the folder (it
    holds the shipper lock); a proxy started on the folder with the inline shipper waits for it
    before recovering and shipping. It used to start at once, and the two shippers both sent and
    deleted segments."""
    draining = lock_shipping(tmp_path, 1.0)  # what the old worker holds until it exits
    publisher = _publisher(_journal(tmp_path, "inline"))
    starting = asyncio.create_task(publisher.start())
    try:
        await asyncio.sleep(0.5)
        assert not starting.done()
    finally:
        os.close(draining)
    await asyncio.wait_for(starting, 10)
    try:
        with pytest.raises(TimeoutError):
            os.close(lock_shipping(tmp_path, 0.2))  # held by the inline shipper now
    finally:
        await publisher.stop()
    os.close(lock_shipping(tmp_path, 0.2))  # and let go at stop


async def test_a_start_stopped_while_it_waits_for_the_shipper_lock_leaves_no_lock_behind(tmp_path: Path) -> None:
    """The proxy is stopped (its start cancelled) while an earlier proxy's worker still holds
    the shipper lock. The wait went on in its thread and took the lock once the old worker let
    go, with nobody left to close it: every later shipper on the folder waited for this process
    to exit."""
    draining = lock_shipping(tmp_path, 1.0)
    publisher = _publisher(_journal(tmp_path, "inline"))
    starting = asyncio.create_task(publisher.start())
    await asyncio.sleep(0.3)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    os.close(draining)
    await asyncio.sleep(0.3)  # the abandoned wait has seen the lock free by now
    os.close(lock_shipping(tmp_path, 0.2))  # nobody holds it
    await publisher.stop()


async def test_a_shipping_worker_that_cannot_be_started_again_at_once_is_tried_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker died, and starting another fails once (injected: no process can be made, as
    with no memory or no descriptor left). The supervisor used to end there, leaving the proxy
    without a shipper until its journal filled; it now tries again."""
    publisher = _publisher(_journal(tmp_path, "process"))
    await publisher.start()
    try:
        worker = publisher._worker
        assert worker is not None and worker._process is not None
        real = asyncio.create_subprocess_exec
        failures = []

        async def refuse_once(*args: object, **kwargs: object) -> asyncio.subprocess.Process:
            if not failures:
                failures.append(args)
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return await real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(asyncio, "create_subprocess_exec", refuse_once)
        first = worker._process
        first.kill()
        for _ in range(200):
            if worker.restarts == 1 and worker._process is not first:
                break
            await asyncio.sleep(0.05)
        assert failures and worker.restarts == 1
        assert worker._process is not first and worker._process.returncode is None
    finally:
        await publisher.stop()


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
