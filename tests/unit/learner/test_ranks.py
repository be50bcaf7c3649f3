"""Which processes count as several ranks, and which engine may run as several."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.ranks import Ranks, launched_world_size
from learner.settings import LearnerSettings


def test_without_a_launcher_there_is_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_world_size() == 4


def test_several_ranks_of_the_hf_engine_are_refused_with_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="2 ranks were launched but the 'hf' engine trains in one process; "
                                         "set OPENFORGE_LEARNER_ENGINE=fsdp"):
        Ranks.join(LearnerSettings(model_dir=Path("unused"), engine="hf"))
