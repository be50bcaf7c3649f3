"""A bounded on-disk spool of encoded Kafka records.

When Kafka is unreachable the proxy must neither drop a model call nor block the
harness indefinitely, so events go to local disk and drain when the broker is
back. One file per record, written to a temporary name, fsynced and renamed, so
a crash leaves either a whole record or none; names sort in arrival order, which
keeps each rollout's events in the order they happened.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_MAGIC = b"OFSPOOL1"
_U32 = struct.Struct("<I")


class SpoolFullError(Exception):
    """The spool holds its configured maximum; the caller must refuse new work (503)."""


@dataclass(frozen=True)
class SpooledRecord:
    """One record waiting for Kafka."""

    path: Path
    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]


def pack_record(topic: str, key: bytes | None, value: bytes, headers: tuple[tuple[str, bytes], ...]) -> bytes:
    """One Kafka record as bytes (spool files and journal frames share this encoding)."""
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


def unpack_record(path: Path, blob: bytes) -> SpooledRecord:
    """The record :func:`pack_record` encoded; ``path`` names its file in errors.

    Straight-line rather than a helper per field: the journal's shipper reads every call's
    record through here.

    Raises:
        ValueError: not a record, or truncated.
    """
    if not blob.startswith(_MAGIC):
        raise ValueError(f"{path} is not a spool record")
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
        raise ValueError(f"{path} is truncated") from None
    if len(value) != size:
        raise ValueError(f"{path} is truncated")
    return SpooledRecord(path, topic, key if has_key else None, value, tuple(headers))


def sync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (a rename into it), to disk, through a descriptor of its own."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolLockedError(RuntimeError):
    """Another process spools events into this folder."""


def lock_folder(path: Path, refusal: str, error: type[RuntimeError] = SpoolLockedError) -> int:
    """An exclusive lock on ``path`` (created), held until its descriptor is closed.

    Two proxies given one spool folder (the default is relative to where each starts) would
    number their files alike and overwrite each other's records; the second is refused at start
    instead. A process that died released its lock with it.

    Raises:
        SpoolLockedError: another process holds it (``error``, with ``refusal`` as its message).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise error(f"{refusal}: give each proxy a spool folder of its own (OPENFORGE_PROXY_SPOOL_DIR)") from None
    return fd



SPOOL_LOCK = "writer.lock"
"""The file in a spool folder whose lock marks the one process writing there."""


class DiskSpool:
    """Append-and-drain spool in one folder, bounded by total bytes."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._folder_lock: int | None = None
        self._count_files()

    def _count_files(self) -> None:
        files = sorted(self.directory.glob("*.rec"))
        sizes = []
        for f in files:
            # Before claim(), another process's drain may remove a file between listing and stat.
            with contextlib.suppress(FileNotFoundError):
                sizes.append(f.stat().st_size)
        self._bytes = sum(sizes)
        self._count = len(sizes)
        self._seq = int(files[-1].stem) + 1 if files else 0

    def claim(self) -> None:
        """Lock the folder for this process, then clear what an earlier writer left half-done.

        The lock comes first: a temp file in a folder another live process spools into is that
        process's append in progress, not a leftover. Idempotent.

        Raises:
            SpoolLockedError: another process spools into this folder.
        """
        if self._folder_lock is not None:
            return
        self._folder_lock = lock_folder(self.directory / SPOOL_LOCK,
                                        f"another process is spooling events in {self.directory}")
        for leftover in self.directory.glob("*.tmp"):
            # An append that never returned (its call was never answered, and the harness sent
            # it again under a new id): kept, it would be a second sample of that turn.
            leftover.unlink(missing_ok=True)
        self._count_files()

    def release(self) -> None:
        """Let another process claim the folder. Idempotent."""
        if self._folder_lock is not None:
            os.close(self._folder_lock)
            self._folder_lock = None

    @property
    def size_bytes(self) -> int:
        """Bytes currently spooled."""
        return self._bytes

    def __len__(self) -> int:
        return self._count

    @property
    def full(self) -> bool:
        """True when nothing more should be accepted."""
        return self._bytes >= self.max_bytes

    def append(self, topic: str, key: bytes | None, value: bytes,
               headers: tuple[tuple[str, bytes], ...], *, force: bool = False) -> Path:
        """Write one record durably (fsync) before returning.

        Args:
            topic: Full topic name.
            key: Record key.
            value: Encoded value.
            headers: Record headers.
            force: Accept even when full. Used for a call already answered by the
                engine: losing it would be worse than overshooting the bound once.

        Raises:
            SpoolFullError: the spool is full and ``force`` is false.
        """
        blob = pack_record(topic, key, value, headers)
        with self._lock:
            if not force and self._bytes + len(blob) > self.max_bytes:
                raise SpoolFullError(f"spool holds {self._bytes:,} of {self.max_bytes:,} bytes")
            seq = self._seq
            self._seq += 1
            self._bytes += len(blob)
            self._count += 1
        final = self.directory / f"{seq:020d}.rec"
        tmp = final.with_suffix(".tmp")
        try:
            with tmp.open("wb") as handle:
                handle.write(blob)
                handle.flush()
                os.fsync(handle.fileno())
            tmp.rename(final)
        except BaseException:
            # Nothing was kept: counted, it would hold the spool "not empty" (and its publisher
            # off Kafka) for good, and fill the bound with bytes that are not there.
            tmp.unlink(missing_ok=True)
            self._forget(tmp, len(blob))
            raise
        try:
            sync_path(self.directory)  # the rename itself survives a power cut
        except OSError as exc:  # the record is whole and in place; only a power cut now could lose its name
            logger.warning("flushing the spool folder %s failed: %s", self.directory, exc)
        return final

    def oldest(self, limit: int) -> list[SpooledRecord]:
        """Up to ``limit`` records in arrival order (corrupt files are set aside)."""
        out = []
        for path in sorted(self.directory.glob("*.rec"))[:limit]:
            try:
                out.append(unpack_record(path, path.read_bytes()))
            except (ValueError, struct.error, FileNotFoundError):
                size = path.stat().st_size if path.exists() else 0
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".corrupt"))
                self._forget(path, size)
        return out

    def remove(self, record: SpooledRecord) -> None:
        """Delete a record once Kafka acknowledged it."""
        try:
            size = record.path.stat().st_size
            record.path.unlink()
        except FileNotFoundError:
            return
        self._forget(record.path, size)

    def _forget(self, _path: Path, size: int) -> None:
        with self._lock:
            self._bytes = max(0, self._bytes - size)
            self._count = max(0, self._count - 1)
