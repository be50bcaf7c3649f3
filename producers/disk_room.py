"""Whether the disk under an event log has room for the calls in flight.

The log's own bound (``spool_max_bytes``) counts only its bytes; a volume shared with other
files, or smaller than the bound, fills first. A call is then served by the engine and only
its record fails, with a 503 the harness retries while the pod stays in rotation. Asked before
a call begins, the disk's free space refuses it before the engine's work, and readiness says so.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class DiskRoom:
    """Free space on the disk of ``directory`` against a floor, looked at most every ``every_s``.

    A look costs a system call; admission asks on every call, so the answer is kept a second.
    A look that fails (the folder not made yet, say) counts as room: it is no reason to refuse.
    Once below the floor, calls are taken again only a margin above it (a quarter of the floor,
    at most 64 MiB), so a disk that hovers at the floor does not flip readiness every second.
    """

    def __init__(self, directory: Path, min_free_bytes: int, every_s: float = 1.0) -> None:
        self.directory = directory
        self.min_free_bytes = min_free_bytes
        self.every_s = every_s
        self.free_bytes: int | None = None
        """Bytes free to this process at the last look (None: not looked, or the look failed)."""
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
            self.free_bytes = None
            return  # what the last look said stands: a failed look is no news about the disk
        self.free_bytes = stat.f_bavail * stat.f_frsize
        if self.min_free_bytes <= 0:
            return
        needed = self.min_free_bytes if self._ok else self.min_free_bytes + min(self.min_free_bytes // 4, 64 << 20)
        ok = self.free_bytes >= needed
        if ok != self._ok:
            logger.log(logging.INFO if ok else logging.ERROR,
                       "%s has %d MiB free, %s the %d MiB the proxy keeps for calls in flight: %s",
                       self.directory, self.free_bytes >> 20, "above" if ok else "below",
                       self.min_free_bytes >> 20, "taking calls again" if ok else "refusing calls and rewards (503)")
        self._ok = ok


__all__ = ["DiskRoom"]
