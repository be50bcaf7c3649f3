"""The proxy's write-ahead journal: order, the shipped mark, restarts, torn tails, segments, bounds."""

from __future__ import annotations

import errno
import os
import resource
import signal
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from disklimits import file_size_limit

from producers.journal import Journal, JournalCorruptError, JournalLockedError, lock_folder, pack_record
from producers.shipper import take_over_spool


def _fill(journal: Journal, count: int, start: int = 0, size: int = 10) -> None:
    for i in range(start, start + count):
        journal.append("t.calls", f"r-{i % 3}".encode(), f"value-{i}".encode().ljust(size, b"."),
                       (("h", str(i).encode()),))


def _values(records: list) -> list[int]:
    return [int(r.value.split(b"-")[1].rstrip(b".")) for r in records]


def test_records_come_back_in_order_with_what_was_written(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 5)
    records = journal.read(100, 1 << 20)
    assert _values(records) == [0, 1, 2, 3, 4]
    assert [r.seq for r in records] == [0, 1, 2, 3, 4]
    assert records[1].key == b"r-1" and records[1].headers == (("h", b"1"),) and records[1].topic == "t.calls"
    assert journal.read(100, 1 << 20) == []  # the cursor moved on
    assert len(journal) == 5 and journal.pending_bytes == sum(r.size for r in records)


def test_batches_respect_record_and_byte_limits_but_never_starve(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 10, size=1000)
    assert len(journal.read(3, 1 << 20)) == 3
    assert len(journal.read(100, 2500)) == 3  # the batch may end past the byte limit, by one record
    assert len(journal.read(100, 1)) == 1  # one record even when it alone exceeds the limit
    assert _values(journal.read(100, 1 << 20)) == [7, 8, 9]


def test_a_restart_sends_again_exactly_what_was_not_marked_shipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20, mark_interval_s=0)
    journal.open()
    _fill(journal, 6)
    first = journal.read(4, 1 << 20)
    journal.mark_shipped(first[:2])
    journal.close()  # as after a crash: records 2..5 are not known to be in Kafka

    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert again.shipped == 1 and len(again) == 4
    assert _values(again.read(100, 1 << 20)) == [2, 3, 4, 5]
    _fill(again, 1, start=6)
    assert [r.seq for r in again.read(100, 1 << 20)] == [6]  # numbering continues


def test_rewind_after_a_failed_send_resends_from_the_first_unshipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 5)
    journal.mark_shipped(journal.read(2, 1 << 20))
    assert _values(journal.read(10, 1 << 20)) == [2, 3, 4]
    journal.rewind()
    again = journal.read(10, 1 << 20)
    assert _values(again) == [2, 3, 4]
    with pytest.raises(ValueError, match="shipped"):  # out of order: a hole would be marked shipped
        journal.mark_shipped(again[1:])


def test_a_torn_tail_is_cut_off_and_a_damaged_middle_is_refused(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 3)
    journal.close()
    [segment] = sorted(tmp_path.glob("*.log"))
    with segment.open("ab") as handle:  # a crash in the middle of writing a fourth record
        handle.write(b"\x40\x00\x00\x00garbage")
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert _values(again.read(10, 1 << 20)) == [0, 1, 2] and again.next_seq == 3
    _fill(again, 2, start=3)
    again.close()

    # Damage inside an older segment (newer ones follow) is not a torn tail: refuse to guess.
    oldest = sorted(tmp_path.glob("*.log"))[0]
    data = bytearray(oldest.read_bytes())
    data[20] ^= 0xFF
    oldest.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError, match="damaged"):
        Journal(tmp_path, 1 << 20).open()


def _frame_offsets(segment: Path) -> list[int]:
    data, offsets, at = segment.read_bytes(), [], 0
    while at < len(data):
        offsets.append(at)
        at += 16 + struct.unpack_from("<I", data, at)[0]
    return offsets


def _ten_records_two_shipped(folder: Path) -> Path:
    """A closed journal of records 0-9 (200 bytes each), 0-1 marked shipped; its one segment."""
    journal = Journal(folder, 1 << 20, mark_interval_s=0)
    journal.open()
    _fill(journal, 10, size=200)
    journal.mark_shipped(journal.read(2, 1 << 20))
    journal.close()
    [segment] = sorted(folder.glob("*.log"))
    return segment


@pytest.mark.parametrize("damage", ["flipped bit", "zeroed block"])
def test_damage_in_the_newest_segment_keeps_it_aside_and_journals_the_good_records_after_it_again(
        tmp_path: Path, damage: str) -> None:
    # Records 0-9 were answered; the mark says 0-1 are in Kafka. Record 4's frame is damaged on
    # disk: cutting the segment there, as a torn tail is cut, would silently lose answered 5-9.
    segment = _ten_records_two_shipped(tmp_path)
    offsets = _frame_offsets(segment)
    data = bytearray(segment.read_bytes())
    if damage == "flipped bit":
        data[offsets[4] + 40] ^= 0x10
    else:  # records 4 and 5 and part of 6, zeros where they were
        data[offsets[4] + 3:offsets[6] + 30] = bytes(offsets[6] + 27 - offsets[4])
    segment.write_bytes(bytes(data))
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert segment.with_name(segment.name + ".damaged").read_bytes() == bytes(data)  # kept whole, as it was
    expected = [2, 3, 5, 6, 7, 8, 9] if damage == "flipped bit" else [2, 3, 7, 8, 9]
    assert _values(again.read(20, 1 << 20)) == expected  # only what the damage itself held is gone
    assert len(again) == len(expected)
    _fill(again, 1, start=10)
    assert _values(again.read(20, 1 << 20)) == [10]
    again.close()
    reopened = Journal(tmp_path, 1 << 20)  # what was journalled again survives the next start as well
    reopened.open()
    assert _values(reopened.read(20, 1 << 20)) == [*expected, 10]


@pytest.mark.parametrize("appended_before_the_crash", [0, 2])
def test_a_salvage_cut_short_is_finished_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, appended_before_the_crash: int) -> None:
    # The records after the damage were held only in memory and in the segment's copy between the
    # cut and their flush: a crash (or a full disk) there lost them, the cut segment reading as
    # whole at the next start. Now that start journals them again from the copy (some twice,
    # when the first try got that far: consumers drop copies by event id).
    segment = _ten_records_two_shipped(tmp_path)
    data = bytearray(segment.read_bytes())
    data[_frame_offsets(segment)[4] + 40] ^= 0x10
    segment.write_bytes(bytes(data))
    append = Journal.append
    calls = [0]

    def crash_part_way(self: Journal, *args: object, **kwargs: object) -> int:
        calls[0] += 1
        if calls[0] > appended_before_the_crash:
            raise OSError(28, "No space left on device")
        return append(self, *args, **kwargs)  # type: ignore[arg-type]

    failed = Journal(tmp_path, 1 << 20)
    with monkeypatch.context() as patched:
        patched.setattr(Journal, "append", crash_part_way)
        with pytest.raises(OSError, match="No space"):
            failed.open()
    failed.close()  # the process that failed to start ends (its lock goes with it)
    again = Journal(tmp_path, 1 << 20)
    again.open()
    kept = _values(again.read(20, 1 << 20))
    assert sorted(set(kept)) == [2, 3, 5, 6, 7, 8, 9], kept  # all but the damaged record
    assert kept[:2] == [2, 3] and kept[2:2 + appended_before_the_crash] == [5, 6][:appended_before_the_crash]
    assert not list(tmp_path.glob("*.salvaging"))  # finished: the next start journals nothing again
    again.close()
    reopened = Journal(tmp_path, 1 << 20)
    reopened.open()
    assert _values(reopened.read(20, 1 << 20)) == kept


def test_a_whole_frame_holding_no_record_this_version_reads_is_damage_not_a_crash(tmp_path: Path) -> None:
    # Its length and checksum pass (written by another version, say): the reader stops there and
    # says so, rather than raising an error the shipper does not expect and dying on it.
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 6)
    journal.close()
    [segment] = sorted(tmp_path.glob("*.log"))
    original = segment.read_bytes()
    offsets = _frame_offsets(segment)
    forged = b"OTHERFMT" + original[offsets[4] + 24:offsets[5]]
    frame = struct.pack("<IIQ", len(forged), zlib.crc32(forged), 4) + forged
    segment.write_bytes(original[:offsets[4]] + frame + original[offsets[5]:])
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert _values(again.read(4, 1 << 20)) == [0, 1, 2, 3]
    with pytest.raises(JournalCorruptError, match="byte .* not a journal record"):
        again.read(10, 1 << 20)


def test_a_zero_filled_or_torn_tail_is_cut_without_a_copy(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 3)
    journal.close()
    [segment] = sorted(tmp_path.glob("*.log"))
    with segment.open("ab") as handle:  # blocks allocated by a crash, never written
        handle.write(bytes(4096))
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert _values(again.read(10, 1 << 20)) == [0, 1, 2]
    assert not list(tmp_path.glob("*.damaged"))


def test_a_torn_tail_before_an_empty_newer_segment_is_still_a_torn_tail(tmp_path: Path) -> None:
    # A power cut while a segment rolled over: the next segment was made (empty) before the one
    # before it was flushed, whose tail is torn. Before, that read as damage before a newer
    # segment, and the proxy would not start until an operator looked.
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 3)
    journal.close()
    [segment] = sorted(tmp_path.glob("*.log"))
    with segment.open("ab") as handle:
        handle.write(b"\x40\x00\x00\x00garbage")
    (tmp_path / f"{3:020d}.log").touch()
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert _values(again.read(10, 1 << 20)) == [0, 1, 2] and again.next_seq == 3
    _fill(again, 2, start=3)
    assert _values(again.read(10, 1 << 20)) == [3, 4]
    again.close()


def test_segments_roll_and_shipped_ones_are_deleted(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 30, segment_bytes=2000, mark_interval_s=0)
    journal.open()
    _fill(journal, 20, size=500)
    assert len(list(tmp_path.glob("*.log"))) >= 5
    shipped: list[int] = []
    while batch := journal.read(3, 1 << 20):
        journal.mark_shipped(batch)
        shipped += _values(batch)
    assert shipped == list(range(20))
    assert len(journal) == 0 and journal.pending_bytes == 0
    assert len(list(tmp_path.glob("*.log"))) == 1  # only the active segment is left
    _fill(journal, 2, start=20)
    assert _values(journal.read(10, 1 << 20)) == [20, 21]
    journal.close()
    reopened = Journal(tmp_path, 1 << 30)
    reopened.open()
    assert reopened.shipped == 19 and _values(reopened.read(10, 1 << 20)) == [20, 21]


def test_a_start_deletes_the_last_runs_segment_once_it_is_shipped_whole(tmp_path: Path) -> None:
    # The active segment is deleted only once a newer one is written to. A start used to look for
    # shipped segments before it made its own, so the last run's segment, shipped whole, stayed
    # until this run's filled: on a small volume it held the space the journal needed, for good.
    journal = Journal(tmp_path, 1 << 30, segment_bytes=1 << 20, mark_interval_s=0)
    journal.open()
    _fill(journal, 20, size=500)
    journal.mark_shipped(journal.read(100, 1 << 20))
    journal.close()
    [left] = tmp_path.glob("*.log")
    assert left.stat().st_size > 10_000
    again = Journal(tmp_path, 1 << 30, segment_bytes=1 << 20)
    again.open()
    assert [p.stat().st_size for p in tmp_path.glob("*.log")] == [0]  # only this run's, empty
    assert again.shipped == 19 and len(again) == 0 and again.next_seq == 20
    _fill(again, 1, start=20)
    assert _values(again.read(10, 1 << 20)) == [20]
    again.close()
    # Not shipped whole, it stays, and what is left of it is sent.
    third = Journal(tmp_path, 1 << 30, segment_bytes=1 << 20)
    third.open()
    assert len(list(tmp_path.glob("*.log"))) == 2 and _values(third.read(10, 1 << 20)) == [20]
    third.close()


def test_a_segment_shipped_whole_while_running_is_deleted_without_waiting_for_it_to_fill(tmp_path: Path) -> None:
    # An idle proxy's active segment, every record in Kafka, held its space until it filled,
    # which with no more calls was never. Once it holds an eighth of a segment and is shipped
    # whole, a new one starts and it is deleted; less than that stays (a file per batch otherwise).
    journal = Journal(tmp_path, 1 << 30, segment_bytes=80_000, mark_interval_s=0)
    journal.open()
    _fill(journal, 10, size=500)  # about 5 KB: under an eighth of a segment
    journal.mark_shipped(journal.read(100, 1 << 20))
    [small] = tmp_path.glob("*.log")
    assert small.stat().st_size > 5000
    _fill(journal, 10, size=500, start=10)  # over an eighth, not yet shipped: kept
    assert len(list(tmp_path.glob("*.log"))) == 1
    journal.mark_shipped(journal.read(100, 1 << 20))
    assert [p.stat().st_size for p in tmp_path.glob("*.log")] == [0] and not small.exists()
    assert journal.shipped == 19 and len(journal) == 0 and journal.pending_bytes == 0
    _fill(journal, 2, start=20)  # the cursor reads on in the new segment
    assert _values(journal.read(10, 1 << 20)) == [20, 21]
    journal.close()
    reopened = Journal(tmp_path, 1 << 30, segment_bytes=80_000)
    reopened.open()
    assert reopened.shipped == 19 and _values(reopened.read(10, 1 << 20)) == [20, 21]
    reopened.close()


def test_the_bound_counts_unshipped_bytes_only(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 3000)
    journal.open()
    _fill(journal, 2, size=1000)
    assert not journal.full
    _fill(journal, 1, start=2, size=1000)
    assert journal.full
    journal.mark_shipped(journal.read(2, 1 << 20))
    assert not journal.full


def test_what_an_ack_proxy_left_in_its_spool_moves_into_the_journal_in_order(tmp_path: Path) -> None:
    # An earlier version's `ack` durability kept one file per record while Kafka was away, in the
    # journal's encoding; nothing reads them any more, so a start moves them into the journal.
    spool = tmp_path / "spool"
    spool.mkdir()
    for i in (3, 0, 2, 1):  # names sort in arrival order, whatever order the folder lists them in
        (spool / f"{i:020d}.rec").write_bytes(pack_record("t.calls", None, f"value-{i}".encode(), ()))
    (spool / f"{4:020d}.tmp").write_bytes(b"an append that never returned: its call was never answered")
    journal = Journal(spool / "journal", 1 << 20)
    journal.open()
    holder = lock_folder(spool / "writer.lock", "an ack proxy")  # one still running keeps its files
    with pytest.raises(JournalLockedError, match="spool folder of its own"):
        take_over_spool(spool, journal)
    os.close(holder)
    assert len(journal) == 0 and len(list(spool.glob("*.rec"))) == 4
    assert take_over_spool(spool, journal) == 4
    assert not list(spool.glob("*.rec")) and not list(spool.glob("*.tmp"))
    records = journal.read(10, 1 << 20)
    assert _values(records) == [0, 1, 2, 3] and records[0].key is None
    assert take_over_spool(spool, journal) == 0


def test_flushing_from_another_thread_is_safe_while_segments_roll_and_the_journal_closes(tmp_path: Path) -> None:
    # The shipper flushes on a worker thread while appends roll segments (closing descriptors
    # whose numbers the next open reuses) and stop() closes the journal.
    import os
    import threading
    import time

    journal = Journal(tmp_path, 1 << 24, segment_bytes=256)
    journal.open()
    errors: list[BaseException] = []
    synced = 0
    done = threading.Event()

    def flush() -> None:
        nonlocal synced
        while not done.is_set():
            try:
                journal.sync()
                synced += 1
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return

    thread = threading.Thread(target=flush)
    thread.start()
    real_fdatasync, flushed = os.fdatasync, []

    def slow_flush(fd: int) -> None:
        # A real flush takes a while, with the interpreter lock released: the descriptor must
        # name the same open segment from the start of it to the end.
        before = Path(f"/proc/self/fd/{fd}").readlink()
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.002)
        assert Path(f"/proc/self/fd/{fd}").readlink() == before
        real_fdatasync(fd)
        flushed.append(before)

    try:
        os.fdatasync = slow_flush  # type: ignore[assignment]
        for i in range(0, 600, 20):
            _fill(journal, 20, start=i, size=40)
            time.sleep(0.001)  # as between calls: the flushing thread gets its turns
        journal.close()
    finally:
        done.set()
        thread.join()
        os.fdatasync = real_fdatasync
    assert errors == [] and synced > 0
    assert flushed and all(p.parent == tmp_path and p.suffix == ".log" for p in flushed)
    again = Journal(tmp_path, 1 << 24)
    again.open()
    assert _values(again.read(1000, 1 << 24)) == list(range(600))


def test_an_append_the_disk_refuses_part_way_leaves_no_torn_record(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 2, size=100)
    [segment] = tmp_path.glob("*.log")
    size = segment.stat().st_size
    with file_size_limit(size + 50), pytest.raises(OSError):  # half of the next frame fits
        _fill(journal, 1, start=2, size=100)
    assert segment.stat().st_size == size and not journal.full  # the half frame was taken back
    _fill(journal, 2, start=3, size=100)  # calls after the failed one are kept, in order
    assert _values(journal.read(10, 1 << 20)) == [0, 1, 3, 4]
    journal.close()
    again = Journal(tmp_path, 1 << 20)
    again.open()
    assert _values(again.read(10, 1 << 20)) == [0, 1, 3, 4] and again.next_seq == 4


def test_a_record_written_in_parts_is_the_record_written_whole(tmp_path: Path) -> None:
    parts = (b"meta" * 30, b"", b"request-body" * 200, b"answer" * 500)
    whole, split = Journal(tmp_path / "whole", 1 << 20), Journal(tmp_path / "split", 1 << 20)
    for journal in (whole, split):
        journal.open()
        journal.append("t.calls", b"k", b"first", ())
    whole.append("t.calls", b"r-1", b"".join(parts), (("h", b"1"),))
    split.append_parts("t.calls", b"r-1", parts, (("h", b"1"),))
    # A call's record (a key, no headers); an empty key too.
    whole.append("openforge/raw-exchanges", b"r-\xc3\xa9", b"".join(parts), ())
    split.append_parts("openforge/raw-exchanges", b"r-\xc3\xa9", list(parts), ())
    whole.append("t.calls", b"", b"", ())
    split.append_parts("t.calls", b"", (), ())
    [whole_segment], [split_segment] = (tmp_path / "whole").glob("*.log"), (tmp_path / "split").glob("*.log")
    assert split_segment.read_bytes() == whole_segment.read_bytes()  # frame, checksum and all
    # ...and both are the spool's encoding framed as the module's documentation says.
    bodies = [pack_record("t.calls", b"k", b"first", ()), pack_record("t.calls", b"r-1", b"".join(parts), (("h", b"1"),)),
              pack_record("openforge/raw-exchanges", b"r-\xc3\xa9", b"".join(parts), ()),
              pack_record("t.calls", b"", b"", ())]
    assert split_segment.read_bytes() == b"".join(
        struct.pack("<IIQ", len(body), zlib.crc32(body), seq) + body for seq, body in enumerate(bodies))
    assert split.pending_bytes == whole.pending_bytes
    split.close()
    again = Journal(tmp_path / "split", 1 << 20)
    again.open()
    _first, record, exchange, empty = again.read(10, 1 << 20)
    assert record.value == b"".join(parts) and record.key == b"r-1" and record.headers == (("h", b"1"),)
    assert exchange.value == b"".join(parts) and exchange.key == b"r-\xc3\xa9" and exchange.headers == ()
    assert empty.value == b"" and empty.key == b"" and again.next_seq == 4


def test_a_record_in_parts_the_disk_refuses_part_way_leaves_no_torn_record(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 1, size=100)
    [segment] = tmp_path.glob("*.log")
    size = segment.stat().st_size
    with file_size_limit(size + 300), pytest.raises(OSError) as refused:  # the limit falls inside the third part
        journal.append_parts("t.calls", b"r-1", (b"a" * 100, b"b" * 100, b"c" * 100), ())
    assert refused.value.errno == errno.EFBIG  # the kernel's reason, not a generic error
    assert segment.stat().st_size == size
    _fill(journal, 1, start=1, size=100)
    assert _values(journal.read(10, 1 << 20)) == [0, 1]


def test_a_segment_roll_that_cannot_open_a_file_keeps_appending_to_the_old_one(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 30, segment_bytes=1000)
    journal.open()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))  # no new descriptor can be opened
    try:
        _fill(journal, 6, size=400)  # rolls are due and fail
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(list(tmp_path.glob("*.log"))) == 1
    _fill(journal, 2, start=6, size=400)  # the next roll succeeds
    assert len(list(tmp_path.glob("*.log"))) > 1
    journal.close()
    again = Journal(tmp_path, 1 << 30)
    again.open()
    assert _values(again.read(20, 1 << 20)) == list(range(8))


def test_a_zero_filled_segment_and_an_unreadable_mark_lose_nothing(tmp_path: Path) -> None:
    # A crash can leave a new file's length on disk without its data: zeros, whose first
    # "frame" (length 0, checksum 0, sequence 0) would pass every check of the first segment.
    (tmp_path / f"{0:020d}.log").write_bytes(bytes(64))
    journal = Journal(tmp_path, 1 << 20, mark_interval_s=0)
    journal.open()
    assert journal.next_seq == 0 and journal.read(10, 1 << 20) == []
    _fill(journal, 3)
    journal.mark_shipped(journal.read(1, 1 << 20))
    journal.close()
    (tmp_path / "shipped").write_bytes(b"\x00\x00\x00")
    again = Journal(tmp_path, 1 << 20)
    again.open()  # read as nothing shipped: record 0 goes again, consumers drop the copy
    assert _values(again.read(10, 1 << 20)) == [0, 1, 2] and again.next_seq == 3


def test_a_failed_flush_is_reported_and_tried_again(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    _fill(journal, 1)
    fd = journal._fd
    assert fd is not None
    saved = os.dup(fd)
    os.close(fd)  # the descriptor fails under the flush: EBADF, as a failing disk gives EIO
    try:
        with pytest.raises(OSError):
            journal.sync()
    finally:
        os.dup2(saved, fd)
        os.close(saved)
    assert journal._unsynced  # still owed: the next flush does it
    journal.sync()
    assert not journal._unsynced
    journal.close()


def test_a_second_writer_on_the_same_folder_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    first = Journal(tmp_path, 1 << 20)
    first.open()
    _fill(first, 2)
    second = Journal(tmp_path, 1 << 20)
    with pytest.raises(JournalLockedError, match="spool folder of its own"):
        second.open()
    _fill(first, 1, start=2)  # the first goes on undisturbed
    first.close()
    second.open()  # once it is gone, the folder is free (a writer that died frees it too)
    assert _values(second.read(10, 1 << 20)) == [0, 1, 2] and second.next_seq == 3
    second.close()


def test_a_disk_too_full_for_the_mark_still_frees_shipped_segments(tmp_path: Path) -> None:
    journal = Journal(tmp_path, 1 << 30, segment_bytes=2000, mark_interval_s=0)
    journal.open()
    _fill(journal, 20, size=500)
    records = journal.read(15, 1 << 20)
    with file_size_limit(0):  # no file may grow: the mark cannot be written
        journal.mark_shipped(records)  # before, the OSError ended the shipper
    assert len(journal) == 5 and min(int(p.stem) for p in tmp_path.glob("*.log")) > 0
    journal.close()


def test_a_start_flushes_what_a_killed_writer_left_before_it_writes_anything_newer_observed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer killed between its flushes leaves its last records in the page cache alone. The
    next start flushes them, and then the folder that names its new segment, before it writes
    anything: after a power cut an older segment torn behind a newer one stops every start.
    (The flushes are observed, each still made, as no test can cut the power.)"""
    script = (f"import os, signal, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r}); "
              "from pathlib import Path; from producers.journal import Journal; "
              f"j = Journal(Path({str(tmp_path)!r}), 1 << 20); j.open(); "
              "[j.append('t.calls', b'r', b'value-%d' % i, ()) for i in range(3)]; "
              "os.kill(os.getpid(), signal.SIGKILL)")
    writer = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert writer.returncode == -signal.SIGKILL, writer.stderr
    [old] = [str(p.resolve()) for p in tmp_path.glob("*.log")]
    flushed: list[str] = []

    def observed(real: Callable[[int], None]) -> Callable[[int], None]:
        def flush(fd: int) -> None:
            flushed.append(str(Path(f"/proc/self/fd/{fd}").readlink()))
            real(fd)
        return flush

    monkeypatch.setattr(os, "fdatasync", observed(os.fdatasync))
    monkeypatch.setattr(os, "fsync", observed(os.fsync))
    journal = Journal(tmp_path, 1 << 20)
    journal.open()
    assert old in flushed and str(tmp_path.resolve()) in flushed, flushed
    assert flushed.index(old) < flushed.index(str(tmp_path.resolve())), flushed
    _fill(journal, 1, start=3)
    assert _values(journal.read(10, 1 << 20)) == [0, 1, 2, 3]
    journal.close()
