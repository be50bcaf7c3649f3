"""Retention of checkpoint folders: exactly what the policy keeps survives, across restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.checkpoint import (
    STATE_FILE,
    LearnerState,
    Retention,
    apply_retention,
    remove_leftovers,
    serving_folder,
    serving_versions,
    state_folder,
    training_states,
    write_checkpoint_folder,
)


def _serving(root: Path, version: int) -> None:
    write_checkpoint_folder(serving_folder(root, version),
                            lambda f: (f / "model.safetensors").write_bytes(b"\0" * 8))


def _state(root: Path, step: int) -> None:
    write_checkpoint_folder(state_folder(root, step), lambda f: (f / "shard").write_bytes(b"\1"),
                            LearnerState(step // 2, step, {}, {}))


SERVING = Retention(keep_last=3, keep_every=4)
STATES = Retention(keep_last=2, keep_every=10)


def test_retention_keeps_the_last_k_and_every_mth_of_each_kind(tmp_path: Path) -> None:
    for version in range(1, 10):
        _serving(tmp_path, version)
    for step in range(2, 26, 2):
        _state(tmp_path, step)
    _serving(tmp_path, 10)  # an orphan above the newest published version: its next save replaces it

    deleted = apply_retention(tmp_path, SERVING, STATES, newest_version=9, newest_state=24)

    assert sorted(serving_versions(tmp_path)) == [4, 7, 8, 9, 10]
    assert sorted(training_states(tmp_path)) == [10, 20, 22, 24]
    assert len(deleted) == 5 + 8
    assert not any(p.exists() for p in deleted)
    assert not [p for p in tmp_path.rglob(".*")]  # nothing half deleted left behind


def test_retention_across_a_restart_also_deletes_what_the_earlier_run_left(tmp_path: Path) -> None:
    for version in range(1, 6):
        _serving(tmp_path, version)
    for step in (5, 10, 15):
        _state(tmp_path, step)
    # The first run crashed mid-write and mid-delete: leftovers under temporary names.
    (serving_folder(tmp_path, 6).with_name(".tmp-v00000006-abcd1234")).mkdir()
    (state_folder(tmp_path, 5).with_name(".del-s00000005")).mkdir()

    # The restarted process, with a stricter policy, resumes from step 15 and publishes v6 and v7.
    assert len(remove_leftovers(tmp_path)) == 2
    strict = Retention(keep_last=1)
    apply_retention(tmp_path, strict, strict, newest_version=5, newest_state=15)
    assert sorted(serving_versions(tmp_path)) == [5]
    assert sorted(training_states(tmp_path)) == [15]
    for version in (6, 7):
        _serving(tmp_path, version)
        apply_retention(tmp_path, strict, strict, newest_version=version, newest_state=15)
    assert sorted(serving_versions(tmp_path)) == [7]
    assert sorted(training_states(tmp_path)) == [15]
    assert json.loads((state_folder(tmp_path, 15) / STATE_FILE).read_text())["step"] == 15


def test_the_resume_point_and_newest_version_are_kept_whatever_the_policy(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _state(tmp_path, step)
    _serving(tmp_path, 1)
    _serving(tmp_path, 2)
    one = Retention(keep_last=1)
    # The newest published is v1 (v2 is an orphan); the resume point is step 2 (say step 3 failed to load).
    apply_retention(tmp_path, one, one, newest_version=1, newest_state=2)
    assert sorted(serving_versions(tmp_path)) == [1, 2]
    assert sorted(training_states(tmp_path)) == [2, 3]


def test_an_empty_or_incomplete_state_folder_is_not_a_training_state(tmp_path: Path) -> None:
    state_folder(tmp_path, 7).mkdir(parents=True)  # no state file: never renamed into place by this code
    assert training_states(tmp_path) == {}


@pytest.mark.parametrize("bad", [dict(keep_last=0), dict(keep_last=1, keep_every=0)])
def test_a_policy_that_keeps_nothing_is_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        Retention(**bad)
