"""The demo's in-process simulation (bench.toy_sim) runs the learner's own batch building and steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import toy_sim


def test_a_short_simulation_trains_and_reports_every_step(tiny_model: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "steps.json"
    assert toy_sim.main(["--model-dir", str(tiny_model), "--steps", "3", "--out", str(out)]) == 0
    steps = json.loads(out.read_text())
    assert [s["step"] for s in steps] == [0, 1, 2]
    # A random policy's rollouts differ, so no group is alike and every step is taken.
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert all(0.0 <= s["batch"] <= 1.0 and math.isfinite(s["entropy"]) for s in steps)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["summary"] and summary["best64"] == max(s["last64"] for s in steps)


def test_the_simulation_refuses_a_negative_lag(tiny_model: Path) -> None:
    with pytest.raises(SystemExit):
        toy_sim.main(["--model-dir", str(tiny_model), "--lag", "-1"])
