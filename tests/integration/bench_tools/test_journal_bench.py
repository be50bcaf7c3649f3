"""``python -m bench.journal``: both writers measured, and what they wrote is the same journal.

The benchmark's comparison is only meaningful if both rows wrote the proxy's real record of a
whole answer, in full, to a journal that reads back; a run that swapped or skipped a writer
would still print a table.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import bench.journal as bench_journal
import producers.journal as journal_module
from producers.journal import Journal
from producers.raw_calls import RAW_EXCHANGES


def _frames(data: bytes) -> list[bytes]:
    """A segment's frames, each as its bytes (header and body)."""
    frames, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        frames.append(data[offset:offset + 16 + length])
        offset += 16 + length
    return frames


def test_each_writer_appends_the_whole_record_and_the_table_compares_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    native = journal_module._native_append_frame
    assert native is not None, "openforge_native is not installed: `make install` builds it (needs cargo)"
    used: list[str] = []
    kept: dict[str, bytes] = {}
    rounds = bench_journal._round

    def counting(records: int, append: object) -> tuple[float, float]:
        used.append("compiled" if journal_module._native_append_frame is native else "python")
        return rounds(records, append)  # type: ignore[arg-type]

    close = Journal.close

    def keeping(journal: Journal) -> None:
        [segment] = journal.directory.glob("*.log")
        kept[journal.directory.name] = segment.read_bytes()
        close(journal)

    monkeypatch.setattr(bench_journal, "_round", counting)
    monkeypatch.setattr(Journal, "close", keeping)
    assert bench_journal.main(["--records", "20", "--rounds", "2", "--dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert used.count("compiled") == used.count("python") == 4  # written and recorded, each round
    assert "compiled writer" in table and "python writer" in table and "compiled / python" in table
    assert journal_module._native_append_frame is native  # put back after the run
    # Each journal reads back 40 whole-answer records; the first 20 (the timed writes of one
    # fixed record) are the same bytes from both writers. The other 20 carry fresh event ids.
    assert set(kept) == {"compiled-0", "python-0", "compiled-1", "python-1"}
    for name, data in kept.items():
        folder = tmp_path / "check" / name
        folder.mkdir(parents=True)
        (folder / f"{0:020d}.log").write_bytes(data)
        journal = Journal(folder, 1 << 30)
        journal.open()
        records = journal.read(100, 1 << 30)
        close(journal)
        assert len(records) == 40 and all(r.topic == RAW_EXCHANGES for r in records)
    fixed = {name: _frames(data)[:20] for name, data in kept.items()}
    assert fixed["compiled-0"] == fixed["python-0"] and fixed["compiled-1"] == fixed["python-1"]
    assert not list(tmp_path.glob("openforge-bench-journal-*"))  # the temporary folder is gone
