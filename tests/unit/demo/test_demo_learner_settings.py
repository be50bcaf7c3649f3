"""The demo's learner options reach the learner: its environment parses into the settings asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.settings import LearnerSettings
from openforge.demo import DemoOptions, _components


def _learner_settings(options: DemoOptions, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LearnerSettings:
    components = _components(options, tmp_path, {}, "http://127.0.0.1:1", 1, tmp_path / "model")
    env = next(env for name, _, env in components if name == "learner")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return LearnerSettings()


def test_the_defaults_leave_alike_groups_out_with_an_adaptive_bonus(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    settings = _learner_settings(DemoOptions(), monkeypatch, tmp_path)
    assert settings.filter_alike_groups and not settings.norm_adv_by_std
    assert settings.entropy_target == 1.0 and settings.entropy_coeff_max == 0.02
    assert settings.adam_eps == 1e-8 and settings.lr == 1e-2


def test_changed_options_arrive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    options = DemoOptions(filter_alike_groups=False, adam_eps=1e-5, entropy_target=None, entropy_coeff=0.01,
                          norm_adv_by_std=True, lr=3e-3)
    settings = _learner_settings(options, monkeypatch, tmp_path)
    assert not settings.filter_alike_groups and settings.norm_adv_by_std
    assert settings.adam_eps == 1e-5 and settings.lr == 3e-3
    assert settings.entropy_target is None and settings.entropy_coeff == 0.01
