"""The free-space floor under the proxy's journal and the journal's share of its volume, read from real disks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from small_volume import on_small_volume

from producers.disk_room import DiskRoom


def _free(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def test_the_floor_is_read_from_the_disk_and_kept_a_while(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="producers.disk_room")
    off = DiskRoom(tmp_path, 0)
    assert off.ok and off.free_bytes is not None  # no floor: never refuses, still says what is free (/ready)
    room = DiskRoom(tmp_path, 1 << 62, every_s=3600)  # more than any disk here
    assert not room.ok and room.free_bytes is not None and abs(room.free_bytes - _free(tmp_path)) < 1 << 30
    assert [r.levelno for r in caplog.records] == [logging.ERROR] and "refusing calls" in caplog.text
    room.min_free_bytes = 1
    assert not room.ok  # looked at once an hour: the answer of the last look
    room.every_s = 0
    assert room.ok and "taking calls again" in caplog.records[-1].getMessage()


def test_once_refusing_calls_are_taken_again_only_a_margin_above_the_floor(tmp_path: Path) -> None:
    # Other work on this machine moves the free space by a few MiB: the steps here are wider.
    free = _free(tmp_path)
    room = DiskRoom(tmp_path, free + (32 << 20), every_s=0)
    assert not room.ok
    room.min_free_bytes = free - (16 << 20)  # above the floor again, but not by the margin (64 MiB here)
    assert not room.ok
    room.min_free_bytes = free - (256 << 20)
    assert room.ok
    room.min_free_bytes = free - (16 << 20)  # taking calls: the floor alone counts
    assert room.ok


def test_a_look_that_fails_is_no_reason_to_refuse_nor_to_take_calls_again(tmp_path: Path) -> None:
    room = DiskRoom(tmp_path / "not made yet", 1 << 62)
    assert room.ok and room.free_bytes is None
    refusing = DiskRoom(tmp_path, 1 << 62, every_s=0)
    assert not refusing.ok
    refusing.directory = tmp_path / "gone"
    assert not refusing.ok and refusing.free_bytes is None  # the last look's word stands


def test_free_inodes_count_where_the_filesystem_has_a_fixed_number(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A volume shared with other files can run out of inodes before bytes.
    stat = os.statvfs(tmp_path)
    assert stat.f_files > 0, f"the filesystem under {tmp_path} has no fixed number of inodes to test against"
    caplog.set_level(logging.INFO, logger="producers.disk_room")
    room = DiskRoom(tmp_path, 1, every_s=0, min_free_inodes=stat.f_favail + 100_000)
    assert not room.ok and room.free_inodes is not None and abs(room.free_inodes - stat.f_favail) < 50_000
    assert "inodes free, below the" in caplog.text
    room.min_free_inodes = 1
    assert room.ok and "taking calls again" in caplog.records[-1].getMessage()
    assert DiskRoom(tmp_path, 0, min_free_inodes=stat.f_favail + 100_000).ok  # no floor: inodes neither


_SPACE_OF = """
import json, sys
from pathlib import Path
from producers.disk_room import JournalSpace
floor = None if sys.argv[2] == "-" else int(sys.argv[2])
try:
    space = JournalSpace.of(Path(sys.argv[1]) / "journal", floor)
except ValueError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    print(json.dumps({"volume": space.volume_bytes, "segment": space.segment_bytes, "floor": space.min_free_bytes}))
"""


def _space_on_a_small_volume(tmp_path: Path, size_mib: int, floor: int | None = None) -> dict[str, object]:
    """JournalSpace.of on a real tmpfs of ``size_mib`` MiB, mounted for this call alone."""
    mount = tmp_path / f"volume-{size_mib}-{floor}"
    mount.mkdir()
    argv = on_small_volume(size_mib, mount, [sys.executable, "-c", _SPACE_OF, str(mount),
                                              "-" if floor is None else str(floor)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize(("size_mib", "segment_mib"), [(16, 1), (80, 5), (512, 32), (2048, 64)])
def test_segment_and_floor_scale_with_a_small_volume(tmp_path: Path, size_mib: int, segment_mib: int) -> None:
    # On an 80 MiB volume a 64 MiB segment and a 64 MiB floor left the journal 16 MiB: its first
    # segment never filled to be deleted, and every call got 503 with Kafka holding every event.
    space = _space_on_a_small_volume(tmp_path, size_mib)
    assert space == {"volume": size_mib << 20, "segment": segment_mib << 20, "floor": segment_mib << 20}


def test_a_volume_too_small_or_a_floor_too_high_is_refused_saying_what_to_change(tmp_path: Path) -> None:
    tiny = _space_on_a_small_volume(tmp_path, 8)
    assert "holds 8.0 MiB; the journal needs at least 16 MiB" in str(tiny["refused"])
    greedy = _space_on_a_small_volume(tmp_path, 80, floor=64 << 20)  # what the proxy kept before, on this volume
    assert "OPENFORGE_PROXY_MIN_FREE_DISK_BYTES=67108864 leaves the journal less than 20 MiB" in str(greedy["refused"])
    assert "unset, it keeps 5 MiB free" in str(greedy["refused"])
    assert _space_on_a_small_volume(tmp_path, 80, floor=0)["floor"] == 0  # off, as asked
