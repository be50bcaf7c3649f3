"""The free-space floor under the proxy's event log, read from the real disk."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

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
