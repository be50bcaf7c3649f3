"""Shipping a journal that another process appends to: order, frames still being written, segments, marks."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from producers.journal import _FRAME, Journal, JournalCorruptError
from producers.journal_tail import JournalTail


def _writer(folder: Path, **kwargs: int) -> Journal:
    journal = Journal(folder, kwargs.pop("max_bytes", 1 << 20), shipped_elsewhere=True, **kwargs)
    journal.open()
    return journal


def _fill(journal: Journal, start: int, count: int, size: int = 10) -> None:
    for i in range(start, start + count):
        journal.append("t.calls", b"k", f"v-{i}".encode().ljust(size, b"."), ())


def _numbers(records: list) -> list[int]:
    return [int(r.value.split(b"-")[1].rstrip(b".")) for r in records]


def test_the_tail_reads_what_the_writer_appends_in_order_and_waits_for_more(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    tail = JournalTail(tmp_path)
    tail.open()
    assert tail.read(100, 1 << 20) == []
    _fill(writer, 0, 3)
    first = tail.read(100, 1 << 20)
    assert _numbers(first) == [0, 1, 2] and [r.seq for r in first] == [0, 1, 2]
    assert tail.read(100, 1 << 20) == []
    _fill(writer, 3, 2)
    assert _numbers(tail.read(1, 1 << 20)) == [3]
    assert _numbers(tail.read(100, 1 << 20)) == [4]
    writer.close()
    tail.close()


def test_the_tail_takes_batches_as_the_journal_does_past_the_byte_limit_by_one_record(tmp_path: Path) -> None:
    # The shipper tells a batch cut by a limit (ship the next at once) from a drained journal
    # (linger) by whether the batch reached the limit: both readers must end a batch on the
    # record that crosses it, never before.
    writer = _writer(tmp_path)
    _fill(writer, 0, 10, size=1000)
    tail = JournalTail(tmp_path)
    tail.open()
    batch = tail.read(100, 2500)
    assert _numbers(batch) == [0, 1, 2] and sum(r.size for r in batch) >= 2500
    assert _numbers(tail.read(3, 1 << 20)) == [3, 4, 5]
    assert _numbers(tail.read(100, 1)) == [6]  # one record even when it alone exceeds the limit
    rest = tail.read(100, 1 << 20)
    assert _numbers(rest) == [7, 8, 9] and sum(r.size for r in rest) < 1 << 20
    writer.close()
    tail.close()


def test_a_frame_still_being_written_is_read_once_it_is_whole(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    _fill(writer, 0, 1)
    # What a reader may see while the writer's ``write`` is half copied into the page cache.
    segment = sorted(tmp_path.glob("*.log"))[-1]
    frame = Journal(tmp_path / "other", 1 << 20)
    frame.open()
    frame.append("t.calls", b"k", b"v-1".ljust(5000, b"."), ())
    frame.close()
    written = sorted((tmp_path / "other").glob("*.log"))[-1].read_bytes()
    length, crc, _ = _FRAME.unpack_from(written)
    whole = _FRAME.pack(length, crc, 1) + written[_FRAME.size:]  # the same frame, numbered as record 1
    tail = JournalTail(tmp_path)
    tail.open()
    fd = os.open(segment, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, whole[:10])  # not even a whole header
        assert _numbers(tail.read(100, 1 << 20)) == [0]
        os.write(fd, whole[10:3000])  # header, part of the body
        assert tail.read(100, 1 << 20) == []
        os.write(fd, whole[3000:])
        assert _numbers(tail.read(100, 1 << 20)) == [1]
    finally:
        os.close(fd)
    tail.close()


def test_a_frame_written_where_a_failed_append_was_taken_back_is_not_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail read the file's size while a failed append's bytes were still there (injected:
    ``fstat`` reports that larger size once); the writer then cut them and began the next frame
    in their place. That frame, shorter than the size read, looked whole, and its short read
    was taken for damage, which stops every call. It is read once it is whole instead."""
    writer = _writer(tmp_path)
    _fill(writer, 0, 1)
    tail = JournalTail(tmp_path)
    tail.open()
    assert _numbers(tail.read(100, 1 << 20)) == [0]
    segment = sorted(tmp_path.glob("*.log"))[-1]
    size = segment.stat().st_size
    writer.append("t.calls", b"k", b"v-1".ljust(5000, b"."), ())
    whole = segment.read_bytes()[size:]
    os.truncate(segment, size + 3000)  # record 1 half copied in
    real_fstat = os.fstat
    stale = []

    def fstat_once_stale(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        if not stale and result.st_size == size + 3000:
            stale.append(fd)
            fields = list(result)
            fields[6] = size + 9000  # st_size: what the file held before the failed append was cut
            return os.stat_result(fields)
        return result

    with monkeypatch.context() as patched:
        patched.setattr(os, "fstat", fstat_once_stale)
        assert tail.read(100, 1 << 20) == []
    assert stale
    with segment.open("ab") as rest:
        rest.write(whole[3000:])
    assert _numbers(tail.read(100, 1 << 20)) == [1]
    tail.close()
    writer.close()


def test_a_frame_written_where_a_failed_append_was_taken_back_then_rolled_over_is_not_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the frame written in the failed append's place (a few bytes shorter than
    it) filled its segment and the writer rolled: the tail saw the frame whole, then a file
    ending short of the size it had read, before a newer segment. The file changed size under
    it, which is no torn record: it reads on (injected: ``fstat`` reports a size 8 bytes larger once)."""
    writer = _writer(tmp_path, segment_bytes=4000)
    _fill(writer, 0, 1)
    tail = JournalTail(tmp_path)
    tail.open()
    assert _numbers(tail.read(100, 1 << 20)) == [0]
    segment = sorted(tmp_path.glob("*.log"))[-1]
    writer.append("t.calls", b"k", b"v-1".ljust(5000, b"."), ())  # fills the segment: the writer rolls
    _fill(writer, 2, 1)
    assert len(list(tmp_path.glob("*.log"))) == 2
    real_fstat = os.fstat
    grown = segment.stat().st_size
    stale = []

    def fstat_once_stale(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        if not stale and result.st_size == grown:
            stale.append(fd)
            fields = list(result)
            fields[6] = grown + 8  # st_size: the failed append's bytes, not yet cut when it was read
            return os.stat_result(fields)
        return result

    with monkeypatch.context() as patched:
        patched.setattr(os, "fstat", fstat_once_stale)
        assert _numbers(tail.read(100, 1 << 20)) == [1, 2]
    assert stale
    tail.close()
    writer.close()


def test_the_tail_follows_segments_marks_and_deletes_and_the_writer_learns_its_bound(tmp_path: Path) -> None:
    writer = _writer(tmp_path, segment_bytes=100, max_bytes=250)
    tail = JournalTail(tmp_path, mark_interval_s=0)
    tail.open()
    _fill(writer, 0, 6, size=40)  # frames of 50-99 bytes: a new segment every two records
    assert writer.full and len(writer) == 6
    records = tail.read(100, 1 << 20)
    assert _numbers(records) == [0, 1, 2, 3, 4, 5]
    tail.mark_shipped(records[:4])
    writer.note_shipped(tail.shipped)
    assert len(writer) == 2 and not writer.full  # the proxy takes calls again
    assert sorted(int(p.stem) for p in tmp_path.glob("*.log")) == [4, 6]  # shipped segments gone
    tail.mark_shipped(records[4:])
    writer.note_shipped(tail.shipped)
    assert len(writer) == 0 and writer.pending_bytes == 0
    writer.close()
    tail.close()


def test_a_new_tail_starts_at_the_mark_and_a_restarted_writer_continues_the_numbering(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    _fill(writer, 0, 4)
    tail = JournalTail(tmp_path, mark_interval_s=0)
    tail.open()
    tail.mark_shipped(tail.read(2, 1 << 20))
    tail.close()
    writer.close()
    writer = _writer(tmp_path)  # the proxy restarts: it recovers the journal and starts a segment
    assert writer.shipped == 1 and len(writer) == 2  # the writer never writes the mark
    _fill(writer, 4, 1)
    again = JournalTail(tmp_path)
    again.open()
    records = again.read(100, 1 << 20)
    assert _numbers(records) == [2, 3, 4] and [r.seq for r in records] == [2, 3, 4]
    again.rewind()
    assert _numbers(again.read(100, 1 << 20)) == [2, 3, 4]  # after a failed batch: the same again
    again.close()
    writer.close()


def test_damage_is_reported_not_skipped(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    _fill(writer, 0, 2)
    writer.close()
    segment = sorted(tmp_path.glob("*.log"))[0]
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF
    segment.write_bytes(bytes(data))
    tail = JournalTail(tmp_path)
    tail.open()
    with pytest.raises(JournalCorruptError, match="damaged"):
        tail.read(100, 1 << 20)
    # A torn record in a segment with a newer one after it was never cut: damage too.
    torn = tmp_path / "torn"
    writer = _writer(torn)
    _fill(writer, 0, 1)
    writer.close()
    first = sorted(torn.glob("*.log"))[0]
    with first.open("ab") as handle:
        handle.write(_FRAME.pack(100, 0, 1) + b"x" * 10)
    (torn / f"{1:020d}.log").write_bytes(b"")
    tail = JournalTail(torn)
    tail.open()
    with pytest.raises(JournalCorruptError, match="torn"):
        tail.read(100, 1 << 20)


def test_a_crash_right_after_shipping_never_leaves_the_mark_behind_deleted_segments(tmp_path: Path) -> None:
    writer = _writer(tmp_path, segment_bytes=100)
    tail = JournalTail(tmp_path, mark_interval_s=3600)  # the mark is written only when it must be
    tail.open()
    _fill(writer, 0, 8, size=40)
    records = tail.read(100, 1 << 20)
    tail.mark_shipped(records[:6])  # deletes the first segments: the mark must be on disk first
    assert (tmp_path / "shipped").read_text() == "5"
    # The worker is killed here (no close). The next one starts where Kafka's view ends.
    again = JournalTail(tmp_path)
    again.open()
    assert _numbers(again.read(100, 1 << 20)) == [6, 7]
    writer.close()


def test_a_mark_older_than_every_segment_moves_up_to_the_first_one(tmp_path: Path) -> None:
    """A journal left by a version that deleted segments before writing its mark."""
    writer = _writer(tmp_path, segment_bytes=100)
    _fill(writer, 0, 6, size=40)
    writer.close()
    for path in sorted(tmp_path.glob("*.log"))[:2]:
        path.unlink()  # records 0-3, shipped, gone
    (tmp_path / "shipped").write_text("1")
    tail = JournalTail(tmp_path)
    tail.open()
    assert tail.shipped == 3 and _numbers(tail.read(100, 1 << 20)) == [4, 5]
    tail.close()
    (tmp_path / "shipped").write_text("1")
    reopened = _writer(tmp_path)
    assert reopened.shipped == 3 and len(reopened) == 2
    reopened.close()


def test_shipping_one_record_at_a_time_deletes_each_segment_once_the_cursor_leaves_it(tmp_path: Path) -> None:
    writer = _writer(tmp_path, segment_bytes=200)
    tail = JournalTail(tmp_path)
    tail.open()
    _fill(writer, 0, 12, size=40)  # a new segment every few records
    segments = sorted(int(p.stem) for p in tmp_path.glob("*.log"))
    assert len(segments) >= 4
    for n in range(12):
        [record] = tail.read(1, 1 << 20)
        tail.mark_shipped([record])
        left = sorted(int(p.stem) for p in tmp_path.glob("*.log"))
        # Every segment that ends at or before the shipped record is gone, except the cursor's.
        assert [s for s in left if s <= n] == [max(s for s in segments if s <= n)], (n, left)
    tail.close()
    writer.close()


def test_a_full_disk_that_refuses_the_mark_still_frees_the_shipped_segments(tmp_path: Path) -> None:
    writer = _writer(tmp_path, segment_bytes=100)
    tail = JournalTail(tmp_path, mark_interval_s=0)
    tail.open()
    _fill(writer, 0, 8, size=40)
    records = tail.read(100, 1 << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # no file may grow: the mark cannot be written
    try:
        tail.mark_shipped(records[:6])  # before, the OSError ended the shipper (and so the worker)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not (tmp_path / "shipped").exists()
    assert min(int(p.stem) for p in tmp_path.glob("*.log")) == 6  # the disk is freed all the same
    again = JournalTail(tmp_path)  # a restart: the mark moves up to the first segment left
    again.open()
    assert _numbers(again.read(100, 1 << 20)) == [6, 7]
    writer.close()


@pytest.mark.parametrize("reader", ["journal", "tail"])
def test_a_shipped_segment_the_disk_will_not_delete_injected_stays_and_reading_goes_on(
        tmp_path: Path, reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a shipped segment fails (injected: ``unlink`` raises, as on a read-only remount).
    Before, the error ended shipping; the inline journal had also forgotten the segment while
    its cursor still counted it, and read from the wrong file. Now the file stays, reading goes on
    in order, and the next mark deletes it: its records are all below the mark."""
    if reader == "journal":
        source: Journal | JournalTail = Journal(tmp_path, 1 << 20, segment_bytes=100)
        source.open()
        writer = source
    else:
        writer = _writer(tmp_path, segment_bytes=100)
        source = JournalTail(tmp_path, mark_interval_s=0)
        source.open()
    _fill(writer, 0, 8, size=40)
    first = source.read(3, 1 << 20)

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    with monkeypatch.context() as patched:
        patched.setattr(Path, "unlink", refuse)
        source.mark_shipped(first)
    assert _numbers(first) == [0, 1, 2]
    assert (tmp_path / "00000000000000000000.log").exists()  # still there
    [third] = source.read(1, 1 << 20)  # the cursor stays in the segment it was in
    source.mark_shipped([third])
    assert not (tmp_path / "00000000000000000000.log").exists()  # the next mark deleted it
    rest = source.read(100, 1 << 20)
    assert _numbers([third, *rest]) == [3, 4, 5, 6, 7]
    source.mark_shipped(rest)
    source.close()
    if writer is not source:
        writer.close()
    again = Journal(tmp_path, 1 << 20, segment_bytes=100)
    again.open()
    assert len(again) == 0
    again.close()


def test_a_segment_the_disk_will_not_delete_injected_stops_the_sweep_so_no_gap_is_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark cannot be written (a full disk) and the oldest shipped segment cannot be deleted
    (both injected). Deleting the newer shipped segments anyway left a gap behind the oldest: a
    restart, reading the old mark, found the first segment left followed by a later one, and
    stopped on a journal it took for damaged. Now the sweep stops at the first segment that stays."""
    writer = _writer(tmp_path, segment_bytes=100)
    tail = JournalTail(tmp_path, mark_interval_s=0)
    tail.open()
    _fill(writer, 0, 12, size=40)
    oldest = tmp_path / "00000000000000000000.log"
    segments = sorted(tmp_path.glob("*.log"))
    assert len(segments) >= 4 and segments[0] == oldest
    records = tail.read(100, 1 << 20)
    unlink = Path.unlink

    def refuse_oldest(self: Path, missing_ok: bool = False) -> None:
        if self == oldest:
            raise PermissionError(1, "Operation not permitted", str(self))
        unlink(self, missing_ok=missing_ok)

    def no_room(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(Path, "unlink", refuse_oldest)
        patched.setattr("producers.journal.ShippedMark.write", no_room)
        tail.mark_shipped(records[:-2])
        assert sorted(tmp_path.glob("*.log")) == segments  # nothing deleted behind the one that stayed
        tail.close()  # nor is the mark written as it stops
    again = JournalTail(tmp_path)  # a restart, on the mark of before: the records are all there
    again.open()
    assert _numbers(again.read(100, 1 << 20)) == list(range(12))
    again.close()
    writer.close()
