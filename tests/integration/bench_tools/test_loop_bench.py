"""``python -m bench.loop --quick``: the table is printed and its figures agree with each other.

The run is short and the machine shared, so nothing here judges speed: the goals are printed, not
asserted. What is asserted could only fail if the benchmark measured something other than the
loop it claims to: every trajectory the learner trained carries all of its sampled tokens (trained
or masked), the learner's counts match what its worker was asked to do, nothing trained is older
than the bound, and the synchronous schedule trains only what the newest weights sampled.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.loop import QUICK

pytestmark = pytest.mark.kafka

SCHEDULES = ("asynchronous", "asynchronous_every_step", "synchronous")


@pytest.mark.timeout(600)
def test_quick_run_prints_the_table_and_its_counts_add_up(kafka_bootstrap: str, tmp_path: Path) -> None:
    figures = tmp_path / "loop.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.loop", "--quick", "--kafka", kafka_bootstrap, "--json", str(figures)],
        capture_output=True, text=True, timeout=570, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    table = done.stdout
    for label in ("trained tokens/s", "vs sync", "learner idle", "rollout-slot idle", "staleness mean / p99",
                  "masked tokens (stale)", "dropped trajectories", "whole run (start to stop)"):
        assert label in table, label
    assert table.count("goal: ") == 3

    data = json.loads(figures.read_text())
    config, results = data["config"], data["results"]
    assert set(results) == set(SCHEDULES)
    assert config["seconds"] == QUICK["seconds"] and config["slots"] == QUICK["slots"]
    per_trajectory = config["turns"] * config["completion_tokens"]
    for name, r in results.items():
        t = r["totals"]
        assert r["steps"] >= 1, name
        assert math.isclose(r["tokens_per_s"] * r["window_s"], r["trained_tokens"], rel_tol=1e-9), name
        assert 0.0 <= r["learner_idle"] <= 1.0 and 0.0 <= r["slot_idle"] <= 1.0, name
        assert r["staleness_mean"] <= r["staleness_p99"] <= r["staleness_max"] <= r["max_staleness"], name
        assert not r["rollouts_failed"], (name, r["rollouts_failed"])
        # The learner's own counts are what its worker was given.
        assert t["learner_steps"] == t["worker_steps"] and t["learner_trained_tokens"] == t["worker_trained_tokens"]
        assert t["aged_trajectories"] == t["trained_trajectories"]
        assert sum(r["dropped"].values()) == t["dropped_trajectories"]
        # Every rollout made its calls and every trained one reached the learner whole.
        assert t["rollouts_launched"] >= t["rollouts_ended"] >= t["trajectories_on_topic"] >= (
            t["trained_trajectories"] + t["dropped_trajectories"]), (name, t)
        assert t["learner_trained_tokens"] + r["masked_tokens"] == t["trained_trajectories"] * per_trajectory, name
        assert t["trained_trajectories"] <= t["learner_steps"] * config["group_size"] * config["groups_per_step"]
        assert r["trained_tokens"] <= r["steps"] * config["group_size"] * config["groups_per_step"] * per_trajectory
    sync = results["synchronous"]
    assert sync["staleness_max"] == 0 and sync["masked_tokens"] == 0 and not sync["dropped"]
    speedup = results["asynchronous"]["tokens_per_s"] / sync["tokens_per_s"]
    assert data["goals"]["ratio"]["value"] == f"{speedup:.2f}x"
