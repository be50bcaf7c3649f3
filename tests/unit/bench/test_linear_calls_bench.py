"""The calls-topic bytes benchmark runs through the proxy's record path and meets its goals."""

from __future__ import annotations

import pytest

from bench.linear_calls import Shape, conversation, main


def test_linear_events_are_ten_times_smaller_at_thirty_turns_and_flat_per_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0, capsys.readouterr().out
    assert "| 30 | forks |" in capsys.readouterr().out


def test_every_call_after_the_first_is_stored_by_reference() -> None:
    shape = Shape(system_tokens=50, sampled_tokens=10, tool_tokens=20, respelled=3, chars_per_token=2)
    short, long = conversation(5, "forks", shape, seed=1), conversation(15, "forks", shape, seed=1)
    assert short.linear < short.whole and long.last_linear < long.last_whole / 3
