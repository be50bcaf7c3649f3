"""Settings the proxy no longer has: a start with one set fails, saying what to use instead."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from proxy.cli import proxy_command
from proxy.settings import REMOVED_SETTINGS, ProxySettings


@pytest.mark.parametrize(("variable", "value", "instead"), [
    # `ack` durability, ack-and-spool, is gone: the journal gives its promise without a broker
    # round trip in every answer.
    ("OPENFORGE_PROXY_DURABILITY", "ack", "kept in the local journal"),
    # A value that named what the proxy does now is refused as well: the setting does nothing.
    ("OPENFORGE_PROXY_DURABILITY", "journal", "Remove the setting"),
    ("OPENFORGE_PROXY_CAPTURE_LINGER_MS", "5", "OPENFORGE_PROXY_JOURNAL_LINGER_MS"),
    # One shipper placement: on the proxy's event loop.
    ("OPENFORGE_PROXY_JOURNAL_SHIPPER", "process", "ships its journal from its own event loop"),
])
def test_the_proxy_refuses_to_start_with_a_removed_setting_and_says_what_to_use(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, instead: str) -> None:
    for name in REMOVED_SETTINGS:
        monkeypatch.delenv(f"OPENFORGE_PROXY_{name.upper()}", raising=False)
    result = CliRunner().invoke(proxy_command, [], env={variable: value, "OPENFORGE_PROXY_ALLOW_ANONYMOUS": "true"})
    assert result.exit_code == 1, result.output
    assert f"{variable} is gone" in result.output and instead in result.output, result.output
    assert "Traceback" not in result.output


def test_without_them_the_settings_are_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in REMOVED_SETTINGS:
        monkeypatch.delenv(f"OPENFORGE_PROXY_{name.upper()}", raising=False)
    settings = ProxySettings()
    assert all(getattr(settings, name) is None for name in REMOVED_SETTINGS)
    assert not set(REMOVED_SETTINGS) & set(settings.model_dump())  # nothing reads them
