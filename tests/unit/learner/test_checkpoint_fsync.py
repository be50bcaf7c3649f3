"""Checkpoint durability: what ``write_checkpoint_folder`` fsyncs before it returns.

The test observes the ``os.fsync`` calls (which file or folder each one syncs, and whether the
folder had been renamed into place yet); it does not cut power, so it shows that every sync is
asked for in the right order, not what a given disk does with it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from consumers.weight_digests import MANIFEST, expected_digests, folder_digests
from learner.checkpoint import LearnerState, serving_folder, state_folder, write_checkpoint_folder


def _save(folder: Path) -> None:
    # What a worker's save writes into the (existing) temporary folder: files and a nested folder.
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    (folder / "config.json").write_text("{}")
    (folder / "extra").mkdir()
    (folder / "extra" / "optimizer.pt").write_bytes(b"\1" * 64)


def test_write_checkpoint_folder_fsyncs_every_file_and_both_folders_observed_as_calls_not_a_power_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = state_folder(tmp_path / "checkpoints", 3)
    root = final.parent
    synced: list[tuple[Path, bool]] = []  # (what was synced, whether the folder was in place by then)
    real_fsync = os.fsync

    def observed_fsync(fd: int) -> None:
        synced.append((Path(f"/proc/self/fd/{fd}").readlink(), final.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", observed_fsync)
    folder = write_checkpoint_folder(final, _save, LearnerState(3, 3, {}, {}))
    monkeypatch.undo()

    assert folder == final
    written = {p.relative_to(final) for p in final.rglob("*")}
    assert {Path("model.safetensors"), Path("config.json"), Path("extra/optimizer.pt"),
            Path("learner_state.json")} <= written
    temporary = {p for p, _ in synced if p.parent == root and p.name.startswith(".tmp-")}
    assert len(temporary) == 1, f"the folder was not synced under its temporary name: {synced}"
    tmp = temporary.pop()
    before_rename = {p.relative_to(tmp) for p, in_place in synced if p.is_relative_to(tmp) and not in_place}
    # Every file and folder inside, and the folder itself, synced under its temporary name.
    assert before_rename == written | {Path()}
    # Then the rename, by syncing the parent once the folder is in place; it is the last call.
    assert synced[-1] == (root, True)
    # The parents were created by this call, so their own parents record them.
    assert (tmp_path, False) in synced and (root.parent, False) in synced


def test_serving_weights_carry_the_learners_digests_and_training_state_none(tmp_path: Path) -> None:
    def save(folder: Path) -> None:
        header = json.dumps({"w": {"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]}}).encode()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 1024)

    serving = write_checkpoint_folder(serving_folder(tmp_path, 1), save, manifest=True)
    assert expected_digests(serving) == (folder_digests(serving), True)  # the learner's own, equal to the folder's
    state = write_checkpoint_folder(state_folder(tmp_path, 1), save, LearnerState(1, 1, {}, {}))
    assert not (state / MANIFEST).exists()
