"""The record encoding of the journal's frames: round trip, and every cut refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.journal import pack_record, unpack_record

RECORDS = [
    ("t.calls", b"rollout-1", b'{"x":1}', (("schema", b"model_call"), ("schema-version", b"1"))),
    ("t.calls", None, b"", ()),
    ("t\u00e9", b"", b"v" * 300, (("", b""),)),
]


@pytest.mark.parametrize("record", RECORDS)
def test_a_record_reads_back_as_written(record: tuple[str, bytes | None, bytes, tuple[tuple[str, bytes], ...]]) -> None:
    assert unpack_record(Path("r"), pack_record(*record)) == record


@pytest.mark.parametrize("record", RECORDS)
def test_every_cut_of_a_record_is_refused(record: tuple[str, bytes | None, bytes, tuple[tuple[str, bytes], ...]]) -> None:
    blob = pack_record(*record)
    for end in range(len(blob)):
        with pytest.raises(ValueError, match="truncated|no journal record|codec"):
            unpack_record(Path("r"), blob[:end])
