"""The shipping worker's progress lines, and what it does once the proxy that reads them is gone."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import orjson
import pytest

from producers.ship_worker import _Reporter


def test_reports_are_json_lines_and_a_broken_pipe_silences_them(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(buffer))
    report = _Reporter()
    report(7, True, 1, False)
    assert orjson.loads(buffer.getvalue()) == {"shipped": 7, "kafka_ok": True, "errors": 1, "failed": False}

    read_end, write_end = os.pipe()
    os.close(read_end)  # the proxy died: nobody reads the worker's stdout any more
    broken = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    report(8, True, 1, False)  # no exception: the worker goes on shipping
    assert report.gone
    report(9, True, 1, False)
    with contextlib.suppress(BrokenPipeError):
        broken.close()  # what the line left in the buffer cannot go anywhere either
