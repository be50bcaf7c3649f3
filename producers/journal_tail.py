"""The shipping side of a journal that another process appends to.

The proxy appends to its journal (:class:`producers.journal.Journal`) and a shipper process of its
own reads it here, sends it to Kafka and moves the ``shipped`` mark (see
:mod:`producers.ship_worker`). The two share nothing but the folder:

* the writer only appends, rolls segments and flushes; it learns how far Kafka has the journal
  from the shipper, to bound what it takes;
* this reader owns the cursor, the ``shipped`` mark and deleting shipped segments.

A frame may be visible here while the writer is still copying it into the page cache (Linux makes
a buffered ``write`` visible page by page): a frame that ends past what the file holds at the end
of the newest segment is simply not there yet, and is read on the next poll. Anywhere else a short
or failing frame is damage. A crashed writer's torn tail never reaches this reader: the writer cuts
it when it opens the journal again, and it opens the journal only while no reader runs (the lock
file :data:`LOCK_NAME`, held by the reader for its whole life).
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import threading
import time
from pathlib import Path

from producers.journal import (
    _FRAME,
    _READ_CHUNK,
    JournalCorruptError,
    JournalRecord,
    ShippedMark,
    _remove_shipped,
    frame_record,
)

logger = logging.getLogger(__name__)

LOCK_NAME = "shipper.lock"
"""File in the journal's folder a shipper (the shipping process, or an inline one) holds a lock on while it runs."""

LOCK_WAIT_S = 60.0
"""How long a new shipper waits for an old one (draining as its proxy exits) to let go."""


def lock_shipping(directory: Path, timeout_s: float, abandon: threading.Event | None = None) -> int:
    """An exclusive lock on the journal's shipper lock file (a descriptor to close to release it).

    Raises:
        TimeoutError: another shipper held it for ``timeout_s``.
        InterruptedError: ``abandon`` was set before the lock was taken.
    """
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if abandon is not None and abandon.is_set():
                os.close(fd)
                raise InterruptedError(f"waiting for {directory / LOCK_NAME} was given up") from None
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(f"another shipper has held {directory / LOCK_NAME} for {timeout_s:.0f}s") from None
            time.sleep(0.05)


async def lock_shipping_async(directory: Path, timeout_s: float) -> int:
    """:func:`lock_shipping` waited for in a thread; a cancelled wait leaves no lock behind.

    A plain ``asyncio.to_thread`` would go on waiting in its thread after the caller was
    cancelled (a proxy stopped while an old one drains), then take the lock with nobody left to
    close it, so every later shipper on the folder would wait for this process to exit.
    """
    abandon = threading.Event()
    taken = asyncio.get_running_loop().run_in_executor(None, lock_shipping, directory, timeout_s, abandon)
    try:
        return await asyncio.shield(taken)
    except asyncio.CancelledError:
        abandon.set()
        taken.add_done_callback(_close_taken_lock)
        raise


def _close_taken_lock(taken: asyncio.Future[int]) -> None:
    if not taken.cancelled() and taken.exception() is None:
        os.close(taken.result())


class JournalTail:
    """Cursor, ``shipped`` mark and clean-up over a journal folder written by someone else."""

    def __init__(self, directory: Path, *, mark_interval_s: float = 1.0) -> None:
        """Open with :meth:`open`.

        Args:
            directory: The journal's folder.
            mark_interval_s: Least time between writes of the ``shipped`` mark. The proxy learns
                progress from the worker's reports, not from the mark: it only bounds what a
                restart sends again (copies consumers drop by event id). Writing it (a new file
                and a rename) after every batch cost about 4 % of the shipper's CPU.
        """
        self.directory = directory
        self.mark_interval_s = mark_interval_s
        self._shipped = -1
        self._mark = ShippedMark(directory, mark_interval_s)
        self._swept_behind: Path | None = None  # the cursor's segment when older ones were last deleted
        self._seq = 0  # the next record to read
        self._first_seq = 0  # of the segment the cursor is in
        self._path: Path | None = None
        self._fd: int | None = None
        self._offset = 0

    @property
    def shipped(self) -> int:
        """Every record up to this sequence number is in Kafka (-1: none yet)."""
        return self._shipped

    def open(self) -> None:
        """Read the mark and put the cursor on the first record not shipped."""
        self._shipped = self._mark.read()
        segments = self._segments()
        if segments and segments[0][0] - 1 > self._shipped:
            # Older segments were deleted as shipped after a mark that was not written in time.
            self._shipped = segments[0][0] - 1
        self._seek(self._shipped + 1)

    def close(self) -> None:
        """Write the mark and release the segment. Idempotent."""
        self.write_mark(force=True)
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._path = None, None

    def _segments(self) -> list[tuple[int, Path]]:
        return sorted((int(path.stem), path) for path in self.directory.glob("*.log"))

    def _seek(self, seq: int) -> None:
        """Cursor on record ``seq``: in the last segment that starts at or before it."""
        self._close_fd()
        segments = [s for s in self._segments() if s[0] <= seq]
        self._seq, self._offset = seq, 0
        if not segments:
            self._path = None
            return
        self._first_seq, self._path = segments[-1]
        self._fd = os.open(self._path, os.O_RDONLY)
        current = self._first_seq
        size = os.fstat(self._fd).st_size
        while current < seq and self._offset + _FRAME.size <= size:
            length, _, _ = _FRAME.unpack(os.pread(self._fd, _FRAME.size, self._offset))
            self._offset += _FRAME.size + length
            current += 1
        if current != seq:
            raise JournalCorruptError(f"{self._path} ends before record {seq} (at {current})")

    def _next_segment(self) -> tuple[int, Path] | None:
        for first_seq, path in self._segments():
            if first_seq > self._first_seq:
                return first_seq, path
        return None

    def read(self, max_records: int, max_bytes: int) -> list[JournalRecord]:
        """The next complete records after the cursor, oldest first (none when nothing new)."""
        out: list[JournalRecord] = []
        taken = 0
        while len(out) < max_records and (not out or taken < max_bytes):
            if self._fd is None:
                self._seek(self._seq)  # the writer had not created a segment yet
                if self._fd is None:
                    break
            assert self._fd is not None
            assert self._path is not None
            size = os.fstat(self._fd).st_size
            if self._offset >= size:
                newer = self._next_segment()
                if newer is None:
                    break  # nothing new yet
                if self._offset < os.fstat(self._fd).st_size:
                    continue  # written before the roll: read it first
                if newer[0] != self._seq:
                    raise JournalCorruptError(f"{newer[1]} starts at record {newer[0]}, expected {self._seq}")
                self._close_fd()
                self._first_seq, self._path = newer
                self._fd = os.open(self._path, os.O_RDONLY)
                self._offset = 0
                continue
            chunk = os.pread(self._fd, min(size - self._offset, max(_READ_CHUNK, max_bytes - taken)), self._offset)
            position = 0
            complete = True
            while len(out) < max_records and (not out or taken < max_bytes):
                if position + _FRAME.size > len(chunk):
                    at = self._offset + position
                    complete = at == size or at + _FRAME.size <= size
                    break
                length, crc, seq = _FRAME.unpack_from(chunk, position)
                end = position + _FRAME.size + length
                if end > len(chunk):
                    complete = self._offset + end <= size
                    if not (complete and position == 0):
                        break
                    chunk = os.pread(self._fd, end, self._offset)  # one frame larger than the chunk
                    if len(chunk) < end:
                        # The file shrank since its size was read: the writer took back a failed
                        # append, and this frame, written in its place, is not whole yet.
                        break
                out.append(frame_record(self._path, self._offset + position, chunk[position + _FRAME.size:end],
                                        length, crc, seq, self._seq))
                taken += _FRAME.size + length
                self._seq = seq + 1
                position = end
            self._offset += position
            if not complete:
                # A frame runs past the end of the file. In the newest segment it is still being
                # written; in an older one the writer finished it before rolling, or took back a
                # failed append and wrote a shorter frame in its place (the file changed size
                # since it was read: read again), or never did and failed to cut it on recovery:
                # damage.
                if self._next_segment() is None:
                    break
                if os.fstat(self._fd).st_size != size:
                    continue
                raise JournalCorruptError(f"{self._path} ends in a torn record at byte {self._offset:,}")
        return out

    def rewind(self) -> None:
        """Put the cursor back on the first record not shipped (after a failed send)."""
        self._seek(self._shipped + 1)

    def mark_shipped(self, records: list[JournalRecord]) -> None:
        """Kafka acknowledged ``records`` (the oldest not shipped, in order)."""
        if not records:
            return
        if records[0].seq != self._shipped + 1:
            raise ValueError(f"shipped {records[0].seq} before {self._shipped + 1}")
        self._shipped = records[-1].seq
        if self._path is not None and self._path == self._swept_behind:
            # Nothing older can have become shipped since the last sweep: the cursor is in the
            # same segment. Listing the folder after every batch cost more than the mark.
            self.write_mark()
            return
        segments = self._segments()
        done = [path for (_, path), (next_first, _) in itertools.pairwise(segments)
                if next_first - 1 <= self._shipped and path != self._path]
        # The mark before the deletion: a restarted shipper must not look for deleted records.
        self.write_mark(force=bool(done))
        # Oldest first, stopping at the first that stays: a gap would leave the next start's mark
        # (if the mark could not be written) pointing into it, and the journal would read as damaged.
        deleted = list(itertools.takewhile(_remove_shipped, done))
        left = [path for _, path in segments if path not in deleted]
        if left and left[0] == self._path:  # nothing older than the cursor's segment is left
            self._swept_behind = self._path

    def write_mark(self, *, force: bool = False) -> None:
        """Persist the ``shipped`` mark (:class:`producers.journal.ShippedMark`), if the disk lets it.

        A mark that cannot be written (a full disk) must not stop shipping, nor the deletion of
        shipped segments, which is what frees the disk: a restart reads an older mark, moves it
        up to the first segment left, and sends again at most what that segment held.
        """
        try:
            self._mark.write(self._shipped, force=force)
        except OSError as exc:
            logger.warning("could not write the journal's shipped mark in %s: %s", self.directory, exc)


__all__ = ["LOCK_NAME", "JournalTail"]
