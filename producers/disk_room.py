"""Whether the disk under an event log has room for the calls in flight.

The log's own bound (``spool_max_bytes``) counts only its bytes; a volume shared with other
files, or smaller than the bound, fills first. A call is then served by the engine and only
its record fails, with a 503 the harness retries while the pod stays in rotation. Asked before
a call begins, the disk's free space refuses it before the engine's work, and readiness says so.
Free inodes count too where the filesystem has a fixed number: a volume shared with other files
can run out of them before bytes, and the journal then cannot start a segment.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_MiB = 1 << 20

SMALLEST_VOLUME = 16 * _MiB
"""The least a journal's volume may hold: a sixteenth of it is a segment of 1 MiB, and as much
again is kept free, which still leaves room for calls of a few hundred KiB each."""

_LARGEST_SHARE = 64 * _MiB
"""Segment size and free-space floor on a volume of 1 GiB and more."""


@dataclass(frozen=True)
class JournalSpace:
    """How the journal shares its volume: the size of its segments, and the space kept free.

    A segment is deleted once every record in it is in Kafka; the active one, while not shipped
    whole, holds its space until it is full: its size is what the journal may hold on the volume
    beyond what waits for Kafka. Both scale with the volume (a
    sixteenth of it each, at most 64 MiB). Fixed at 64 MiB, they blocked an 80 MiB volume for good:
    a 64 MiB floor left 16 MiB for the journal, the first segment never filled to be deleted, and
    every call got 503 while Kafka had every event.
    """

    volume_bytes: int
    """The size of the filesystem the journal is on."""
    segment_bytes: int
    """Size at which the journal starts a new segment."""
    min_free_bytes: int
    """Free space below which calls are refused (0: no floor)."""

    @classmethod
    def of(cls, directory: Path, min_free_bytes: int | None) -> JournalSpace:
        """The shares for the volume under ``directory`` (made if missing).

        Args:
            directory: The journal's folder.
            min_free_bytes: The floor asked for, or None for the volume's share.

        Raises:
            ValueError: the volume is too small for a journal, or the floor asked for leaves the
                journal no room; the message says what to change.
            OSError: the folder cannot be made or its filesystem read.
        """
        directory.mkdir(parents=True, exist_ok=True)
        stat = os.statvfs(directory)
        volume = stat.f_blocks * stat.f_frsize
        if volume < SMALLEST_VOLUME:
            raise ValueError(f"the volume under {directory} holds {volume / _MiB:.1f} MiB; the journal needs at least "
                             f"{SMALLEST_VOLUME >> 20} MiB (OPENFORGE_PROXY_SPOOL_DIR on a larger volume)")
        share = min(_LARGEST_SHARE, volume // 16)
        floor = share if min_free_bytes is None else min_free_bytes
        if volume - floor < 4 * share:
            raise ValueError(f"OPENFORGE_PROXY_MIN_FREE_DISK_BYTES={floor} leaves the journal less than "
                             f"{4 * share >> 20} MiB of the {volume >> 20} MiB volume under {directory}: lower it "
                             f"(unset, it keeps {share >> 20} MiB free there) or give the journal a larger volume")
        return cls(volume, share, floor)


class DiskRoom:
    """Free space on the disk of ``directory`` against a floor, looked at most every ``every_s``.

    A look costs a system call; admission asks on every call, so the answer is kept a second.
    A look that fails (the folder not made yet, say) counts as room: it is no reason to refuse.
    Once below the floor, calls are taken again only a margin above it (a quarter of the floor,
    at most 64 MiB; a quarter of the inodes), so a disk that hovers at the floor does not flip
    readiness every second.
    """

    def __init__(self, directory: Path, min_free_bytes: int, every_s: float = 1.0, *,
                 min_free_inodes: int = 1024) -> None:
        self.directory = directory
        self.min_free_bytes = min_free_bytes
        self.min_free_inodes = min_free_inodes
        """Inodes kept free with the bytes (with a floor of bytes only): the journal's next segment takes one."""
        self.every_s = every_s
        self.free_bytes: int | None = None
        """Bytes free to this process at the last look (None: not looked, or the look failed)."""
        self.free_inodes: int | None = None
        """Inodes free to this process at the last look (None also where the filesystem has no fixed count)."""
        self._ok = True
        self._looked_at = -float("inf")

    @property
    def ok(self) -> bool:
        """Whether there is room above the floor (always, with a floor of 0); looks again if a second passed."""
        now = time.monotonic()
        if now - self._looked_at >= self.every_s:
            self._looked_at = now
            self._look()
        return self.min_free_bytes <= 0 or self._ok

    def _look(self) -> None:
        try:
            stat = os.statvfs(self.directory)
        except OSError:
            self.free_bytes = self.free_inodes = None
            return  # what the last look said stands: a failed look is no news about the disk
        self.free_bytes = stat.f_bavail * stat.f_frsize
        self.free_inodes = stat.f_favail if stat.f_files > 0 else None  # btrfs and others: no fixed count
        if self.min_free_bytes <= 0:
            return
        bytes_needed, inodes_needed = self.min_free_bytes, self.min_free_inodes
        if not self._ok:
            bytes_needed += min(self.min_free_bytes // 4, 64 << 20)
            inodes_needed += self.min_free_inodes // 4
        short = None  # what is short, for the log
        if self.free_bytes < bytes_needed:
            short = f"{self.free_bytes >> 20} MiB free, below the {self.min_free_bytes >> 20} MiB"
        elif self.free_inodes is not None and self.free_inodes < inodes_needed:
            short = f"{self.free_inodes} inodes free, below the {self.min_free_inodes}"
        ok = short is None
        if ok != self._ok:
            if ok:
                logger.info("%s has %d MiB and %s inodes free again: taking calls again", self.directory,
                            self.free_bytes >> 20, "enough" if self.free_inodes is None else self.free_inodes)
            else:
                logger.error("%s has %s the proxy keeps for calls in flight: refusing calls and rewards (503)",
                             self.directory, short)
        self._ok = ok


__all__ = ["SMALLEST_VOLUME", "DiskRoom", "JournalSpace"]
