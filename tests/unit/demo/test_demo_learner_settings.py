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


def test_the_defaults_put_a_fixed_bonus_on_stuck_groups_only(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    settings = _learner_settings(DemoOptions(), monkeypatch, tmp_path)
    assert settings.filter_alike_groups and not settings.norm_adv_by_std
    assert (settings.entropy_bonus_scope, settings.max_reward) == ("stuck", 1.0)
    assert settings.entropy_target is None and settings.entropy_coeff == 0.02
    assert settings.adam_eps == 1e-8 and settings.lr == 1e-2


def test_changed_options_arrive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    options = DemoOptions(filter_alike_groups=False, bonus_scope="all", adam_eps=1e-5, entropy_target=1.0,
                          entropy_coeff=0.01, norm_adv_by_std=True, lr=3e-3)
    settings = _learner_settings(options, monkeypatch, tmp_path)
    assert not settings.filter_alike_groups and settings.norm_adv_by_std
    assert settings.entropy_bonus_scope == "all"
    assert settings.adam_eps == 1e-5 and settings.lr == 3e-3
    assert settings.entropy_target == 1.0 and settings.entropy_coeff == 0.01


def test_a_bonus_on_stuck_groups_without_the_filter_is_refused() -> None:
    with pytest.raises(ValueError, match="alike groups filtered"):
        DemoOptions(filter_alike_groups=False)


def test_the_cli_keeping_alike_groups_puts_the_bonus_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from openforge import cli

    seen: list[DemoOptions] = []
    from openforge import demo_cli

    monkeypatch.setattr(demo_cli, "run_demo", seen.append)
    result = CliRunner().invoke(cli.main, ["demo", "--keep-alike-groups"])
    assert result.exit_code == 0, result.output
    assert seen[0].bonus_scope == "all" and not seen[0].filter_alike_groups


def test_the_demos_proxy_samples_as_the_policy_the_learner_scores(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from proxy.settings import POLICY_SAMPLING, ProxySettings

    components = _components(DemoOptions(), tmp_path, {}, "http://127.0.0.1:1", 1, tmp_path / "model")
    for name, value in next(env for name, _, env in components if name == "proxy").items():
        monkeypatch.setenv(name, value)
    assert ProxySettings().sampling == POLICY_SAMPLING


@pytest.mark.parametrize("local", [True, False])
def test_the_shells_kafka_security_reaches_an_external_cluster_and_never_the_demos_own_broker(
        monkeypatch: pytest.MonkeyPatch, local: bool) -> None:
    from openforge.demo import _LOCAL_KAFKA, _base_env
    from stream import KafkaSettings

    shell = {"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "SCRAM-SHA-512", "SASL_USERNAME": "u",
             "SASL_PASSWORD": "elsewhere-secret"}
    for name, value in shell.items():
        monkeypatch.setenv(f"OPENFORGE_KAFKA_{name}", value)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9092", **(_LOCAL_KAFKA if local else {}))
    for name, value in _base_env(kafka, "key", local=local).items():  # what the demo's processes read
        monkeypatch.setenv(name, value)
    for settings in (kafka, KafkaSettings()):
        assert settings.security_protocol == ("PLAINTEXT" if local else "SASL_PLAINTEXT")
        assert (settings.sasl_password is None) == local


def test_the_demo_trains_at_the_learners_default_staleness_bound(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    # Versions count publishes, so the default bound keeps training at any checkpoint interval:
    # the demo sets none of its own.
    settings = _learner_settings(DemoOptions(), monkeypatch, tmp_path)
    assert settings.max_staleness == LearnerSettings.model_fields["max_staleness"].default
    assert settings.checkpoint_every == 1  # a new served version after every step, so the curve moves


def test_the_control_run_steps_with_learning_rate_zero_and_nothing_else_changes(monkeypatch: pytest.MonkeyPatch,
                                                                                 tmp_path: Path) -> None:
    learning = _learner_settings(DemoOptions(), monkeypatch, tmp_path)
    control = _learner_settings(DemoOptions(control=True), monkeypatch, tmp_path)
    assert control.lr == 0.0 and learning.lr > 0
    assert control.model_dump(exclude={"lr"}) == learning.model_dump(exclude={"lr"})


def test_the_cli_control_flag_reaches_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from openforge import cli, demo_cli

    seen: list[DemoOptions] = []
    monkeypatch.setattr(demo_cli, "run_demo", seen.append)
    assert CliRunner().invoke(cli.main, ["demo", "--control"]).exit_code == 0
    assert CliRunner().invoke(cli.main, ["demo"]).exit_code == 0
    assert [o.control for o in seen] == [True, False]
