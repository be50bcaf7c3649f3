"""``ack`` durability's spool and publisher on the paths that need no broker: a disk that refuses a
write, a rename lost by a power cut, and a call whose event the calls topic would not take."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from disklimits import file_size_limit

from producers.capture import CallCapture
from producers.durable import DurablePublisher
from producers.journal import Journal
from producers.journal_tail import lock_shipping
from producers.shipper import import_spool, spool_path
from producers.spool import DiskSpool, SpoolLockedError, unpack_record
from proxy.app import build_app
from proxy.settings import ProxySettings
from schemas import DeadLetterV1
from schemas.call.v1 import ApiProtocol, CallStatus, NormalizedRequest
from stream import DEAD_LETTERS, EventProducer, KafkaSettings, TopicRegistry

# Nothing listens here: the publisher keeps every event in its spool.
UNREACHABLE = KafkaSettings(bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)


def test_a_write_the_disk_refuses_is_not_counted_and_leaves_no_file(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    spool.append("t.calls", b"k", b"x" * 100, ())
    with file_size_limit(50), pytest.raises(OSError):
        spool.append("t.calls", b"k", b"y" * 100, ())
    # Counted, the record that is not there would keep the spool "not empty" (its publisher off
    # Kafka until a restart) and fill the bound with bytes that are not on disk.
    assert len(spool) == 1 and spool.size_bytes == (tmp_path / f"{0:020d}.rec").stat().st_size
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".rec"]
    spool.remove(spool.oldest(10)[0])
    assert len(spool) == 0 and spool.size_bytes == 0


def test_leftover_temp_files_of_appends_that_never_returned_are_dropped(tmp_path: Path) -> None:
    # An append cut before its rename never returned, so its call was never answered and was sent
    # again under a new id: kept, it would be a second sample of that turn.
    spool = DiskSpool(tmp_path, 1 << 20)
    kept = spool.append("t.calls", b"k", b"answered", ())
    (tmp_path / f"{7:020d}.tmp").write_bytes(kept.read_bytes())
    again = DiskSpool(tmp_path, 1 << 20)
    again.claim()
    [record] = again.oldest(10)
    assert (record.value, len(again)) == (b"answered", 1)
    assert not list(tmp_path.glob("*.tmp"))
    again.release()


def test_a_spool_claimed_by_another_process_keeps_its_appends_in_progress(tmp_path: Path) -> None:
    # The temp file is the live writer's append before its rename: deleting it would fail that
    # append (and the call it holds) in the process that owns the folder.
    writer = DiskSpool(tmp_path, 1 << 20)
    writer.claim()
    in_progress = tmp_path / f"{3:020d}.tmp"
    in_progress.write_bytes(b"half")
    try:
        second = DiskSpool(tmp_path, 1 << 20)
        with pytest.raises(SpoolLockedError, match="another process is spooling events in"):
            second.claim()
        with pytest.raises(SpoolLockedError):
            import_spool(second, Journal(tmp_path / "journal", 1 << 20))
        assert in_progress.read_bytes() == b"half"
    finally:
        writer.release()
    second.claim()  # released: now it is a leftover
    assert not in_progress.exists()
    second.release()


def _capture(text_bytes: int) -> CallCapture:
    return CallCapture(rollout_id="r-big", call_id="c-big", protocol=ApiProtocol.OPENAI_CHAT, model="m",
                       request=NormalizedRequest(messages=[{"role": "user", "content": "x" * text_bytes}]),
                       streamed=False)


async def test_a_call_whose_event_is_too_large_for_its_topic_is_kept_as_a_dead_letter(tmp_path: Path) -> None:
    registry = TopicRegistry.from_settings(UNREACHABLE)
    spool = DiskSpool(tmp_path, 1 << 30)
    publisher = DurablePublisher(lambda: EventProducer(UNREACHABLE, registry=registry), spool, registry,
                                 ack_timeout_s=0.5, drain_interval_s=60)
    await publisher.start()
    try:
        # Over the calls topic's limit: before, a ValueError out of the record, a 500 to the
        # harness, and no trace of the call anywhere.
        outcome = await publisher.publish_call(_capture(17 * 1024 * 1024), CallStatus.OK, upstream_status_code=200,
                                               error_message=None, upstream_replica="r0")
    finally:
        await publisher.stop()
    assert outcome == "spool"
    _assert_spooled_letter(tmp_path, registry[DEAD_LETTERS].name)


def _assert_spooled_letter(folder: Path, letters: str) -> None:
    [path] = folder.glob("*.rec")
    record = unpack_record(path, path.read_bytes())
    assert record.topic == letters
    letter = DeadLetterV1.model_validate_json(record.value)
    assert "exceeds" in letter.reason and letter.key == b"r-big"
    assert b'"call_id":"c-big"' in letter.value and not letter.value_truncated


def test_ack_durability_refuses_to_start_over_a_journal_left_unshipped(tmp_path: Path) -> None:
    # Switched from journal durability with events still in the journal: ack mode does not read
    # it, so they would wait on disk unseen for as long as the setting stays.
    journal = Journal(spool_path(tmp_path), 1 << 20, mark_interval_s=0)
    journal.open()
    for i in range(3):
        journal.append("t.calls", b"r-1", f"value-{i}".encode(), ())
    journal.close()
    settings = ProxySettings(credential_key="k" * 32, durability="ack", spool_dir=tmp_path)
    with pytest.raises(ValueError, match="holds 3 events not yet in Kafka"):
        build_app(settings)
    journal = Journal(spool_path(tmp_path), 1 << 20, mark_interval_s=0)
    journal.open()
    journal.mark_shipped(journal.read(10, 1 << 20))
    journal.close()
    build_app(settings)  # all shipped: nothing is stranded


def test_ack_durability_waits_for_a_shipper_still_draining_the_journal_and_sees_what_it_shipped(
        tmp_path: Path) -> None:
    # The shipping process of the journal-mode run before may still drain the folder as its proxy
    # exits. The check used to open the journal under it (cutting and starting segments, writing
    # back an older shipped mark) and, here, to refuse: the 3 records were on their way to Kafka.
    folder = spool_path(tmp_path)
    journal = Journal(folder, 1 << 20, mark_interval_s=0)
    journal.open()
    for i in range(3):
        journal.append("t.calls", b"r-1", f"value-{i}".encode(), ())
    journal.close()
    settings = ProxySettings(credential_key="k" * 32, durability="ack", spool_dir=tmp_path)
    draining = lock_shipping(folder, 1.0)  # the old shipper, still at work
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            build_app(settings)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread to assert on
            outcome.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    try:
        time.sleep(0.5)
        assert not outcome, outcome  # waiting for the shipper, not judging the journal under it
        shipper = Journal(folder, 1 << 20, mark_interval_s=0)
        shipper.open()
        shipper.mark_shipped(shipper.read(10, 1 << 20))  # it ships the rest, then exits
        shipper.close()
    finally:
        os.close(draining)
        starting.join(10)
    assert outcome == [None]  # nothing was left unshipped once it let go


async def test_a_second_publisher_on_one_spool_folder_is_refused_at_start(tmp_path: Path) -> None:
    # Both would number their files alike and overwrite each other's records.
    registry = TopicRegistry.from_settings(UNREACHABLE)

    def publisher() -> DurablePublisher:
        return DurablePublisher(lambda: EventProducer(UNREACHABLE, registry=registry), DiskSpool(tmp_path, 1 << 20),
                                registry, ack_timeout_s=0.5, drain_interval_s=60)

    first = publisher()
    await first.start()
    try:
        with pytest.raises(SpoolLockedError, match="give each proxy a spool folder of its own"):
            await publisher().start()
    finally:
        await first.stop()
    again = publisher()  # released at stop
    await again.start()
    await again.stop()
