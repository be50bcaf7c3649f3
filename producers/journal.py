"""A local write-ahead journal of encoded Kafka records.

Why it exists: waiting for Kafka's acknowledgement before answering puts a broker round trip
(1.6-3 ms on a loaded two-core machine) into every model call, and sending each call's event as a
produce request of its own costs the broker several times the CPU of sending them in batches. The
journal makes an event durable on local disk first (one ``write`` into the page cache, microseconds)
so the harness's answer need not wait for the broker; a shipper sends what the journal holds to
Kafka in order, in batches, and records how far Kafka has it. That is the same promise Kafka's own
``acks=all`` makes: a broker acknowledges once the record is in its page cache (``log.flush.*`` is
unset by default), so a crashed process loses nothing and the disk is flushed on an interval.

Layout of the folder:

* segments ``<first seq:020d>.log``, each a run of frames ``u32 body length | u32 crc32(body) |
  u64 seq | body`` where the body is :func:`pack_record`'s encoding; sequence
  numbers increase by one across segments. A new segment starts at every open, when the active
  one passes ``segment_bytes``, and when it is shipped whole and holds an eighth of that;
* ``shipped``: the highest sequence number up to which every record is in Kafka, replaced
  atomically. Segments wholly below it are deleted.

A crash can leave the active segment ending in a torn frame; opening the journal truncates it
there (that record's call was never answered, so it was never promised). Damage anywhere else
in it is not cut silently: the segment is copied aside and the good records after the damage
are journalled again (:meth:`Journal._cut_damage`); in an older segment it stops the journal
(:class:`JournalCorruptError`). Everything after the
``shipped`` mark is sent again after a restart: a record sent but not yet marked is then in Kafka
twice with the same ``event_id``, which the assembler drops. Duplicates are recoverable; a lost
call is not.

Not thread-safe: one event loop appends, reads and marks (``sync`` may run in a worker thread).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<IIQ")  # body length, crc32 of the body, sequence number
_MARK = "shipped"
_READ_CHUNK = 256 * 1024  # bytes read at once; larger records are read whole on their own
_MAGIC = b"OFSPOOL1"  # first bytes of every record's encoding (the name is older than the journal)
_U32 = struct.Struct("<I")
_SHIPPED_ROLL = 8  # a wholly shipped active segment of 1/8 of segment_bytes or more is rolled and deleted

Record = tuple[str, bytes | None, bytes, tuple[tuple[str, bytes], ...]]
"""An encoded Kafka record as the journal keeps it: topic, key, value, headers."""


def pack_record(topic: str, key: bytes | None, value: bytes, headers: tuple[tuple[str, bytes], ...]) -> bytes:
    """One Kafka record as the bytes of a journal frame's body."""
    return record_head(topic, key, headers, len(value)) + value


def record_head(topic: str, key: bytes | None, headers: tuple[tuple[str, bytes], ...], value_length: int) -> bytes:
    """:func:`pack_record`'s encoding up to the value, which follows it: ``value_length`` bytes.

    Apart so that a writer holding a value in parts (the journal's whole answers) can write them
    as they are rather than join them first.
    """
    parts = [_MAGIC]

    def field(data: bytes) -> None:
        parts.append(_U32.pack(len(data)))
        parts.append(data)

    field(topic.encode())
    parts.append(b"\x01" if key is not None else b"\x00")
    field(key or b"")
    parts.append(_U32.pack(len(headers)))
    for name, data in headers:
        field(name.encode())
        field(data)
    parts.append(_U32.pack(value_length))
    return b"".join(parts)


def unpack_record(where: object, blob: bytes) -> Record:
    """The record :func:`pack_record` encoded; ``where`` names its place in errors.

    Straight-line rather than a helper per field: the shipper reads every call's record through here.

    Raises:
        ValueError: not a record, or truncated.
    """
    if not blob.startswith(_MAGIC):
        raise ValueError(f"{where} holds no journal record")
    try:
        pos = len(_MAGIC)
        (size,) = _U32.unpack_from(blob, pos)
        topic = blob[pos + 4:pos + 4 + size].decode()
        pos += 4 + size
        has_key = blob[pos:pos + 1] == b"\x01"
        (size,) = _U32.unpack_from(blob, pos + 1)
        key = blob[pos + 5:pos + 5 + size]
        pos += 5 + size
        (count,) = _U32.unpack_from(blob, pos)
        pos += 4
        headers = []
        for _ in range(count):
            (size,) = _U32.unpack_from(blob, pos)
            name = blob[pos + 4:pos + 4 + size].decode()
            pos += 4 + size
            (size,) = _U32.unpack_from(blob, pos)
            headers.append((name, blob[pos + 4:pos + 4 + size]))
            pos += 4 + size
        (size,) = _U32.unpack_from(blob, pos)
        value = blob[pos + 4:pos + 4 + size]
    except struct.error:
        raise ValueError(f"{where} holds a truncated record") from None
    if len(value) != size:
        raise ValueError(f"{where} holds a truncated record")
    return topic, key if has_key else None, value, tuple(headers)


def sync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (a new file in it), to disk, through a descriptor of its own."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_folder(path: Path, refusal: str) -> int:
    """An exclusive lock on ``path`` (created), held until its descriptor is closed.

    Raises:
        JournalLockedError: another process holds it (with ``refusal`` as its message).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalLockedError(f"{refusal}: give each proxy a spool folder of its own "
                                 "(OPENFORGE_PROXY_SPOOL_DIR)") from None
    return fd


def _write_frame(fd: int, seq: int, topic: str, key: bytes | None, parts: Sequence[bytes],
                 headers: tuple[tuple[str, bytes], ...]) -> int:
    """Append record ``seq``'s frame to ``fd`` with one ``writev``; return the frame's size.

    A short write (rare on a file) is finished buffer by buffer, in order, nothing copied.
    """
    length = sum(map(len, parts))
    head = record_head(topic, key, headers, length)
    crc = zlib.crc32(head)
    for part in parts:
        crc = zlib.crc32(part, crc)
    buffers = [_FRAME.pack(len(head) + length, crc, seq) + head, *parts]
    size = len(buffers[0]) + length
    written = os.writev(fd, buffers)
    if written < size:
        for buffer in buffers:
            view = memoryview(buffer)[min(written, len(buffer)):]
            written -= len(buffer) - len(view)
            while view:
                view = view[os.write(fd, view):]
    return size


class _ShippedMark:
    """The ``shipped`` file: how far Kafka has the journal, written atomically and not too often."""

    def __init__(self, directory: Path, interval_s: float) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self._written = -1
        self._at = 0.0

    def read(self) -> int:
        """The mark on disk (-1: nothing shipped yet, or a mark that cannot be read).

        A damaged mark (a crash can leave zeros where the file's data was) is read as nothing
        shipped: everything still in the journal goes to Kafka again, and consumers drop the
        copies by event id. Refusing to start would stop the proxy for the sake of a hint.
        """
        path = self.directory / _MARK
        try:
            text = path.read_text().strip() if path.exists() else ""
            self._written = int(text) if text else -1
        except (ValueError, UnicodeDecodeError) as exc:
            logger.warning("journal mark %s is unreadable (%s); shipping everything the journal holds", path, exc)
            self._written = -1
        return self._written

    def write(self, shipped: int, *, force: bool = False) -> None:
        """Persist ``shipped``, at most every ``interval_s`` unless forced.

        A mark that lags only costs re-sending (duplicates the assembler drops) after a crash.
        """
        now = time.monotonic()
        if shipped == self._written or (not force and now - self._at < self.interval_s):
            return
        tmp = self.directory / f"{_MARK}.tmp"
        tmp.write_text(str(shipped))
        tmp.replace(self.directory / _MARK)
        self._written, self._at = shipped, now


class JournalCorruptError(Exception):
    """A frame failed its checks somewhere other than the end of the newest segment."""


class JournalLockedError(RuntimeError):
    """Another process writes the journal in this folder."""


WRITER_LOCK = "writer.lock"
"""File in the journal's folder its one writer holds a lock on while it runs."""


@dataclass(frozen=True)
class JournalRecord:
    """One record read back from the journal."""

    seq: int
    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    size: int
    """Bytes the record takes on disk (frame header included)."""


def _frame_record(path: Path, offset: int, body: bytes, length: int, crc: int, seq: int,
                  expected_seq: int) -> JournalRecord:
    """The record a frame's body holds, after the frame's checks (length, checksum, numbering).

    Raises:
        JournalCorruptError: the frame at ``offset`` of ``path`` fails a check.
    """
    if len(body) != length or zlib.crc32(body) != crc or seq != expected_seq:
        raise JournalCorruptError(f"{path} is damaged at byte {offset:,}")
    try:
        topic, key, value, headers = unpack_record(path, bytes(body))
    except ValueError as exc:  # whole and checked, but not a record this version writes
        raise JournalCorruptError(f"{path} holds a frame at byte {offset:,} that is not a journal record: "
                                  f"{exc}") from exc
    return JournalRecord(seq, topic, key, value, headers, _FRAME.size + length)


@dataclass
class _Segment:
    first_seq: int
    path: Path
    size: int


class Journal:
    """Append-only segments plus a ``shipped`` mark, bounded by the bytes not yet shipped."""

    def __init__(self, directory: Path, max_bytes: int, *, segment_bytes: int = 64 * 1024 * 1024,
                 mark_interval_s: float = 0.05) -> None:
        """Open with :meth:`open`.

        Args:
            directory: The journal's folder.
            max_bytes: Bound on the bytes not yet shipped (:attr:`full`).
            segment_bytes: Size at which a new segment starts.
            mark_interval_s: Least time between writes of the ``shipped`` mark.
        """
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.mark_interval_s = mark_interval_s
        self._segments: list[_Segment] = []
        self._fd: int | None = None  # the active (last) segment, opened for appending
        self._lock_fd: int | None = None  # WRITER_LOCK, held from open to close
        self._next_seq = 0
        self._shipped = -1
        self._pending = 0
        self._pending_bytes = 0
        self._unsynced = False
        self.damaged: str | None = None
        """Why the journal takes no more records (a torn record it could not cut), else None."""
        # sync() runs on a worker thread (the shipper's periodic flush) while the event loop's
        # thread appends, rolls segments and closes: the lock keeps a descriptor from being
        # closed (and its number reused by the next segment) between reading it and flushing it.
        self._fd_lock = threading.Lock()
        self._mark = _ShippedMark(directory, mark_interval_s)
        # Read cursor: the next record to hand to the shipper.
        self._read_index = 0
        self._read_offset = 0
        self._read_seq = 0
        self._read_fd: int | None = None
        self._read_path: Path | None = None

    # -- state -------------------------------------------------------------------------------

    @property
    def shipped(self) -> int:
        """Every record up to this sequence number is in Kafka (-1: none yet)."""
        return self._shipped

    @property
    def next_seq(self) -> int:
        """The sequence number the next append gets."""
        return self._next_seq

    def __len__(self) -> int:
        """Records not yet shipped."""
        return self._pending

    @property
    def pending_bytes(self) -> int:
        """Bytes of the records not yet shipped."""
        return self._pending_bytes

    @property
    def full(self) -> bool:
        """True when the unshipped records reach the bound, or the journal is damaged: take no new work."""
        return self._pending_bytes >= self.max_bytes or self.damaged is not None

    # -- open and close ---------------------------------------------------------------------

    def open(self) -> None:
        """Recover the folder: read the mark, check every frame, cut a torn tail, start a segment.

        Raises:
            JournalCorruptError: a frame in the middle of the journal is damaged (not a torn
                tail); the folder is left as it is for an operator to look at.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock()
        self._shipped = self._mark.read()
        paths = sorted(self.directory.glob("*.log"))
        while len(paths) > 1 and paths[-1].stat().st_size == 0:
            # Made by a rotation the crash interrupted before the segment before it was flushed:
            # that one's torn tail is the journal's tail, not damage before a newer segment.
            paths.pop().unlink()
        last_seq = self._shipped
        salvaged: list[tuple[int, bytes]] = []
        unfinished = sorted(self.directory.glob("*" + SALVAGING))  # of an earlier start that did not end
        for number, path in enumerate(paths):
            first_seq = int(path.stem)
            size, records, unshipped_bytes, end_seq = self._scan(path, first_seq)
            if size < path.stat().st_size:
                if number != len(paths) - 1:
                    raise JournalCorruptError(
                        f"{path} is damaged at byte {size:,} of {path.stat().st_size:,}, before newer segments")
                salvaged = self._cut_damage(path, size, end_seq)
                os.truncate(path, size)
                # Cut again (the crash came before the cut): salvaged now, not from the marker.
                unfinished = [m for m in unfinished if m.name != path.name + SALVAGING]
            if records == 0:
                path.unlink()
                continue
            self._segments.append(_Segment(first_seq, path, size))
            last_seq = max(last_seq, end_seq)
            self._pending_bytes += unshipped_bytes
        if self._segments and self._segments[0].first_seq - 1 > self._shipped:
            # Segments below the first one left were deleted as shipped, after a mark that
            # was not written in time (a crash): everything before it is in Kafka.
            logger.info("journal mark %d is older than the first segment (%d); moving it up",
                        self._shipped, self._segments[0].first_seq)
            self._shipped = self._segments[0].first_seq - 1
        self._next_seq = last_seq + 1
        self._pending = self._next_seq - 1 - self._shipped
        self._drop_shipped_segments()
        # An earlier run killed between its flushes left its last records in the page cache
        # alone; this run's flushes cover only its own segments. On disk before anything newer:
        # a power cut must not leave an older segment torn (or gone) behind a newer one, which no
        # start reads past, holding back every record flushed after it.
        for segment in self._segments:
            try:
                sync_path(segment.path)
            except OSError as exc:  # as any failed flush: said, and the start goes on (the disk is the operator's)
                logger.error("flushing journal segment %s left by an earlier run failed: %s", segment.path, exc)
        self._new_segment()
        # The newest segment of the run before is now an older one: shipped whole, it goes like
        # any other. Kept, it held its space until this run's segment filled, which on a volume
        # too small for a second segment was never.
        self._drop_shipped_segments()
        salvaged = [*self._unfinished_salvages(unfinished), *salvaged]
        for _, body in salvaged:  # written again, in their order, as the newest records
            self.append(*unpack_record(self.directory, body))
        if salvaged:
            self.sync()
        for marker in self.directory.glob("*" + SALVAGING):
            marker.unlink()
        self._seek(self._shipped + 1)
        if self._pending:
            logger.info("journal holds %d records (%d bytes) not yet in Kafka", self._pending,
                        self._pending_bytes)

    def lock(self) -> None:
        """Hold :data:`WRITER_LOCK` until :meth:`close`: one writer per journal folder. Idempotent.

        Two proxies given the same folder (the default spool folder is relative to where each
        starts) would both number records from the same sequence number, and the shipper would
        stop at the first clash as at damage. The second one is refused at start instead, while
        the first still runs; a writer that died released its lock with its process.

        Raises:
            JournalLockedError: another writer holds the folder.
        """
        if self._lock_fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_folder(self.directory / WRITER_LOCK,
                                    f"another process is writing the journal at {self.directory}")

    def close(self) -> None:
        """Flush to disk, write the mark, release the file and the folder. Idempotent."""
        if self._lock_fd is not None and self._fd is None:  # opened no segment (open failed)
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._fd is None:
            return
        try:
            self.sync()  # the records first, then the mark that may name them shipped
        except OSError as exc:
            logger.error("flushing the journal at %s on close failed: %s", self.directory, exc)
        else:
            self.write_mark(force=True)
        self._close_active()
        if self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd, self._read_path = None, None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _scan(self, path: Path, first_seq: int) -> tuple[int, int, int, int]:
        """Valid length, record count, unshipped bytes and last sequence number of a segment."""
        offset = records = unshipped = 0
        seq = first_seq - 1
        for end, frame_seq, size in _good_frames(path.read_bytes(), first_seq):
            offset, seq = end, frame_seq
            records += 1
            if seq > self._shipped:
                unshipped += size
        return offset, records, unshipped, seq

    def _cut_damage(self, path: Path, size: int, last_seq: int) -> list[tuple[int, bytes]]:
        """What the newest segment holds after its last good frame, before it is cut there.

        A crash while appending leaves a torn last frame (it runs past the end of the file) or
        a zero-filled tail: nothing after it was ever written, and the record in it was never
        answered, so it is cut. Anything else after a bad frame (a flipped bit, a block lost
        by the disk) is damage with answered records behind it: the segment is copied aside
        whole for an operator (``<segment>.damaged``, which no reader opens), and the frames
        after the damage that still pass their checks are returned, those not yet shipped, to
        be journalled again rather than cut off with it.
        """
        data = path.read_bytes()
        later = _later_frames(data, size, last_seq)
        torn = not later and (len(data) - size < _FRAME.size or size + _FRAME.size + _FRAME.unpack_from(data, size)[0]
                              > len(data) or not data[size:].strip(b"\x00"))
        if torn:
            logger.warning("journal %s ends in a torn record at byte %d; cutting it off", path, size)
            return []
        aside = path.with_name(path.name + DAMAGED)
        with aside.open("wb") as copy:  # on disk before the segment is cut
            copy.write(data)
            copy.flush()
            os.fsync(copy.fileno())
        kept = [(seq, body) for seq, body in later if seq > self._shipped and _is_record(path, body)]
        if kept:
            # Until they are journalled again and flushed, the copy is all that holds them: a
            # crash (or a full disk) from the cut on would lose them, the cut segment reading as
            # whole at the next start. The marker makes that start take them from the copy.
            path.with_name(path.name + SALVAGING).touch()
        sync_path(self.directory)
        logger.error("journal %s is damaged at byte %d of %d: the segment is kept whole as %s; %d later record(s) "
                     "still readable are journalled again (%d already in Kafka); the rest of the segment after "
                     "the damage is cut off", path, size, len(data), aside, len(kept), len(later) - len(kept))
        return kept

    def _unfinished_salvages(self, markers: list[Path]) -> list[tuple[int, bytes]]:
        """The records an interrupted salvage was journalling again, read once more from the copies.

        Some may already be in the journal (and in Kafka) from the try that was cut short: they
        are journalled again all the same, and consumers drop the copies by event id. None is lost.
        """
        found: list[tuple[int, bytes]] = []
        for marker in markers:
            copy = marker.with_name(marker.name.removesuffix(SALVAGING) + DAMAGED)
            try:
                data = copy.read_bytes()
                first_seq = int(copy.name.split(".")[0])
            except (OSError, ValueError) as exc:
                logger.error("journal salvage %s cannot be finished: %s", marker, exc)
                continue
            offset, seq = 0, first_seq - 1
            for end, frame_seq, _ in _good_frames(data, first_seq):
                offset, seq = end, frame_seq
            kept = [(s, body) for s, body in _later_frames(data, offset, seq)
                    if s > self._shipped and _is_record(copy, body)]
            logger.warning("journal salvage from %s was cut short; %d record(s) journalled again from it", copy,
                           len(kept))
            found += kept
        return found

    def _close_active(self) -> None:
        """Flush and close the active segment, under the lock a concurrent flush takes."""
        try:
            self.sync()
        except OSError as exc:
            logger.error("flushing journal segment %s failed: %s", self._segments[-1].path, exc)
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _new_segment(self) -> None:
        """Start the next segment; on a roll that fails, go on appending to the old one.

        The new file is opened before the old one is closed: a roll that cannot create it (a
        full disk, no descriptors left) must not leave the journal without a file to write.
        """
        path = self.directory / f"{self._next_seq:020d}.log"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError:
            if self._fd is None:
                raise
            logger.warning("journal could not start segment %s; appending to the current one", path, exc_info=True)
            return
        if self._fd is not None:
            self._close_active()
        self._fd = fd
        self._segments.append(_Segment(self._next_seq, path, 0))
        # The folder's entry for the new file (and, at a start, the cuts and removals before it):
        # after a power cut a flushed record is lost with its file unless that entry was flushed
        # too. Once a segment, so once per 64 MiB of records.
        try:
            sync_path(self.directory)
        except OSError:
            logger.warning("journal could not flush its folder %s", self.directory, exc_info=True)

    # -- append ------------------------------------------------------------------------------

    def append(self, topic: str, key: bytes | None, value: bytes, headers: tuple[tuple[str, bytes], ...]) -> int:
        """Write one record into the active segment; return its sequence number.

        The bound is the caller's to check (:attr:`full`) before taking the work a record
        describes: a record of work already done is always written.
        """
        return self.append_parts(topic, key, (value,), headers)

    def append_parts(self, topic: str, key: bytes | None, parts: Sequence[bytes],
                     headers: tuple[tuple[str, bytes], ...]) -> int:
        """:meth:`append` of a record whose value is ``parts`` joined, without joining them.

        The proxy writes every whole answer this way (a little metadata, then the request and the
        answer it holds anyway): one ``writev`` of the parts as they are, the checksum carried from
        part to part, where joining would copy each answer twice more on the event loop.
        """
        if self._fd is None:
            raise RuntimeError("the journal is not open")
        if self.damaged is not None:
            raise OSError(f"the journal at {self.directory} is damaged and takes no records: {self.damaged}")
        seq = self._next_seq
        active = self._segments[-1]
        try:
            size = _write_frame(self._fd, seq, topic, key, parts, headers)
        except OSError as exc:
            self._cut_failed_append(active, exc)
            raise
        self._next_seq += 1
        self._pending += 1
        self._pending_bytes += size
        self._unsynced = True
        active.size += size
        if active.size >= self.segment_bytes:
            self._new_segment()
        return seq

    def _cut_failed_append(self, active: _Segment, error: OSError) -> None:
        """Take back the part of a frame a failed ``write`` left (a full disk, an I/O error).

        Left in place, the records appended after it would follow a torn frame: the shipper
        would stop there as at damage, and the next start would cut the segment there, losing
        every answered call written since. When even the cut fails, the journal takes no more
        records (:attr:`full`) until the proxy starts again and cuts the torn tail itself.
        """
        try:
            os.ftruncate(self._fd, active.size)  # type: ignore[arg-type]
        except OSError as cut_error:
            self.damaged = f"{error}; cutting the torn record failed: {cut_error}"
            logger.error("journal %s: %s", active.path, self.damaged)
        else:
            logger.error("journal %s: appending failed (%s); the record was not kept", active.path, error)

    def sync(self) -> None:
        """Flush appended records to the disk itself (``fdatasync``); safe from another thread.

        Raises:
            OSError: the flush failed; the records count as not flushed and the next call tries again.
        """
        with self._fd_lock:
            if self._fd is not None and self._unsynced:
                self._unsynced = False
                try:
                    os.fdatasync(self._fd)
                except OSError:
                    self._unsynced = True
                    raise

    # -- read and mark -----------------------------------------------------------------------

    def read(self, max_records: int, max_bytes: int) -> list[JournalRecord]:
        """The next records after the cursor, oldest first, at least one if any is waiting."""
        out: list[JournalRecord] = []
        taken = 0
        while len(out) < max_records and (not out or taken < max_bytes):
            segment = self._segments[self._read_index]
            if self._read_offset >= segment.size:
                if self._read_index == len(self._segments) - 1:
                    break
                self._read_index += 1
                self._read_offset = 0
                continue
            # One read for many frames: records are small next to the chunk, and page-cache hot.
            chunk = self._pread(segment, self._read_offset,
                                min(segment.size - self._read_offset, _READ_CHUNK, max(max_bytes - taken, _FRAME.size)))
            position = 0
            while len(out) < max_records and (not out or taken < max_bytes):
                if position + _FRAME.size > len(chunk):
                    break
                length, crc, seq = _FRAME.unpack_from(chunk, position)
                end = position + _FRAME.size + length
                body = chunk[position + _FRAME.size:end]
                if len(body) < length:  # larger than the chunk: read it whole
                    if position == 0:
                        body = self._pread(segment, self._read_offset + _FRAME.size, length)
                        end = _FRAME.size + length
                    else:
                        break
                out.append(_frame_record(segment.path, self._read_offset + position, body, length, crc, seq,
                                        self._read_seq))
                taken += _FRAME.size + length
                self._read_seq = seq + 1
                position = end
            self._read_offset += position
        return out

    def _pread(self, segment: _Segment, offset: int, size: int) -> bytes:
        if self._read_path != segment.path:
            if self._read_fd is not None:
                os.close(self._read_fd)
                # Forgotten at once: if the open below fails, a rewind into the old segment must
                # open it again, not read (or later close) a number the process may reuse.
                self._read_fd, self._read_path = None, None
            self._read_fd = os.open(segment.path, os.O_RDONLY)
            self._read_path = segment.path
        assert self._read_fd is not None
        data = os.pread(self._read_fd, size, offset)
        if len(data) != size:
            raise JournalCorruptError(f"{segment.path} is shorter than expected at byte {offset:,}")
        return data

    def rewind(self) -> None:
        """Put the cursor back on the first unshipped record (after a failed send)."""
        self._seek(self._shipped + 1)

    def _seek(self, seq: int) -> None:
        index = 0
        for number, segment in enumerate(self._segments):
            if segment.first_seq <= seq:
                index = number
        segment = self._segments[index]
        offset = 0
        current = segment.first_seq
        with segment.path.open("rb") as handle:
            while current < seq and offset < segment.size:
                handle.seek(offset)
                length, _, _ = _FRAME.unpack(handle.read(_FRAME.size))
                offset += _FRAME.size + length
                current += 1
        self._read_index, self._read_offset, self._read_seq = index, offset, seq

    def mark_shipped(self, records: list[JournalRecord]) -> None:
        """Kafka acknowledged ``records`` (the oldest unshipped ones, in order)."""
        if not records:
            return
        if records[0].seq != self._shipped + 1:
            raise ValueError(f"shipped {records[0].seq} before {self._shipped + 1}")
        self._shipped = records[-1].seq
        self._pending -= len(records)
        self._pending_bytes -= sum(r.size for r in records)
        active = self._segments[-1]
        if self._pending == 0 and active.size >= self.segment_bytes // _SHIPPED_ROLL:
            # Shipped whole, the active segment would hold its space until it filled, which
            # on an idle proxy is never: a new one starts, and this one goes like any other.
            # Not at every batch (a new file and a flush of the folder each): once it holds
            # a fraction of a segment, so an idle journal keeps at most that.
            self._new_segment()
        self._drop_shipped_segments()
        self.write_mark()

    def write_mark(self, *, force: bool = False) -> None:
        """Persist the ``shipped`` mark, if the disk lets it.

        A mark the disk refuses (a full disk) must not stop shipping, nor the deletion of shipped
        segments, which is what frees the disk: a restart reads an older mark, moves it up to the
        first segment left, and sends again at most what that segment held.
        """
        try:
            self._mark.write(self._shipped, force=force)
        except OSError as exc:
            logger.warning("could not write the journal's shipped mark in %s: %s", self.directory, exc)

    def _drop_shipped_segments(self) -> None:
        """Delete segments whose every record is shipped (never the active one).

        The mark is written first, when the disk lets it: a restart then need not move an older
        mark up to the first segment left (which :meth:`open` does when it must).
        """
        if len(self._segments) > 1 and self._segments[1].first_seq - 1 <= self._shipped:
            self.write_mark(force=True)
        while len(self._segments) > 1 and self._segments[1].first_seq - 1 <= self._shipped:
            done = self._segments[0]
            if self._read_path == done.path and self._read_fd is not None:
                os.close(self._read_fd)
                self._read_fd, self._read_path = None, None
            if not _remove_shipped(done.path):
                break  # kept, and counted by the cursor as before; the next mark tries again
            self._segments.pop(0)
            if self._read_index > 0:
                self._read_index -= 1
            else:  # the cursor sat at the end of the deleted segment
                self._read_offset = 0


DAMAGED = ".damaged"
"""Suffix of a damaged segment's copy, kept whole for an operator (no reader opens it)."""

SALVAGING = ".salvaging"
"""Suffix of the marker of a salvage in progress: the copy holds records not yet journalled again."""


def _good_frames(data: bytes, first_seq: int) -> Iterator[tuple[int, int, int]]:
    """``(end offset, seq, frame size)`` of each good frame of a segment's bytes, up to the first bad one."""
    offset = 0
    seq = first_seq - 1
    while offset + _FRAME.size <= len(data):
        length, crc, frame_seq = _FRAME.unpack_from(data, offset)
        body = data[offset + _FRAME.size: offset + _FRAME.size + length]
        # A record is never empty: a zero length is a zero-filled tail (a crash can leave
        # one), whose checksum and sequence number would otherwise pass.
        if length == 0 or len(body) != length or zlib.crc32(body) != crc or frame_seq != seq + 1:
            return
        seq = frame_seq
        offset += _FRAME.size + length
        yield offset, seq, _FRAME.size + length


def _is_record(path: Path, body: bytes) -> bool:
    """Whether a frame's body is a record this version reads (a salvaged one must be, to be journalled again)."""
    try:
        unpack_record(path, body)
    except ValueError:
        return False
    return True


_SEARCHED_SEQS = 256
"""How many sequence numbers past a damaged frame recovery looks for (a damaged stretch of up to
that many records, about 1.5 MiB of whole answers)."""


def _later_frames(data: bytes, start: int, last_seq: int) -> list[tuple[int, bytes]]:
    """Good frames after a bad one at ``start``: ``(seq, body)``, in order.

    Found by their sequence numbers (the next ones after ``last_seq``, the last good frame's),
    searched for as bytes, and kept only if length and checksum check out and their numbers
    run on from there; after further damage, searched for again.
    """
    found: list[tuple[int, bytes]] = []
    position, seq = start, last_seq
    while position < len(data):
        # Not number 0 (the journal's very first record): its eight zero bytes would match
        # everywhere in a zero-filled stretch, one candidate per byte.
        for wanted in range(max(seq + 1, 1), seq + 1 + _SEARCHED_SEQS):
            frame = _frame_by_seq(data, position, wanted)
            if frame is not None:
                break
        else:
            return found
        offset, length = frame
        while True:  # the good frames that follow it
            found.append((wanted, data[offset + _FRAME.size: offset + _FRAME.size + length]))
            seq, position = wanted, offset + _FRAME.size + length
            if position + _FRAME.size > len(data):
                return found
            length, crc, wanted = _FRAME.unpack_from(data, position)
            body = data[position + _FRAME.size: position + _FRAME.size + length]
            if length == 0 or len(body) != length or zlib.crc32(body) != crc or wanted != seq + 1:
                position += 1
                break
            offset = position
    return found


def _frame_by_seq(data: bytes, position: int, seq: int) -> tuple[int, int] | None:
    """Offset and body length of the first good frame numbered ``seq`` at or after ``position``."""
    needle = struct.pack("<Q", seq)
    at = data.find(needle, position + 8)
    while at != -1:
        offset = at - 8
        length, crc, _ = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        if length and end <= len(data) and zlib.crc32(data[offset + _FRAME.size:end]) == crc:
            return offset, length
        at = data.find(needle, at + 1)
    return None


def _remove_shipped(path: Path) -> bool:
    """Delete a segment whose records are all in Kafka, if the disk lets it; whether it is gone.

    One left behind costs only disk: its records are below the ``shipped`` mark, so a later
    mark or the next open deletes it. Raising here instead would stop shipping.
    """
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not delete the shipped journal segment %s: %s", path, exc)
        return False
    return True


__all__ = ["Journal", "JournalCorruptError", "JournalLockedError", "JournalRecord", "Record", "lock_folder",
           "pack_record", "sync_path", "unpack_record"]
